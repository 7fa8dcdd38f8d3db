"""Plans for the ranks of a pipeline, each for its own micro-batches in flight, beside the uniform
plan that gives every stage the same recompute (memfit/steps/pipeline.py has the schedule's order and
the rank's step that the profiles measure).

``profile_stages`` measures every rank's step in this one process, stage after stage, as
``torch.distributed.pipelining`` runs it (its peak equals the real rank's to the byte on gloo:
tests/test_pipeline.py). ``plan_stages`` plans each rank alone at one per-GPU budget and, for
comparison, the uniform plan: Megatron's ``--recompute-method block``, the first k units of every
stage checkpointed, k the least with which every rank fits. The pipeline's step time is
``pipeline.makespan`` over each rank's forward and backward times, the recompute going to the
backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.budget import parse_bytes
from memfit.devices import Device, device_spec
from memfit.errors import InfeasibleBudgetError, MemfitError
from memfit.formats.layout import layout_of
from memfit.formats.profile import Profile
from memfit.formats.schedule import Schedule
from memfit.measure.ranks import check_clipping, shard
from memfit.measure.step import make_optimizer
from memfit.planning.peak import Prediction, predict
from memfit.planning.planner import plan
from memfit.policy import FULL, KEEP, Policies
from memfit.steps.pipeline import (
    Action,
    RankStep,
    StageData,
    in_flight,
    makespan,
    rank_orders,
    reshard,
    stage_count,
    stage_data,
    stage_ranks,
)
from memfit.trainstep import OptimizerFactory
from memfit.units import find_units


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A causal language model's loss on the last stage, as Hugging Face's and torchtitan's: each
    position predicts the next token, the logits upcast to fp32 (a copy of them, in bf16 training)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _split(batch: Any, n: int) -> list[Any]:
    """The batch's ``n`` micro-batches along the first dimension, as the schedule's default
    chunking cuts them (``torch.tensor_split``: views, no copies)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(n))
    if isinstance(batch, tuple):
        return [tuple(parts) for parts in zip(*(_split(b, n) for b in batch), strict=True)]
    raise MemfitError(f"a pipeline's inputs and targets are a tensor or a tuple of tensors, got {type(batch).__name__}")


def profile_stages(stages: Sequence[nn.Module], inputs: Any, targets: Any, loss_fn: Any, *,
                   schedule: Any = "1F1B", microbatches: int, optimizer: str | OptimizerFactory = "adamw",
                   units: str | list[str] = "auto", repeat: int = 5,
                   clip_grad_norm: float | None = None) -> list[Profile]:
    """Each rank's profile of a pipeline of ``stages`` (the modules in order; a rank of an
    interleaved schedule holds several) under ``schedule`` with ``microbatches`` micro-batches of
    the batch ``inputs`` (the first stage's) and ``targets`` (``loss_fn(output, target)`` on the
    last stage), each stage with its own ``optimizer``, the gradients clipped to ``clip_grad_norm``
    where given. Measured here in one process; the later stages' inputs are the earlier stages'
    outputs for the same micro-batches."""
    from memfit.profiler import profile

    return [profile(model, data, step_fn=step, units=names, repeat=repeat)
            for model, data, step, names in _ranks(stages, inputs, targets, loss_fn, schedule, microbatches,
                                                   optimizer, units, clip_grad_norm=clip_grad_norm)]


def estimate_stages(build: Callable[[], tuple[Sequence[nn.Module], Any, Any]], loss_fn: Any, *, target: str | Device,
                    schedule: Any = "1F1B", microbatches: int, optimizer: str | OptimizerFactory = "adamw",
                    units: str | list[str] = "auto", parallel: str | None = None, world_size: int = 1, tp: int = 1,
                    sequence_parallel: bool = False, clip_grad_norm: float | None = None) -> list[Profile]:
    """``profile_stages`` for ``target`` (a device in devices.py) without it: ``build()`` returns
    ``(stages, inputs, targets)`` and runs under ``FakeTensorMode``, as ``memfit.estimate``'s does;
    memory from shapes, times a roofline (profiler/estimate.py).

    ``parallel`` ("fsdp", "fsdp-bf16"), ``world_size``, ``tp``, ``sequence_parallel``: each stage
    is held by ``world_size`` ranks (its data-parallel shards times ``tp``), sharded as
    ``memfit.estimate`` shards a model (tensor parallelism by the config's plan, then FSDP2 on each
    unit and the stage), on fake ranks: torchtitan's PP x FSDP x TP mesh, whose pipeline has
    ``len(stages) / stages a rank`` times ``world_size`` ranks in all. An FSDP2 stage runs as
    ``PipelineStage`` runs it: gradients accumulated unsharded over the micro-batches and reduced
    after the last backward."""
    from memfit.profiler import profile
    from memfit.profiler.estimate import estimated, fake_measuring, fake_ranks, faked

    spec = target if isinstance(target, Device) else device_spec(target)
    layout = layout_of(parallel, world_size, tp, sequence_parallel) if parallel is not None else None
    if layout is not None and layout["kind"] == "ddp":
        raise MemfitError("pipeline stages are estimated under fsdp, fsdp-bf16 or tp, not ddp")
    if layout is not None:
        check_clipping(layout, clip_grad_norm)
    out = []
    with fake_ranks(layout) as mesh, faked(spec, build) as built:
        stages, inputs, targets = built
        if layout is not None:
            for stage in stages:
                shard(stage, find_units(stage, units), layout, mesh, pipeline=True)
        for model, data, step, names in _ranks(stages, inputs, targets, loss_fn, schedule, microbatches, optimizer,
                                               units, foreach=True if spec.cuda else None,
                                               clip_grad_norm=clip_grad_norm):
            with fake_measuring(spec) as reserved:
                prof = profile(model, data, step_fn=step, units=names, repeat=1)
            if layout is not None:
                prof.parallel = layout
            out.append((prof, reserved))
    return [estimated(prof, spec, reserved) for prof, reserved in out]


