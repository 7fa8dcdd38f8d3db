"""Applying a schedule: checkpoint the chosen units in place (regions.py), names, classes and
state_dict unchanged; undo it, step down to a tighter plan, warn when the inputs drift."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from torch import nn
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError, MemfitWarning, ScheduleMismatchError
from memfit.formats.schedule import Schedule, fingerprint_difference, load_schedule, model_fingerprint
from memfit.policy import KEEP, KINDS_HELP, Children, Full, Nested, Policies, Segment, Selective
from memfit.policy import Derive as DerivePolicy
from memfit.runtime.derive import Derive
from memfit.runtime.kv_cache import cache_off
from memfit.runtime.op_sets import OP_SETS
from memfit.runtime.regions import Region, guard
from memfit.runtime.watch import Watch
from memfit.units import require_module


def apply(model: nn.Module, schedule: Schedule | str | os.PathLike[str]) -> nn.Module:
    """Checkpoint the units ``schedule`` chose, in place, and return ``model``. ``schedule``: a
    ``Schedule`` (``memfit.plan``, ``memfit.load_schedule``) or the path of a schedule file.

    Refuses (``ScheduleMismatchError``) a schedule made for another model, and (``MemfitError``)
    a unit that is already checkpointed.
    """
    require_module(model, "memfit.apply")
    if isinstance(schedule, (str, os.PathLike)):
        schedule = load_schedule(schedule)
    elif not isinstance(schedule, Schedule):
        raise MemfitError(
            f"memfit.apply takes a Schedule or a schedule file's path, not a {type(schedule).__name__}: "
            "memfit.apply(model, memfit.load_schedule('schedule.json')), or the schedule memfit.plan returned")
    unit_names = list(schedule.policies)
    expected = schedule.fingerprint
    missing = [n for n in unit_names if not _has_module(model, n)]
    if missing:
        raise ScheduleMismatchError(
            f"the model has no unit named {missing[0]!r} ({len(missing)} of the schedule's {len(unit_names)} units "
            f"are missing: {', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}): this schedule was made for "
            "another model; run `memfit plan` for this model")
    actual = model_fingerprint(model, list(expected.get("units", unit_names)))
    for key in ("model_class", "params_sha256", "hparams_sha256"):
        if key in expected and expected[key] != actual[key]:
            what = {"model_class": f"the schedule was made for {expected[key]}, this model is {actual[key]}",
                    "params_sha256": fingerprint_difference(expected, actual),
                    "hparams_sha256": "the same parameters with other settings inside the units, such as attention "
                                      "heads, dropout or norm eps"}[key]
            raise ScheduleMismatchError(
                f"this schedule was made for another model ({what}); run `memfit plan` for this model")
    if list(expected.get("units", [])) != unit_names:
        raise ScheduleMismatchError("the schedule's unit names differ from its fingerprint's")
    if "_memfit_applied" in model.__dict__:
        raise MemfitError("a schedule is already applied to this model; call memfit.remove(model) first")
    if schedule.edited:
        warnings.warn(MemfitWarning(
            "memfit: this schedule's policies were edited after planning: its predicted peak and slowdown are the old "
            "plan's, so the budget is not checked for these policies; plan again (memfit plan --profile FILE), or "
            "check them with memfit.predict(profile, schedule.policies) or memfit validate"), stacklevel=2)
    # A schedule for several input shapes starts with its largest shape's plan (the one that fits
    # any planned input); each training forward's inputs pick theirs (watch.Watch, use_shape).
    last = len(schedule.plans) - 1
    set_policies(model, schedule.plans[last].policies)
    watch = Watch(model, schedule, use_shape)
    model.__dict__["_memfit_applied"] = _Applied(schedule, last, {}, schedule.plans[last].policies,
                                                 model.register_forward_pre_hook(watch, with_kwargs=True))
    return model


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


@dataclass(slots=True)
class _Applied:
    schedule: Schedule
    shape: int  # the plan in use: an index into schedule.plans
    levels: dict[int, int]  # per shape, 0 (or absent): its plan itself; k: its k-th fallback
    policies: Policies  # what runs now
    drift_hook: RemovableHandle


def tighten(model: nn.Module) -> bool:
    """Switch a model with an applied schedule to its next tighter plan (``plan(...,
    fallbacks=k)``) for the input shape it runs now; False when none is left. For a training loop
    that still runs out of memory::

        except torch.OutOfMemoryError:
            if not memfit.tighten(model):
                raise
    """
    applied = model.__dict__.get("_memfit_applied")
    if applied is None:
        raise MemfitError("no schedule is applied to this model: memfit.apply(model, schedule) first")
    level = applied.levels.get(applied.shape, 0)
    if level >= len(applied.schedule.plans[applied.shape].fallbacks):
        return False
    applied.levels[applied.shape] = level + 1
    _run(model, applied, applied.shape)
    return True


def use_shape(model: nn.Module, index: int) -> None:
    """Run the plan of the schedule's input shape ``index`` (at its fallback level, if
    ``tighten`` stepped down there). Called by the drift watch at the start of a forward, before
    anything of it is saved, when its inputs call for another shape's plan: only hooks change
    (no allocation), and only where the two plans differ."""
    applied: _Applied = model.__dict__["_memfit_applied"]
    if index != applied.shape:
        _run(model, applied, index, in_forward=True)


def _run(model: nn.Module, applied: _Applied, index: int, in_forward: bool = False) -> None:
    plan = applied.schedule.plans[index]
    level = applied.levels.get(index, 0)
    policies = plan.fallbacks[level - 1]["policies"] if level else plan.policies
    if policies != applied.policies:
        _switch(model, policies)
        applied.policies = policies
        if in_forward:  # the new head's and tail's hooks on the model's forward come after PyTorch took the list
            for m in model.modules():
                if (d := m.__dict__.get("_memfit_derive")) is not None:
                    d.root_entered(model)
    applied.shape = index


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply`` completely: every unit's own class back, memfit's attributes and hooks
    gone. The model can take a schedule again afterwards."""
    clear_policies(model)
    applied = model.__dict__.pop("_memfit_applied", None)
    if applied is not None:
        applied.drift_hook.remove()
    return model


