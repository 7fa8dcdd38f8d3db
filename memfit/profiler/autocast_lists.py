"""CUDA's autocast op lists, for estimate mode on fake tensors (which live on the CPU, where
autocast applies CPU's lists). The two differ where it costs memory: CUDA runs softmax,
log_softmax, layer_norm, group_norm, the losses, exp, log, pow, sum and a few more in float32
(their outputs, often saved for the backward, twice the bytes), and casts einsum's inputs, mv
and the RNN cells to the low-precision type (CPU autocast casts only the products einsum calls,
mv and those cells not at all); CPU casts some ops to
float32 that CUDA does not (its whole ``cross_entropy_loss``: CUDA's runs ``log_softmax`` in
float32 through its dtype argument and keeps no float32 copy of the logits).

While ``cuda_lists()`` is open, CPU autocast runs CUDA's policy for those ops: kernels registered
at the ``AutocastCPU`` dispatch key (``torch.library``) that cast as CUDA's C++ wrappers do
(``cached_cast``: floating tensors other than float64; ``fp32_set_opt_dtype``: the ``dtype``
argument set to float32 when the first argument is such a tensor, half inputs of softmax taking
the kernel's own ``half_to_float`` path as CUDA's does), then run the op with autocast left, as
those wrappers do. Registrations are the process's while open and removed on leaving, CPU's own
kernels then in force again.

The low-precision casts here do not go through autocast's weight-cast cache (CPU's own
low-precision ops, the matrix products, convolutions and attention, keep it): a weight cast for an
``einsum`` is made at each call, as with ``cache_enabled=False``.

Private API (through torch_private): ``torch._C._ExcludeDispatchKeyGuard`` (leaving autocast
around the op, as the C++ wrappers do), an op's schema, ``torch.library.Library._destroy``
(removing the registrations: the library object's own teardown).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memfit.torch_private import aten_kernels, op_schema, without_autocast_cpu

_aten = torch.ops.aten

# (op, overload): CUDA's lists where they differ from CPU's (aten/src/ATen/autocast_mode.cpp)
LOWER_ONLY_CUDA = [("addmv", ""), ("addr", ""), ("einsum", ""), ("mv", ""), ("chain_matmul", ""),
                   ("linalg_multi_dot", ""), ("lstm_cell", ""), ("gru_cell", ""), ("rnn_tanh_cell", ""),
                   ("rnn_relu_cell", ""), ("_thnn_fused_lstm_cell", ""), ("_thnn_fused_gru_cell", "")]
FP32 = [("acos", ""), ("asin", ""), ("cosh", ""), ("erfinv", ""), ("exp", ""), ("expm1", ""), ("log", ""),
        ("log10", ""), ("log2", ""), ("log1p", ""), ("reciprocal", ""), ("rsqrt", ""), ("sinh", ""), ("tan", ""),
        ("pow", "Tensor_Scalar"), ("pow", "Tensor_Tensor"), ("pow", "Scalar"), ("softplus", ""), ("layer_norm", ""),
        ("native_layer_norm", ""), ("group_norm", ""), ("frobenius_norm", "dim"), ("nuclear_norm", ""),
        ("nuclear_norm", "dim"), ("cosine_similarity", ""), ("poisson_nll_loss", ""), ("cosine_embedding_loss", ""),
        ("nll_loss", ""), ("nll_loss2d", ""), ("hinge_embedding_loss", ""), ("kl_div", ""), ("l1_loss", ""),
        ("smooth_l1_loss", ""), ("huber_loss", ""), ("mse_loss", ""), ("margin_ranking_loss", ""),
        ("multilabel_margin_loss", ""), ("soft_margin_loss", ""), ("triplet_margin_loss", ""),
        ("multi_margin_loss", ""), ("binary_cross_entropy_with_logits", ""), ("dist", ""), ("pdist", ""),
        ("cdist", ""), ("renorm", ""), ("logsumexp", "")]
FP32_OPT_DTYPE = [("prod", ""), ("prod", "dim_int"), ("softmax", "int"), ("log_softmax", "int"), ("cumprod", ""),
                  ("cumsum", ""), ("linalg_vector_norm", ""), ("linalg_matrix_norm", ""),
                  ("linalg_matrix_norm", "str_ord"), ("sum", ""), ("sum", "dim_IntList")]
# CPU autocast casts these to float32 and CUDA's does not: run as they are
CPU_ONLY = [("avg_pool3d", ""), ("binary_cross_entropy", ""), ("grid_sampler", ""), ("polar", ""),
            ("quantile", ""), ("quantile", "scalar"), ("nanquantile", ""), ("nanquantile", "scalar"), ("stft", ""),
            ("stft", "center"), ("grid_sampler_2d", ""), ("grid_sampler_3d", ""), ("trace", ""),
            ("view_as_complex", ""), ("max_pool3d", ""), ("max_unpool2d", ""), ("max_unpool3d", ""),
            ("adaptive_avg_pool3d", ""), ("reflection_pad1d", ""), ("reflection_pad2d", ""),
            ("replication_pad1d", ""), ("replication_pad2d", ""), ("replication_pad3d", ""),
            ("cross_entropy_loss", ""), ("ctc_loss", "IntList"), ("ctc_loss", "Tensor"), ("fractional_max_pool2d", ""),
            ("fractional_max_pool3d", ""), ("adaptive_max_pool3d", ""), ("multilabel_margin_loss_forward", "")]
_SOFTMAX = {"softmax": _aten._softmax.default, "log_softmax": _aten._log_softmax.default}


def _eligible(x: Any) -> bool:
    """What CUDA's ``cached_cast`` casts: a floating tensor other than float64."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def _outside(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with without_autocast_cpu():
        return op(*args, **kwargs)