def _ranks(stages: Sequence[nn.Module], inputs: Any, targets: Any, loss_fn: Any, schedule: Any, microbatches: int,
           optimizer: str | OptimizerFactory, units: str | list[str], foreach: bool | None = None,
           clip_grad_norm: float | None = None) -> Iterator[tuple[nn.Module, dict[int, StageData], RankStep, Any]]:
    """Each rank's model (its stage, or a ModuleDict of its stages), data, step and unit names."""
    orders = rank_orders(schedule, len(stages), microbatches)
    ranks = stage_ranks(orders)
    acts = [_split(inputs, microbatches)]
    with torch.no_grad():
        for stage in stages[:-1]:
            acts.append([stage(x) for x in acts[-1]])
    for stage in stages:
        reshard(stage)  # FSDP2 stages: as PipelineStage leaves them after its shape inference
    last = len(stages) - 1
    for r, order in enumerate(orders):
        here = sorted(s for s, rank in ranks.items() if rank == r)
        model = stages[here[0]] if len(here) == 1 else nn.ModuleDict({str(s): stages[s] for s in here})
        data = {s: stage_data(acts[s], None if s == last else acts[s + 1][0],
                              _split(targets, microbatches) if s == last else [], first=s == 0) for s in here}
        opt = make_optimizer(optimizer, model.parameters(), foreach_default=foreach)
        if opt is None:
            raise MemfitError("a pipeline stage needs an optimizer: name one or pass a factory")
        yield model, data, RankStep(order, last, microbatches, opt, loss_fn, clip_grad_norm), _units_of(units, here)


def _units_of(units: str | list[str], here: list[int]) -> str | list[str]:
    """The unit patterns for a rank's model: a stage's own, or each under its stage's index in the
    ModuleDict of a rank that runs several (in stage order, the order their first forwards run)."""
    if len(here) == 1 or units == "auto":
        return units
    patterns = [units] if isinstance(units, str) else units
    return [f"{s}.{p}" for s in here for p in patterns]


@dataclass(slots=True)
class RankPlan:
    """One rank's plan: its policies, what they predict, the most micro-batches any of its stages
    holds, and each of its stages' forward and backward seconds per micro-batch (recompute in the
    backward), by stage index."""

    policies: Policies
    prediction: Prediction
    in_flight: int
    fwd_s: dict[int, float]
    bwd_s: dict[int, float]


@dataclass(slots=True)
class StagePlans:
    """Per-stage and uniform plans of a pipeline at one per-GPU budget, and its step time under
    each (``makespan``; ``plain_s``: nothing checkpointed)."""

    schedule: str
    microbatches: int
    budget_bytes: int
    orders: list[list[Action]]
    per_stage: list[RankPlan]
    uniform: list[RankPlan]
    uniform_k: int  # the units checkpointed at the head of every stage
    schedules: list[Schedule]  # the per-stage plans, one a rank, to save and apply
    uniform_schedules: list[Schedule]  # the uniform plan's, to compare with them
    plain_s: float
    per_stage_s: float
    uniform_s: float


def _stage_units(profile: Profile, order: list[Action]) -> dict[int, list[str]]:
    """Each stage of a rank's ``order`` and its units, in order: all of them for a rank of one
    stage; under the stage's index in the ModuleDict of a rank of several (``_units_of``)."""
    stages = sorted({s for _, s, _ in order})
    if len(stages) == 1:
        return {stages[0]: [u.name for u in profile.units]}
    return {s: [u.name for u in profile.units if u.name.split(".", 1)[0] == str(s)] for s in stages}