def set_policies(model: nn.Module, policies: Policies) -> None:
    """Run each unit as its policy (memfit/policy.py) says. Every name must be a submodule, and
    a segment's units must all say so, in order."""
    regions = _set_units(model, policies)
    model.__dict__["_memfit_regions"] = regions  # the guard's own list: a switch of plans refills it
    model.__dict__["_memfit_guard"] = guard(model, regions) + cache_off(model)


def _switch(model: nn.Module, policies: Policies) -> None:
    """Other policies from the next forward on, the model's own hooks (the guard, the cache's)
    kept: a switch runs inside the model's forward pre-hooks, whose list PyTorch took before."""
    _units_off(model)
    model.__dict__["_memfit_regions"][:] = _set_units(model, policies)


def _set_units(model: nn.Module, policies: Policies) -> list[Region]:
    modules: dict[str, nn.Module] = {}
    for name in policies:
        try:
            modules[name] = model.get_submodule(name)
        except AttributeError:
            raise ScheduleMismatchError(f"the model has no unit named {name!r}") from None
    _refuse_shared(modules)
    plan = _region_plan(policies)
    derived = {n: p for n, p in policies.items() if isinstance(p, DerivePolicy)}
    hooked: dict[str, nn.Module] = {}  # unit -> the module its derive hooks: the unit, or its child
    for name, p in derived.items():
        path = f"{name}.{p.child}" if p.child else name
        hooked[name] = modules[name] if path == name else _child(model, path)
        _refuse_checkpointed(path, hooked[name])
    for members, _, _, _ in plan:
        for name in members:
            if name not in modules:
                modules[name] = _child(model, name)
            _refuse_checkpointed(name, modules[name])
    # the units run in the policies' order: the first one's derive takes the head, the last one's the
    # tail (a whole unit's: a child's has neither)
    first, last = next(iter(policies), None), next(reversed(policies), None)
    for name, p in derived.items():
        whole = not p.child
        hooked[name].__dict__["_memfit_derive"] = Derive(hooked[name], p.level, model, head=whole and name == first,
                                                         tail=whole and name == last and p.tail)
    return [Region([modules[n] for n in members], op_set, chain=chain, inner=inner)
            for members, op_set, chain, inner in plan]


