"""Applying a schedule: checkpoint the chosen units in place, names and state_dict unchanged."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.errors import MemfitError, ScheduleMismatchError
from memfit.schedule import POLICIES, Schedule, model_fingerprint

_CLASSES: dict[type, type] = {}
_aten = torch.ops.aten
_BATCH_NORM_OPS = {
    getattr(_aten, name).default
    for name in ("_native_batch_norm_legit", "native_batch_norm", "_batch_norm_with_update")
    if hasattr(_aten, name)
}


def apply(model: nn.Module, schedule: Schedule) -> nn.Module:
    """Checkpoint the units ``schedule`` chose, in place, and return ``model``.

    Refuses (``ScheduleMismatchError``) a schedule made for another model, and (``MemfitError``)
    a unit that is already checkpointed.
    """
    unit_names = list(schedule.policies)
    expected = schedule.fingerprint
    actual = model_fingerprint(model, list(expected.get("units", unit_names)))
    for key in ("model_class", "params_sha256"):
        if expected.get(key) != actual[key]:
            raise ScheduleMismatchError(
                f"this schedule was made for another model ({key} differs: schedule has "
                f"{expected.get(key)!r}, model has {actual[key]!r}); run `memfit plan` for this model"
            )
    if list(expected.get("units", [])) != unit_names:
        raise ScheduleMismatchError("the schedule's unit names differ from its fingerprint's")
    set_policies(model, schedule.policies)
    return model


def set_policies(model: nn.Module, policies: dict[str, str]) -> None:
    """Checkpoint each unit whose policy is not ``none``; every name must be a submodule."""
    modules = {}
    for name, policy in policies.items():
        if policy not in POLICIES:
            raise MemfitError(f"unknown policy {policy!r} for unit {name!r}; use one of {POLICIES}")
        try:
            modules[name] = model.get_submodule(name)
        except AttributeError:
            raise ScheduleMismatchError(f"the model has no unit named {name!r}") from None
    for name, module in modules.items():
        if policies[name] != "none":
            _checkpoint_module(name, module)


def clear_policies(model: nn.Module) -> None:
    """Undo ``set_policies``/``apply`` on every submodule."""
    for module in model.modules():
        base = getattr(type(module), "_memfit_base", None)
        if base is not None:
            module.__class__ = base


def is_checkpointed(module: nn.Module) -> bool:
    return hasattr(type(module), "_memfit_base")


def _checkpoint_module(name: str, module: nn.Module) -> None:
    if is_checkpointed(module):
        raise MemfitError(f"unit {name!r} is already checkpointed by memfit; apply a schedule once")
    if type(module).__name__ == "CheckpointWrapper" or getattr(module, "gradient_checkpointing", False):
        raise MemfitError(
            f"unit {name!r} is already checkpointed by another mechanism (checkpoint_wrapper or "
            "Hugging Face gradient_checkpointing); turn that off before applying a memfit schedule"
        )
    base = type(module)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(
            f"Checkpointed{base.__name__}",
            (base,),
            {"forward": _checkpointed_forward, "_memfit_base": base, "__module__": base.__module__},
        )
        _CLASSES[base] = cls
    module.__class__ = cls


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    base = type(self)._memfit_base

    def run(*a: Any) -> Any:
        return base.forward(self, *a, **kwargs)

    # Keyword arguments travel in the closure so that names such as ``context_fn`` or ``debug``
    # in the user's forward cannot collide with checkpoint()'s own keywords.
    return checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_context_fn(self)
    )


def _context_fn(module: nn.Module) -> Callable[[], Any]:
    has_bn = any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training
        for m in module.modules()
    )
    if not has_bn:
        from torch.utils.checkpoint import noop_context_fn

        return noop_context_fn
    # Recomputing a BatchNorm would update its running statistics twice: save its outputs and
    # the num_batches_tracked increment instead of recomputing them.
    return functools.partial(
        create_selective_checkpoint_contexts, _batch_norm_policy, allow_cache_entry_mutation=True
    )


def _batch_norm_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _BATCH_NORM_OPS:
        return CheckpointPolicy.MUST_SAVE
    target = args[0] if args else None
    counter = isinstance(target, torch.Tensor) and target.dtype == torch.long and target.dim() == 0
    if op is _aten.add_.Tensor and counter:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