def _rank_plan(profile: Profile, policies: Policies, order: list[Action], microbatches: int) -> RankPlan:
    """A rank's figures under ``policies``: its step spread over its micro-batches, then among its
    stages and between forward and backward as their units' times are, each stage's recompute
    added to its backward."""
    pred = predict(profile, policies)
    units = {u.name: u for u in profile.units}
    by_stage = _stage_units(profile, order)
    per_mb = profile.step_s / microbatches
    total = sum(u.fwd_s + u.bwd_s for u in profile.units)
    fwd, bwd = {}, {}
    for s, names in by_stage.items():
        f, b = sum(units[n].fwd_s for n in names), sum(units[n].bwd_s for n in names)
        if total > 0:
            fwd[s], bwd[s] = per_mb * f / total, per_mb * b / total
        else:  # no unit time: the stages alike, a third forward
            fwd[s], bwd[s] = per_mb / len(by_stage) / 3, per_mb / len(by_stage) * 2 / 3
        mine = {n: p for n, p in policies.items() if n in names}
        recompute = pred.recompute_s if len(by_stage) == 1 else predict(profile, mine).recompute_s
        bwd[s] += recompute / microbatches
    return RankPlan(policies, pred, max(in_flight(order, s) for s in by_stage), fwd, bwd)


def _time(plans: list[RankPlan], orders: list[list[Action]]) -> float:
    ranks = stage_ranks(orders)
    return makespan(orders, {s: plans[r].fwd_s[s] for s, r in ranks.items()},
                    {s: plans[r].bwd_s[s] for s, r in ranks.items()})


def plan_stages(profiles: Sequence[Profile], budget: str | int, *, schedule: Any = "1F1B",
                microbatches: int) -> StagePlans:
    """Each rank of ``profiles`` (``profile_stages``'s, in rank order) planned alone at ``budget``
    (the per-GPU memory), beside the uniform plan at the same budget."""
    budget_bytes = parse_bytes(budget)
    orders = rank_orders(schedule, stage_count(schedule, len(profiles)), microbatches)
    schedules = [plan(p, budget_bytes) for p in profiles]
    per_stage = [_rank_plan(p, s.policies, o, microbatches) for p, s, o in zip(profiles, schedules, orders,
                                                                               strict=True)]
    plain = [_rank_plan(p, {}, o, microbatches) for p, o in zip(profiles, orders, strict=True)]
    k, uniform = _uniform(profiles, orders, budget_bytes, microbatches)
    name = schedule if isinstance(schedule, str) else schedule.__name__
    for r, s in enumerate(schedules):
        s.pipeline = {"schedule": name, "ranks": len(orders), "stages": len(stage_ranks(orders)),
                      "microbatches": microbatches, "rank": r}
    return StagePlans(name, microbatches, budget_bytes, orders, per_stage, uniform, k, schedules,
                      [_as_schedule(s, u) for s, u in zip(schedules, uniform, strict=True)],
                      _time(plain, orders), _time(per_stage, orders), _time(uniform, orders))


def _as_schedule(planned: Schedule, rank: RankPlan) -> Schedule:
    """A rank's schedule for the uniform plan's policies, with their predictions (memfit's own
    plan for the same rank gives the rest: fingerprint, budget, step, baselines)."""
    pred = rank.prediction
    return dataclasses.replace(planned, policies=dict(rank.policies), predicted_peak_bytes=pred.peak_bytes,
                               predicted_recompute_s=pred.recompute_s, predicted_overhead=pred.overhead,
                               predicted_uncertainty_s=pred.uncertainty_s, strategy="uniform", fallbacks=[],
                               levels={})


def _uniform(profiles: Sequence[Profile], orders: list[list[Action]], budget: int,
             microbatches: int) -> tuple[int, list[RankPlan]]:
    """The least k with which checkpointing the first k units of every stage fits every rank."""
    stages = [_stage_units(p, o) for p, o in zip(profiles, orders, strict=True)]
    most = max(len(names) for by in stages for names in by.values())
    for k in range(most + 1):
        plans = [_rank_plan(p, {n: FULL if j < k else KEEP for names in by.values() for j, n in enumerate(names)},
                            o, microbatches) for p, o, by in zip(profiles, orders, stages, strict=True)]
        if all(r.prediction.peak_bytes <= budget for r in plans):
            return k, plans
    worst = max(predict(p, {u.name: FULL for u in p.units}).peak_bytes for p in profiles)
    raise InfeasibleBudgetError(f"no uniform plan fits every stage in {budget:,} bytes: with every unit "
                                f"checkpointed the fullest rank needs {worst:,}", worst)
