"""Applying a schedule: checkpoint the chosen units in place (regions.py), names, classes and
state_dict unchanged; undo it, step down to a tighter plan, warn when the inputs drift."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError, PlanDriftWarning, ScheduleMismatchError
from memfit.profile import DERIVE, child_regions
from memfit.runtime.derive import Derive
from memfit.runtime.regions import Region, guard
from memfit.schedule import Schedule, model_fingerprint, segment_span

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
    if "_memfit_applied" in model.__dict__:
        raise MemfitError("a schedule is already applied to this model; call memfit.remove(model) first")
    set_policies(model, schedule.policies)
    model.__dict__["_memfit_applied"] = _Applied(schedule, 0, _watch_inputs(model, schedule))
    _check_target(model, schedule)
    return model


def _check_target(model: nn.Module, schedule: Schedule) -> None:
    """An estimated plan holds for the device it was estimated for; say so on another one."""
    if not schedule.target:
        return
    from memfit.profiler.devices import device_spec

    spec = device_spec(schedule.target)
    param = next(model.parameters(), None)
    here = param.device if param is not None else torch.device("cpu")
    name = torch.cuda.get_device_name(here) if here.type == "cuda" else "the CPU"
    if (here.type == "cuda") != spec.cuda or (here.type == "cuda" and spec.title.lower() not in name.lower()):
        warnings.warn(PlanDriftWarning(
            f"memfit: this schedule was estimated for {spec.title} ({schedule.target}), not measured, and the model "
            f"runs on {name}: its peak may differ; plan on this device (memfit plan without --target) or check it "
            "with memfit validate"), stacklevel=3)


@dataclass(slots=True)
class _Applied:
    schedule: Schedule
    level: int  # 0: the plan itself; k: its k-th fallback
    drift_hook: RemovableHandle


def tighten(model: nn.Module) -> bool:
    """Switch a model with an applied schedule to its next tighter plan (``plan(...,
    fallbacks=k)``); False when none is left. For a training loop that still runs out of memory::

        except torch.OutOfMemoryError:
            if not memfit.tighten(model):
                raise
    """
    applied = model.__dict__.get("_memfit_applied")
    if applied is None:
        raise MemfitError("no schedule is applied to this model: memfit.apply(model, schedule) first")
    if applied.level >= len(applied.schedule.fallbacks):
        return False
    clear_policies(model)
    set_policies(model, applied.schedule.fallbacks[applied.level]["policies"])
    applied.level += 1
    return True


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply`` completely: every unit's own class back, memfit's attributes and hooks
    gone. The model can take a schedule again afterwards."""
    clear_policies(model)
    applied = model.__dict__.pop("_memfit_applied", None)
    if applied is not None:
        applied.drift_hook.remove()
    return model


def _watch_inputs(model: nn.Module, schedule: Schedule) -> RemovableHandle:
    """A forward pre-hook that warns once for each new input signature (shapes and dtypes) that
    differs from the plan's: a longer sequence or a larger batch silently breaks the budget."""
    from memfit.budget import format_bytes
    from memfit.measure.step import Inputs  # the one describer of inputs, as the plan recorded them

    seen = {schedule.input_shapes}
    redo = f"memfit plan --budget {format_bytes(schedule.budget_bytes).replace(' ', '')}"
    if schedule.source.get("scenario"):
        redo += f" --scenario {schedule.source['scenario']}"
    elif schedule.source.get("model"):
        redo += f" --model {schedule.source['model']}"

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return  # Dynamo guards on shapes itself; describing symbolic shapes would break the graph
        now = Inputs(args, kwargs).describe()
        if now not in seen and schedule.input_shapes:
            seen.add(now)
            warnings.warn(PlanDriftWarning(
                f"memfit: this model's schedule was planned for inputs {schedule.input_shapes}, but it now runs on "
                f"{now}: its peak may exceed the planned {format_bytes(schedule.predicted_peak_bytes)} (budget "
                f"{format_bytes(schedule.budget_bytes)}); plan again for these inputs ({redo} with them)"
            ), stacklevel=3)

    return model.register_forward_pre_hook(check, with_kwargs=True)


