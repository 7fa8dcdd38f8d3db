"""``memfit.fit``: profile (or estimate), plan and apply in one call, with a cache between runs.

The one-switch form people know from ``gradient_checkpointing_enable()``: a training script
calls it once before its loop. The first run measures the step; later runs of the same script
(same architecture, input signature, step, device and versions) load the plan from the cache
(cache.py) and only apply it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch
from torch import nn

from memfit import __version__
from memfit.budget import format_bytes, parse_bytes
from memfit.cache import Entry, cache_root, digest
from memfit.errors import MemfitError
from memfit.formats.profile import Profile
from memfit.formats.schedule import Schedule, load_schedule, model_fingerprint
from memfit.measure.inputs import Inputs
from memfit.measure.step import LossFn
from memfit.planning.options import PlanOptions, settle
from memfit.planning.planner import plan
from memfit.profiler import profile
from memfit.profiler.estimate import estimate
from memfit.runtime.apply import apply, remove
from memfit.torch_private import tree_map
from memfit.trainstep import TrainStep, step_of
from memfit.units import find_units, require_module

log = logging.getLogger("memfit")


def fit(
    model: nn.Module,
    inputs: Any,
    budget: str | int,
    *,
    loss_fn: LossFn | None = None,
    step: TrainStep | None = None,
    units: str | list[str] = "auto",
    target: str | None = None,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    repeat: int = 3,
    options: PlanOptions | None = None,
    **settings: Any,
) -> Schedule:
    """Checkpoint ``model`` in place so that its training step on batches like ``inputs`` fits
    ``budget``, at the least recompute; returns the schedule and logs one line of what it chose
    (logger ``memfit``, level INFO: ``logging.basicConfig(level=logging.INFO)`` shows it).

    ``budget``: bytes, a size such as ``"24GB"``, or ``"auto"``: what the model's CUDA device can
    hold for this process (``torch.cuda.mem_get_info``'s free memory plus what this process's
    allocator holds, less the device's allocator margin; on the CPU give a size). ``step``: the
    training step as the loop runs it (``memfit.TrainStep``: optimizer, micro-batches,
    precision, clipping). ``target``: a device name (``h100``, ``a100-80gb``, …) to estimate
    the step from shapes for a GPU that is not at hand instead of measuring it here.
    ``options`` (a ``memfit.PlanOptions``) and ``settings`` given as keywords (``granularity``,
    ``segments``, ``solver``, …, put into ``options``): how to plan, as ``memfit.plan`` takes them.

    ``cache_dir``: where plans are kept between runs (default ``$MEMFIT_CACHE`` or
    ``~/.cache/memfit``; ``False``: no cache). An entry is keyed by the model's fingerprint, the
    input signature, the step, the device and the versions of memfit and torch; a changed
    budget or option replans from the cached profile without measuring again. Functions are
    keyed by their qualified names (``loss_fn``, a callable optimizer): change the name, or
    pass ``cache_dir=False``, when you change what one does to memory.
    """
    started = time.perf_counter()
    require_module(model, "memfit.fit")
    if "_memfit_applied" in model.__dict__:
        remove(model)  # fit again (a new budget, say): plan the plain model
    train_step = step_of(step)
    device = _device(model)
    budget_bytes, said = resolve_budget(budget, device, target)
    names = find_units(model, units)
    inp = Inputs.of(inputs)
    opts = settle(options, **settings)
    granularity = opts.granularity
    key = {
        "fingerprint": model_fingerprint(model, names),
        "inputs": inp.describe(),
        "step": [train_step.optimizer_name, dict(train_step.record())],
        "loss_fn": None if loss_fn is None else getattr(loss_fn, "__qualname__", type(loss_fn).__name__),
        "device": target or _device_name(device),
        "memfit": __version__,
        "torch": torch.__version__,
        "granularity": granularity,
    }
    root = cache_root(cache_dir)
    entry = Entry(root, key) if root is not None else None
    plan_name = f"plan-{digest({'budget': budget_bytes, **dataclasses.asdict(opts)})}.json"
    # several ranks (TP, FSDP2, DDP): rank 0 reads the cache and plans, and every rank applies its
    # plan, since a checkpointed unit re-runs its collectives in the backward; every rank profiles
    # with it, since the profile's steps run them too
    ranks = _ranks()
    lead = ranks is None or ranks.get_rank() == 0
    schedule = entry.read(plan_name, _loader(load_schedule, key)) if entry and lead else None
    how = "from the cache"
    failed: MemfitError | None = None
    if _agreed(ranks, schedule is None):
        prof = entry.read("profile.json", _loader(Profile.load, key)) if entry and lead else None
        if _agreed(ranks, prof is None):
            if lead or target is None:
                prof = _measure(model, inputs, loss_fn, train_step, names, target, repeat, granularity)
            if entry and lead:
                entry.write("profile.json", prof.save)
            how = f"{'estimated for ' + target if target else 'profiled'} in {time.perf_counter() - started:.1f} s"
        else:
            how = "planned from the cached profile"
        if lead:
            try:
                schedule = plan(prof, budget_bytes, opts)
            except MemfitError as exc:  # said to every rank, so that none waits for a plan
                failed = exc
            if entry and schedule is not None:
                entry.write(plan_name, schedule.save)
    if ranks is not None:
        schedule, message = _agreed(ranks, (schedule, None if failed is None else str(failed)))
        if message is not None and failed is None:
            raise MemfitError(f"rank 0 could not plan: {message}")
    if failed is not None:
        raise failed
    assert schedule is not None
    apply(model, schedule)
    _announce(schedule, said, how, entry.folder if entry else None)
    return schedule


def _ranks() -> Any:
    """``torch.distributed`` when this process is one of several ranks, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _agreed(ranks: Any, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself in one process)."""
    if ranks is None:
        return value
    shared = [value]
    ranks.broadcast_object_list(shared, src=0)
    return shared[0]


def resolve_budget(budget: str | int, device: torch.device, target: str | None = None) -> tuple[int, str]:
    """The budget in bytes, and how to say it (``"auto"`` names where it came from)."""
    if budget != "auto":
        n = parse_bytes(budget)
        return n, format_bytes(n)
    if target is not None:
        from memfit.devices import device_spec

        spec = device_spec(target)
        return spec.usable_bytes, f"{format_bytes(spec.usable_bytes)} (auto: what {spec.title} leaves a step)"
    if device.type != "cuda":
        raise MemfitError("budget='auto' reads a CUDA device's free memory; on the CPU give a size, such as "
                          "budget='8GB'")
    from memfit.measure.memory import device_memory

    free, _total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # this process's allocator: the weights already loaded among it
    memory = device_memory(device)
    assert memory is not None  # a CUDA device
    margin = memory["margin"]
    n = math.floor((free + held) / (1 + margin))
    return n, (f"{format_bytes(n)} (auto: {format_bytes(free)} free + {format_bytes(held)} held by this process, "
               f"less a {margin:.0%} allocator margin)")


def _measure(model: nn.Module, inputs: Any, loss_fn: LossFn | None, step: TrainStep, names: list[str],
             target: str | None, repeat: int, granularity: str) -> Profile:
    if target is None:
        return profile(model, inputs, loss_fn=loss_fn, step=step, units=names, repeat=repeat,
                              granularity=granularity)
    return estimate(lambda: _fake_copy(model, inputs), target=target, step=step, loss_fn=loss_fn,
                           units=names, granularity=granularity)


def _fake_copy(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """``model`` and ``inputs`` again as fake tensors, called under estimate's FakeTensorMode:
    every parameter and buffer is made anew by a factory (fake under the mode), and the deep
    copy takes those instead of copying the real weights (tied weights stay tied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_empty(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _empty(b)
    fake_inputs = tree_map(lambda x: _empty(x) if isinstance(x, torch.Tensor) else x, inputs)
    return copy.deepcopy(model, memo), fake_inputs


def _empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)  # a factory: the fake mode refuses real tensors as arguments


def _loader(load: Any, key: dict[str, Any]) -> Any:
    """``load`` that also refuses a file whose own fingerprint or inputs are not the key's."""

    def checked(path: Any) -> Any:
        value = load(path)
        if value.fingerprint != key["fingerprint"] or value.input_shapes != key["inputs"]:
            raise ValueError("it was made for another model or other inputs")
        return value

    return checked


def _device(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}:{torch.cuda.mem_get_info(device)[1]}"
    return device.type


def _announce(schedule: Schedule, budget: str, how: str, folder: Any) -> None:
    """One INFO line on the ``memfit`` logger, which has no handler of its own (a library's
    logger; ``logging.basicConfig(level=logging.INFO)`` shows it)."""
    chosen = schedule.checkpointed
    what = (f"checkpointing {len(chosen)} of {len(schedule.policies)} units ({_names(chosen)})" if chosen
            else f"no checkpointing needed ({len(schedule.policies)} units kept)")
    log.info("memfit: %s; predicted peak %s of a %s budget, +%.1f%% step time (%s%s)", what,
             format_bytes(schedule.predicted_peak_bytes), budget, 100 * schedule.predicted_overhead, how,
             f"; cache {folder}" if folder else "")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, … {names[-1]}"
