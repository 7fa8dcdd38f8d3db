"""The training step memfit plans for, and the byte counts of what lives across it.

The step is the steady state of a training loop: ``zero_grad(set_to_none=True)``, forward,
loss, backward, ``optimizer.step()``. Profiling, validation and the example all run this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.profile import OPTIMIZERS
from memfit.torch_private import is_fake

LossFn = Callable[[Any], torch.Tensor]


@dataclass(slots=True)
class Inputs:
    """Positional and keyword arguments of the model's forward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @staticmethod
    def of(inputs: Any) -> Inputs:
        if isinstance(inputs, Inputs):
            return inputs
        if isinstance(inputs, torch.Tensor):
            return Inputs((inputs,), {})
        if isinstance(inputs, tuple):
            return Inputs(inputs, {})
        if isinstance(inputs, dict):
            return Inputs((), dict(inputs))
        raise MemfitError(
            f"inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
            f"arguments, got {type(inputs).__name__}"
        )

    def tensors(self) -> list[torch.Tensor]:
        return list(iter_tensors((self.args, self.kwargs)))

    def describe(self) -> str:
        """Shapes and dtypes, one entry per tensor: ``float32[4,16]`` for a positional argument,
        ``mask=float32[4,16,1]`` for a keyword one, and a path for one nested in lists, tuples,
        dicts or dataclasses (``batch.0=int64[8,512]``, ``1.image=float32[8,3,224,224]``); other
        values by their type (``use_cache=bool``)."""
        parts = [p for i, a in enumerate(self.args) for p in _describe(a, "" if _leaf(a) else str(i))]
        parts += [p for k, v in self.kwargs.items() for p in _describe(v, k)]
        return ", ".join(parts)


def _leaf(value: Any) -> bool:
    return not (isinstance(value, (tuple, list, dict)) or dataclasses.is_dataclass(value)) or not _children(value)


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    return []


def _describe(value: Any, path: str) -> list[str]:
    name = f"{path}=" if path else ""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return [f"{name}{dtype}[{','.join(str(s) for s in value.shape)}]"]
    if _leaf(value):
        return [f"{name}{type(value).__name__}"]
    return [p for k, v in _children(value) for p in _describe(v, f"{path}.{k}" if path else k)]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists, dicts and Hugging Face ModelOutputs, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):  # ModelOutput is an OrderedDict
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from iter_tensors(v)


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the model computes one (Hugging Face), else the mean square of the
    first tensor in the output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    for t in iter_tensors(output):
        if t.is_floating_point():
            return t.float().pow(2).mean()
    raise MemfitError("the model's output has no floating-point tensor to take a loss of: return one (or an "
                      "object with a .loss, as Hugging Face models do), or in Python pass loss_fn=")


def make_optimizer(name: str | None, params: Iterable[nn.Parameter], *,
                   foreach: bool | None = None) -> torch.optim.Optimizer | None:
    """The optimizer whose state and step memfit counts. Learning rate 0 so that profiling never
    changes the weights; the state and temporaries are the same as with any learning rate.
    ``foreach``: its multi-tensor kernels (None: PyTorch's choice for the parameters' device,
    foreach on CUDA, one tensor at a time on the CPU); they hold a temporary per state tensor
    (``_foreach_sqrt`` of AdamW's second moments), which the step's peak includes."""
    key = "none" if name is None else name.lower()
    params = [p for p in params if p.requires_grad]
    if key == "adamw":
        return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, foreach=foreach)
    if key == "adam":
        return torch.optim.Adam(params, lr=0.0, foreach=foreach)
    if key == "sgd":
        return torch.optim.SGD(params, lr=0.0, foreach=foreach)
    if key == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.0, momentum=0.9, foreach=foreach)
    if key == "none":
        return None
    raise MemfitError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")


def training_step(
    model: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    on_mark: Callable[[str], None] | None = None,
) -> float:
    """One step; ``on_mark`` hears ``forward``, ``backward``, ``step`` and ``done`` as each begins.
    The output is not kept past the loss, as in ``loss = loss_fn(model(x))``."""
    mark = on_mark or (lambda _label: None)
    mark("forward")
    loss = loss_fn(model(*inputs.args, **inputs.kwargs))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise MemfitError(f"the loss must be a one-element tensor, got {', '.join(_describe(loss, ''))}; "
                          "pass loss_fn=")
    if not loss.requires_grad:
        raise MemfitError(
            "the loss does not depend on any trainable parameter, so there is no backward pass to plan for: "
            "check that the model has parameters with requires_grad=True and that the loss uses its output"
        )
    mark("backward")
    loss.backward()
    mark("step")
    if optimizer is not None:
        optimizer.step()
    mark("done")
    return float("nan") if is_fake(loss) else float(loss.detach())  # fake tensors (estimate mode) hold no values


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters (or buffers) live; the CPU for a model with neither."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def zero_grad(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a DTensor's local shard (FSDP2's parameters, gradients and
    optimizer state; its own ``untyped_storage()`` reports the whole tensor), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_key(st: torch.UntypedStorage) -> int:
    """One key per live storage, fake ones (estimate mode, no data pointer) included: the address
    of its StorageImpl (``_cdata``, private but the identity PyTorch's own weak maps use)."""
    return int(st._cdata)


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: set[int] = set(exclude or ())
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        st = local(t).untyped_storage()
        key = storage_key(st)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def static_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Inputs) -> int:
    """What lives across steps: parameters, buffers, optimizer state and inputs (the level at
    the start of a step, after ``zero_grad(set_to_none=True)``)."""
    return storage_bytes([*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), *inputs.tensors()])


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in iter_tensors(dict(state))]