def _child(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ScheduleMismatchError(f"the model has no module {name!r} (a child named by the schedule)") from None


def _region_plan(policies: Policies) -> list[tuple[list[str], str, bool, bool]]:
    """(module names, op set, chain, inside a checkpointed unit) of each region the policies
    ask for, in order."""
    names = list(policies)
    plan: list[tuple[list[str], str, bool, bool]] = []
    j = 0
    while j < len(names):
        unit, policy = names[j], policies[names[j]]
        j += 1
        if isinstance(policy, Full):
            plan.append(([unit], "", False, False))
        elif isinstance(policy, Children):  # a+b: two regions; a>b: one chain from a to b
            plan += [([f"{unit}.{m}" for m in r], "", len(r) > 1, False) for r in policy.regions]
        elif isinstance(policy, Nested):  # the unit, and its children's regions inside it
            plan.append(([unit], "", False, False))
            plan += [([f"{unit}.{m}" for m in r], "", len(r) > 1, True) for r in policy.inner.regions]
        elif isinstance(policy, Selective):  # the unit, or only its child, under the op set
            if policy.ops not in OP_SETS:
                raise MemfitError(f"unknown op set in {policy}; known: {', '.join(OP_SETS)}")
            plan.append(([f"{unit}.{policy.child}" if policy.child else unit], policy.ops, False, False))
        elif isinstance(policy, Segment) and policy.first == unit and policy.last in names[j:]:
            k = names.index(policy.last)
            if any(policies[n] != policies[unit] for n in names[j - 1 : k + 1]):
                raise MemfitError(f"every unit from {policy.first!r} to {policy.last!r} must have the policy "
                                  f"{str(policies[unit])!r}")
            plan.append((names[j - 1 : k + 1], "", False, False))
            j = k + 1
        elif policy != KEEP and not isinstance(policy, DerivePolicy):
            raise MemfitError(f"unit {unit!r} has the policy {str(policies[unit])!r}; use {KINDS_HELP} "
                              "naming this unit first and a later unit last")
    return plan


def clear_policies(model: nn.Module) -> None:
    """Undo ``set_policies`` on every submodule: its hooks and attributes go."""
    _units_off(model)
    for handle in model.__dict__.pop("_memfit_guard", []):
        handle.remove()
    model.__dict__.pop("_memfit_regions", None)


def _units_off(model: nn.Module) -> None:
    regions = {id(r): r for m in model.modules() if (r := m.__dict__.get("_memfit_region")) is not None}
    for region in regions.values():
        region.remove()
    for m in model.modules():
        if (d := m.__dict__.pop("_memfit_derive", None)) is not None:
            d.remove()


def _refuse_shared(modules: dict[str, nn.Module]) -> None:
    """One module object at several unit positions (``ModuleList([layer] * 4)``) would be hooked
    once per position and enter its own region again from inside it."""
    first: dict[int, str] = {}
    for name, module in modules.items():
        if id(module) in first:
            raise MemfitError(
                f"units {first[id(module)]!r} and {name!r} are one module object, called at several places in the "
                "forward; memfit plans and checkpoints each unit once: give each place a module of its own "
                "(copy.deepcopy(layer)) or leave the shared layer out of the units")
        first[id(module)] = name


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