def _casting(op: Any, dtype: Callable[[], torch.dtype]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        to = dtype()
        return _outside(op, tuple(_cast(a, to) for a in args), {k: _cast(v, to) for k, v in kwargs.items()})
    return kernel


def _opt_dtype(op: Any, name: str) -> Callable[..., Any]:
    index = next(i for i, a in enumerate(op_schema(op).arguments) if a.name == "dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = args[index] if len(args) > index else kwargs.get("dtype")
        if given is not None or not args or not _eligible(args[0]):
            return _outside(op, args, kwargs)
        if name in _SOFTMAX and args[0].dtype == torch.float16:  # CUDA's half_to_float path: no copy
            return _outside(_SOFTMAX[name], (args[0], args[1], True), {})
        if len(args) > index:
            args = (*args[:index], torch.float32, *args[index + 1:])
        else:
            kwargs = {**kwargs, "dtype": torch.float32}
        return _outside(op, args, kwargs)
    return kernel


def _overload(name: str, overload: str) -> Any | None:
    packet = getattr(_aten, name, None)
    return None if packet is None else getattr(packet, overload or "default", None)


@contextlib.contextmanager
def cuda_lists() -> Iterator[None]:
    """CPU autocast with CUDA's op lists (see the module's docstring) while open."""
    with aten_kernels(_kernels(), "AutocastCPU"):
        yield


def _kernels() -> Iterator[tuple[str, Callable[..., Any]]]:
    groups: list[tuple[list[tuple[str, str]], Callable[[Any, str], Callable[..., Any]]]] = [
        (LOWER_ONLY_CUDA, lambda op, _: _casting(op, lambda: torch.get_autocast_dtype("cpu"))),
        (FP32, lambda op, _: _casting(op, lambda: torch.float32)),
        (FP32_OPT_DTYPE, _opt_dtype),
        # as CUDA has no kernel for them: on to the op's own, autocast still on for what it calls
        (CPU_ONLY, lambda op, _: torch.library.fallthrough_kernel),
    ]
    for ops, make in groups:
        for name, overload in ops:
            op = _overload(name, overload)
            if op is not None:
                yield f"{name}.{overload}" if overload else name, make(op, name)
