"""Op sets for selective checkpointing (``selective:<op set>``): the op outputs each keeps
(``CheckpointPolicy.MUST_SAVE``); everything else in the region is recomputed. And the policy
that ``derive`` runs under ``torch.compile`` (``derive_policy``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from memfit.measure.host import served_later
from memfit.runtime.derive_watch import ACTIVATION_PRODUCTS, MASKS, ROWWISE, cheap
from memfit.torch_private import op_schema

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


def derive_policy(level: int, width: int | None, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC's policy for ``derive`` at ``level`` under ``torch.compile`` (runtime/unit_forward.py):
    the partitioner recomputes what the level re-derives eagerly (runtime/derive_watch.py) and
    keeps the rest. Cheap ops and views always; from level 1 (``products``) softmax, masks and the
    products of two activations that make more than either takes (q.k^T); from 2
    (``projections``) products with a weight that make no more than they take and sum over no
    more than the unit's ``width``; at 3 (``all``) every such product. Draws and in-place ops are
    kept: re-run by the partitioner, a dropout would draw a fresh mask (pytorch#190758)."""
    if op_schema(op).is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return CheckpointPolicy.MUST_SAVE
    if cheap(op) or op.is_view or op in _LAYOUT:
        return CheckpointPolicy.MUST_RECOMPUTE
    if level >= 1 and (op in ROWWISE or op in MASKS):
        return CheckpointPolicy.MUST_RECOMPUTE
    if op in ACTIVATION_PRODUCTS:  # (b)addbmm: (self,) left, right
        left, right = args[-2], args[-1]
        made = left.shape[0] * left.shape[1] * right.shape[2]
        return CheckpointPolicy.MUST_RECOMPUTE if level >= 1 and made > max(left.numel(), right.numel()) \
            else CheckpointPolicy.MUST_SAVE
    if op in _LINEAR and level >= 2:  # a linear layer's: (bias,) input, weight transposed
        left, right = args[-2], args[-1]
        if level >= 3 or (right.shape[1] <= left.shape[1] and (width is None or left.shape[1] <= width)):
            return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


_LAYOUT = _ops("clone", "_unsafe_view", "_to_copy", "alias")
_LINEAR = _ops("mm", "addmm")
