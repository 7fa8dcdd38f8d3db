"""What the stack of early 2022 (torch 1.10, transformers 4.15) kept for the backward that today's
does not, for figures measured with it. Two differences, both in an attention written out:

- Until torch 1.11, autograd's formulas for ``_softmax`` and ``_log_softmax`` passed the op's input
  to their backward (``_softmax_backward_data(grad, result, dim, self)``), so the node saved the
  input beside the output, though the kernels read only the output (pytorch/pytorch issues #49600
  and #64000; from 1.11 the backward takes the input's dtype instead, and Hugging Face's
  ``pytorch_utils.softmax_backward_data`` passes the tensor below 1.11 and its dtype from 1.11 on).
  That input is the masked scores: one more tensor of heads x tokens² a layer, kept to the backward.
- transformers 4.15's BERT made a mask of ones when it was given none and added its extended form
  (zeros, in the parameters' dtype) to the scores in every layer; today's adds nothing then. Under
  float16 autocast the sum is float32 (the scores are float16, the mask float32), so the softmax
  input that torch 1.10 kept was float32, twice the bytes.

``stack_2022()`` makes today's torch and transformers do both while open. ``softmax_keeps_input()``:
a kernel at the ``AutogradCPU`` key (estimate mode's fake tensors live on the CPU) for the two ops,
below autocast as autograd is, so the input kept is the one the op received; gradients are those
of the ops' own backward. ``bert_masks_2022()``: BERT's eager attention adds that mask where it has
none.

Private API, through memfit.torch_private: ``below_autograd`` (running the op under the kernel, as
autograd's generated kernels do) and ``aten_kernels`` (the registrations, removed on leaving).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memfit.torch_private import aten_kernels, below_autograd

_aten = torch.ops.aten
OPS = {"_softmax": (_aten._softmax.default, _aten._softmax_backward_data.default),
       "_log_softmax": (_aten._log_softmax.default, _aten._log_softmax_backward_data.default)}


class _KeepsInput(torch.autograd.Function):
    """The op below autograd, its input and output saved (the input only to be kept, as then)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, half_to_float: bool, name: str) -> torch.Tensor:
        op, ctx.backward = OPS[name]
        with below_autograd():
            out = op(x, dim, half_to_float)
        ctx.save_for_backward(x, out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, out = ctx.saved_tensors
        return ctx.backward(grad, out, ctx.dim, x.dtype), None, None, None


def _kernel(name: str) -> Any:
    op = OPS[name][0]

    def kernel(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _KeepsInput.apply(x, dim, half_to_float, name)
        with below_autograd():
            return op(x, dim, half_to_float)
    return kernel


@contextlib.contextmanager
def softmax_keeps_input() -> Iterator[None]:
    """softmax and log_softmax save their input for the backward while open, as before torch 1.11."""
    with aten_kernels(((name, _kernel(name)) for name in OPS), "AutogradCPU"):
        yield


@contextlib.contextmanager
def bert_masks_2022() -> Iterator[None]:
    """transformers' BERT adds the extended mask of a mask of ones (zeros in the parameters' dtype)
    to its eager attention's scores where it has no mask, as 4.15 did, while open."""
    from transformers.models.bert import modeling_bert

    eager = modeling_bert.eager_attention_forward

    def with_mask(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if attention_mask is None:
            dtype = next(module.parameters()).dtype
            attention_mask = torch.zeros(query.shape[0], 1, 1, key.shape[-2], dtype=dtype, device=query.device)
        return eager(module, query, key, value, attention_mask, *args, **kwargs)

    modeling_bert.eager_attention_forward = with_mask
    try:
        yield
    finally:
        modeling_bert.eager_attention_forward = eager


@contextlib.contextmanager
def stack_2022() -> Iterator[None]:
    """Both of the above while open: what torch 1.10 with transformers 4.15 kept."""
    with softmax_keeps_input(), bert_masks_2022():
        yield
