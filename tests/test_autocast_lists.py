"""Estimate mode runs CUDA's autocast op lists for a CUDA target (profiler/autocast_lists.py)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.policy import FULL, KEEP
from memfit.profiler import estimate as estimate_module
from memfit.profiler.autocast_lists import cuda_lists
from memfit.torch_private import FakeTensorMode
from memfit.trainstep import TrainStep


def _dtypes(dtype):
    with FakeTensorMode():
        a = torch.empty(4, 8, requires_grad=True)
        w = torch.empty(8, 8, requires_grad=True)
        target = torch.zeros(4, dtype=torch.long)
        with torch.autocast("cpu", dtype=dtype):
            y = a @ w
            loss = F.cross_entropy(y, target)
            return {"mm": y.dtype, "softmax": torch.softmax(y, -1).dtype, "log_softmax": F.log_softmax(y, -1).dtype,
                    "layer_norm": F.layer_norm(y, (8,)).dtype, "einsum": torch.einsum("ij,jk->ik", a, w).dtype,
                    "exp": y.exp().dtype, "sum": y.sum().dtype, "gelu": F.gelu(y).dtype,
                    "cross_entropy": loss.dtype, "loss_node": type(loss.grad_fn).__name__}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_lists_cast_as_cuda_autocast_does_and_cpus_come_back(dtype):
    cpu = _dtypes(dtype)
    with cuda_lists():
        cuda = _dtypes(dtype)
    # CUDA: products low, softmax, norms, exp, sums and the losses in float32; einsum cast too;
    # cross_entropy through its parts (log_softmax in float32 by its dtype, nll_loss), no fp32 copy
    assert cuda == {"mm": dtype, "softmax": torch.float32, "log_softmax": torch.float32,
                    "layer_norm": torch.float32, "einsum": dtype, "exp": torch.float32, "sum": torch.float32,
                    "gelu": dtype, "cross_entropy": torch.float32, "loss_node": "NllLossBackward0"}
    # CPU's own lists again after leaving: softmax and norms in the low type, cross_entropy_loss
    # cast to float32 whole
    assert _dtypes(dtype) == cpu
    assert (cpu["softmax"], cpu["layer_norm"], cpu["cross_entropy"], cpu["loss_node"]) == (
        dtype, dtype, torch.float32, "NllLossBackward0")


def test_an_amp_estimate_for_a_gpu_keeps_the_attention_probabilities_in_fp32(monkeypatch):
    """nanoGPT's written-out attention under fp16 autocast on a CUDA target: the softmax's output,
    saved for its backward, is float32 (4 bytes) and the product with V saves its fp16 cast (2):
    each block keeps 4 bytes more per probability than CPU's lists (2, one tensor for both)."""
    from memfit import zoo

    batch, heads, seq = 2, 2, 64

    def build():
        return zoo.nanogpt(batch=batch, seq=seq, vocab=256, d_model=64, n_head=heads, n_layer=2, dropout=0.0)

    step = TrainStep(optimizer="adamw", precision="amp-fp16")
    cuda = estimate_module.estimate(build, target="a100-80gb", step=step)
    monkeypatch.setattr(estimate_module, "cuda_lists", contextlib.nullcontext)
    cpu_lists = estimate_module.estimate(build, target="a100-80gb", step=step)
    for a, b in zip(cuda.units, cpu_lists.units, strict=True):
        assert a.options[KEEP].stored_bytes - b.options[KEEP].stored_bytes == 4 * batch * heads * seq * seq
        assert a.options[FULL].stored_bytes == b.options[FULL].stored_bytes
    assert memfit.predict(cuda, {}).peak_bytes > memfit.predict(cpu_lists, {}).peak_bytes
