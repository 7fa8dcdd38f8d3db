"""Op sets for selective checkpointing (``selective:<op set>``): the op outputs each keeps
(``CheckpointPolicy.MUST_SAVE``); everything else in the region is recomputed."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memfit.measure.host import served_later

_aten = torch.ops.aten


def keep(ops: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC's policy function for an op set (``functools.partial(keep, OP_SETS[name])``)."""
    if op in ops:
        served_later()
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _ops(*names: str) -> frozenset[Any]:
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


GEMM = "gemm"
WEIGHTS = "weights"
ACTIVATION_PRODUCTS = _ops("bmm", "baddbmm")  # written-out attention's q.k^T and probabilities.v
OP_SETS: dict[str, frozenset[Any]] = {
    # matrix products, convolutions and attention kernels: the dear ops; the cheap elementwise
    # ones between them (norms, activations, dropout, softmax) come back in the backward
    GEMM: _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"),
    # the products with a weight only (linear layers lower to mm/addmm, convolutions): what
    # written-out attention computes between activations (q.k^T, masking, softmax, .v, whose
    # sequence-squared outputs autograd keeps) comes back in the backward, as Megatron-LM's
    # core-attention recompute and the compilers' partitioners do
    WEIGHTS: _ops("mm", "addmm", "convolution"),
}