def set_policies(model: nn.Module, policies: dict[str, str]) -> None:
    """Checkpoint each unit as its policy says: ``full``; ``child:<a>[+<b>...]`` (only those
    modules of the unit, each its own region; ``child:<a>><b>``: a chain, ``a`` feeding ``b``);
    ``selective:<policy>`` (the unit, under an op-level policy;
    ``selective:<policy>@<child>``: only that child, under it);
    ``derive`` (no region: cheap saved tensors re-derived in the backward, runtime/derive.py);
    ``segment:<first>..<last>`` (those units as one region). Every name must be a submodule, and
    a segment's units must all say so, in order."""
    modules = {}
    for name in policies:
        try:
            modules[name] = model.get_submodule(name)
        except AttributeError:
            raise ScheduleMismatchError(f"the model has no unit named {name!r}") from None
    names = list(policies)
    plan: list[tuple[list[str], str, bool]] = []  # (module names, op policy, chain) for each region
    derived = [n for n, p in policies.items() if p == DERIVE]
    j = 0
    while j < len(names):
        policy = policies[names[j]]
        kind, _, rest = policy.partition(":")
        if policy in ("none", "full", DERIVE) or kind in ("child", "selective"):
            if kind == "child":  # a+b: two regions; a>b: one chain from a to b
                plan += [([f"{names[j]}.{m}" for m in r], "", len(r) > 1) for r in child_regions(rest)]
            elif kind == "selective":  # selective:<policy>, or selective:<policy>@<child> for one child
                op_policy, _, child = rest.partition("@")
                plan.append(([f"{names[j]}.{child}" if child else names[j]], op_policy, False))
            elif policy not in ("none", DERIVE):
                plan.append(([names[j]], "", False))
            j += 1
            continue
        span = segment_span(policy)
        if span is None or span[0] != names[j] or span[1] not in names[j + 1:]:
            raise MemfitError(
                f"unit {names[j]!r} has the policy {policy!r}; use none, full, child:<children>, "
                "selective:<policy>, derive or segment:<first>..<last> naming this unit first and a later unit last"
            )
        first, last = span
        k = names.index(last)
        if any(policies[n] != policy for n in names[j : k + 1]):
            raise MemfitError(f"every unit from {first!r} to {last!r} must have the policy {policy!r}")
        plan.append((names[j : k + 1], "", False))
        j = k + 1
    for name in derived:
        _refuse_checkpointed(name, modules[name])
    for members, _, _ in plan:
        for name in members:
            if name not in modules:
                try:
                    modules[name] = model.get_submodule(name)
                except AttributeError:
                    raise ScheduleMismatchError(f"the model has no module {name!r} (a child named by the schedule)"
                                                ) from None
            _refuse_checkpointed(name, modules[name])
    if any(p and p not in SELECTIVE for _, p, _ in plan):
        bad = next(p for _, p, _ in plan if p and p not in SELECTIVE)
        raise MemfitError(f"unknown op-level policy selective:{bad}; known: {', '.join(SELECTIVE)}")
    for name in derived:
        modules[name].__dict__["_memfit_derive"] = Derive(modules[name])
    regions = [Region(units, _context_fn(units, op_policy), chain=chain)
               for units, op_policy, chain in (([modules[n] for n in m], p, c) for m, p, c in plan)]
    if regions:
        model.__dict__["_memfit_guard"] = guard(model, regions)


def clear_policies(model: nn.Module) -> None:
    """Undo ``set_policies`` on every submodule: its hooks and attributes go."""
    regions = {id(r): r for m in model.modules() if (r := m.__dict__.get("_memfit_region")) is not None}
    for region in regions.values():
        region.remove()
    for m in model.modules():
        if (d := m.__dict__.pop("_memfit_derive", None)) is not None:
            d.remove()
    for handle in model.__dict__.pop("_memfit_guard", []):
        handle.remove()


def is_checkpointed(module: nn.Module) -> bool:
    """memfit runs ``module`` under a schedule's policy (a region, or ``derive``)."""
    return "_memfit_region" in module.__dict__ or "_memfit_derive" in module.__dict__


def _refuse_checkpointed(name: str, module: nn.Module) -> None:
    if is_checkpointed(module):
        raise MemfitError(f"unit {name!r} is already checkpointed by memfit; apply a schedule once")
    if type(module).__name__ == "CheckpointWrapper" or getattr(module, "gradient_checkpointing", False):
        raise MemfitError(
            f"unit {name!r} is already checkpointed by another mechanism (checkpoint_wrapper or "
            "Hugging Face gradient_checkpointing); turn that off before applying a memfit schedule"
        )


def _context_fn(units: list[nn.Module], op_policy: str = "") -> Callable[[], Any]:
    """What the region's checkpoint saves instead of recomputing: nothing (plain), BatchNorm's
    outputs and counter (so that running statistics update once), and the op policy's choice."""
    has_bn = any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training
        for unit in units
        for m in unit.modules()
    )
    if not has_bn and not op_policy:
        from torch.utils.checkpoint import noop_context_fn

        return noop_context_fn
    keep = SELECTIVE[op_policy] if op_policy else frozenset()
    return functools.partial(
        create_selective_checkpoint_contexts, functools.partial(_op_policy, keep, has_bn),
        allow_cache_entry_mutation=has_bn,
    )


def _op_policy(keep: frozenset[Any], batch_norm: bool, ctx: Any, op: Any, *args: Any,
               **kwargs: Any) -> CheckpointPolicy:
    if op in keep:
        return CheckpointPolicy.MUST_SAVE
    if batch_norm:
        if op in _BATCH_NORM_OPS:
            return CheckpointPolicy.MUST_SAVE
        target = args[0] if args else None
        if op is _aten.add_.Tensor and isinstance(target, torch.Tensor) and target.dtype == torch.long and (
                target.dim() == 0):
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _ops(*names: str) -> frozenset[Any]:
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


# Op-level policies: the outputs each keeps (MUST_SAVE); everything else in the unit is recomputed.
SELECTIVE: dict[str, frozenset[Any]] = {
    # matrix products, convolutions and attention kernels: the dear ops; the cheap elementwise
    # ones between them (norms, activations, dropout, softmax) come back in the backward
    "gemm": _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"),
}
