"""Planning pipeline stages (``torch.distributed.pipelining``): each stage for the micro-batches its
schedule holds in flight, under one per-GPU budget.

Under 1F1B the first of S stages runs S forwards before its first backward and the last runs
one; under GPipe every stage holds all M. A rank's step is therefore not the model's step: memfit
profiles it as the schedule runs it, in the order of the schedule's own actions (its
``pipeline_order``, read on stand-in stages: ``torch_private.schedule_ops``), with what
``PipelineStage`` keeps across and within a step beside it (``StageData``): a receive buffer per
micro-batch for the stage's input and one for its output's gradient, and the outputs and input
gradients that the schedule's sends hold past their use (``_sends``). That step (``RankStep``) is a step function,
which the profiler measures as it does any (``memfit.profile(..., step_fn=)``: a unit's later
backwards accumulate, its forwards of later micro-batches stack on the earlier ones' saved
tensors), so the plan, ``predict`` and ``validate`` hold for it unchanged. A rank's time in the
pipeline is its schedule's, not the sum of its stages': ``makespan`` walks every rank's actions
with each stage's forward and backward times.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.torch_private import fsdp_reduce_after_pipeline, schedule_ops, stages_per_rank

Action = tuple[str, int, int]  # ("F" or "B", stage, micro-batch); "R", "G": a send lets go (_sends)
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B"}
_SKIPPED = {"REDUCE_GRAD"}  # FSDP's gradient reduction after the last backward: no activations


def rank_orders(schedule: Any, stages: int, microbatches: int) -> list[list[Action]]:
    """Each rank's forwards and backwards, in the order ``schedule`` (a name as torchtitan's config
    gives it, "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", or a schedule class) runs them for
    ``stages`` stages and ``microbatches`` micro-batches. Schedules that split the backward into
    its input and weight halves (zero bubble, DualPipeV) are refused: their weight half keeps
    tensors memfit's profile does not time apart."""
    if stages < 2 or microbatches < 1:
        raise MemfitError(f"a pipeline needs 2 stages or more and a micro-batch or more, got {stages} stages "
                          f"and {microbatches} micro-batches")
    try:
        ops, single = schedule_ops(schedule, stages, microbatches)
    except ValueError as exc:  # an unknown name or too few micro-batches: torch's message says which
        raise MemfitError(str(exc)) from None
    out: list[list[Action]] = []
    for actions in ops:
        mine: list[Action] = []
        count = {"F": 0, "B": 0}
        for a in actions:
            if a is None or a.computation_type.name in _SKIPPED:
                continue
            kind = _KINDS.get(a.computation_type.name)
            if kind is None:
                raise MemfitError(
                    f"the {schedule} schedule runs {a.computation_type.name} actions ({a}): memfit plans schedules "
                    "whose backward is whole (GPipe, 1F1B, Interleaved1F1B, LoopedBFS), not split into its input "
                    "and weight halves")
            # A one-stage-a-rank schedule runs its own loop, forwards and backwards each in micro-batch
            # order; its pipeline_order numbers the last rank's from 1 (torch 2.13): number them again.
            mb = count[kind] if single else int(a.microbatch_index)
            count[kind] += 1
            mine.append((kind, int(a.stage_index), mb))
        out.append(mine)
    _check_orders(out, stages, microbatches, schedule)
    name = (schedule if isinstance(schedule, str) else schedule.__name__).lower().removeprefix("schedule")
    for order in out:
        _sends(order, name, stages, microbatches)
    return out


def stage_count(schedule: Any, ranks: int) -> int:
    """The stages of a pipeline of ``ranks`` ranks under ``schedule``: one a rank, two for the
    schedules that interleave."""
    try:
        return ranks * stages_per_rank(schedule)
    except ValueError as exc:  # an unknown name: torch's message lists the valid ones
        raise MemfitError(str(exc)) from None


def _sends(order: list[Action], schedule: str, stages: int, microbatches: int) -> None:
    """Add to a rank's ``order`` where the schedule's loop lets go of what it sent: ("R", s, mb)
    where stage s's output of micro-batch mb may go, if that is after its backward; ("G", s, mb)
    where its input gradient may. A send's work (gloo's or NCCL's) holds the tensor until the
    loop drops it; read from torch 2.13's loops and measured on gloo, to the byte:

    - GPipe waits on every send at the end of its forwards and of its backwards but keeps the
      lists of works until it returns: every output and every input gradient lives to the end. So
      does the runtime of the schedules run from their order of actions (Interleaved1F1B,
      LoopedBFS: its ``send_ops``, waited on before ``step`` returns).
    - 1F1B drops each input gradient's send when it sends the next one (after the next backward)
      and keeps the send of its last warmup forward but one until its steady state ends (after the
      backward of micro-batch M - warmup).
    - GPipe and 1F1B keep the last forward's output (their ``output`` variable) to the end.
    """
    if not order:
        return
    stage_list = sorted({s for _, s, _ in order})
    end: list[Action] = []
    for stage in stage_list:
        mbs = [mb for kind, s, mb in order if s == stage and kind == "B"]
        first, last = stage == 0, stage == stages - 1
        if schedule != "1f1b":
            held = range(microbatches) if not last else [microbatches - 1] if schedule == "gpipe" else []
            end += [("R", stage, mb) for mb in held]
            end += [] if first else [("G", stage, mb) for mb in range(microbatches)]
            continue
        warmup = min(microbatches, stages - stage)
        if warmup >= 2 and not last:
            order.insert(order.index(("B", stage, microbatches - warmup)) + 1, ("R", stage, warmup - 2))
        end.append(("R", stage, microbatches - 1))
        if not first:  # each input gradient goes once the next backward has made its own
            for prev, nxt in itertools.pairwise(mbs):
                order.insert(order.index(("B", stage, nxt)) + 1, ("G", stage, prev))
            end.append(("G", stage, mbs[-1]))
    order.extend(end)


def _check_orders(orders: list[list[Action]], stages: int, microbatches: int, schedule: Any) -> None:
    """Every stage runs each micro-batch's forward once, then its backward once."""
    for s in range(stages):
        seen = [(kind, mb) for order in orders for kind, st, mb in order if st == s and kind in "FB"]
        want = {(k, m) for k in "FB" for m in range(microbatches)}
        if len(seen) != len(want) or set(seen) != want or any(
                seen.index(("B", m)) < seen.index(("F", m)) for m in range(microbatches)):
            raise MemfitError(f"memfit cannot read the {schedule} schedule's order of actions for stage {s} "
                              f"({seen}): report it, with your torch version")


def stage_ranks(orders: list[list[Action]]) -> dict[int, int]:
    """The rank each stage runs on."""
    return {s: r for r, order in enumerate(orders) for _, s, _ in order}


def in_flight(order: Sequence[Action], stage: int) -> int:
    """The most micro-batches whose forward has run on ``stage`` and whose backward has not."""
    held = most = 0
    for kind, s, _ in order:
        if s == stage and kind in "FB":
            held += 1 if kind == "F" else -1
            most = max(most, held)
    return most


@dataclass(slots=True)
class StageData:
    """What a stage holds across steps, as ``PipelineStage`` does: per micro-batch, its input (the
    first stage's share of the batch; a later stage's receive buffer, a leaf whose gradient the
    backward makes and the send takes), the buffer its output's gradient arrives in (None on the
    last stage) and the loss's target (the last stage's)."""

    inputs: list[Any]
    grads: list[torch.Tensor | None]
    targets: list[Any]


def stage_data(inputs: list[Any], output: torch.Tensor | None, targets: list[Any], *, first: bool) -> StageData:
    """A stage's data for ``inputs`` (one per micro-batch: the batch's shares on the first stage,
    tensors of the received activation's shape on a later one, which become its buffers),
    ``output`` (an output of one micro-batch, for the shape of the gradient buffers; None on the last
    stage) and ``targets`` (the last stage's, else [])."""
    n = len(inputs)
    buffers = inputs if first else [t.detach().clone() for t in inputs]
    grads = [None] * n if output is None else [torch.randn_like(output) for _ in range(n)]
    return StageData(buffers, grads, targets)


@dataclass(slots=True)
class RankStep:
    """One training step of a rank of a pipeline, as a step function ``(model, data)``: the model is
    the rank's stage (or a ``ModuleDict`` of its stages, keyed by stage index), ``data`` its
    ``StageData`` (a dict of them by stage index). Each action in ``order`` runs the stage's forward
    (and on the last stage the loss) or its backward from the buffered gradient; the gradients are
    then divided by ``microbatches``, as the schedule's ``scale_grads`` does, clipped to
    ``clip_grad_norm`` where given, and the optimizer steps. It returns the mean loss on the rank
    of the last stage, else 0. (A pipeline clips to the norm of every stage's gradients, which
    torchtitan all-reduces over the pipeline's ranks: one number, no memory; a rank's step here
    takes its own stages' norm.)"""

    order: list[Action]
    last_stage: int
    microbatches: int
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    clip_grad_norm: float | None = None

    def __call__(self, model: nn.Module, data: dict[int, StageData]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        for stage in sorted({s for _, s, _ in self.order}):
            _gathered(_module(model, stage))
        held: dict[tuple[int, int], tuple[Any, Any]] = {}  # PipelineStage.fwd_cache: output, and the loss
        sent: dict[tuple[str, int, int], Any] = {}  # what a send holds past its use, until its "R" or "G"
        kept = {a for a in self.order if a[0] in "RG"}
        losses = []
        for kind, stage, mb in self.order:
            d = data[stage]
            if kind in "RG":
                sent.pop((kind, stage, mb), None)
            elif kind == "F":
                x = d.inputs[mb]
                if stage > 0 and isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.requires_grad_(True)  # a received activation: its gradient goes back
                out = _module(model, stage)(x)
                loss = None
                if stage == self.last_stage:
                    if self.loss_fn is None:
                        raise MemfitError("the last stage needs a loss_fn(output, target)")
                    loss = self.loss_fn(out, d.targets[mb])
                    losses.append(loss.detach())
                held[(stage, mb)] = (out, loss)
                if ("R", stage, mb) in kept:
                    sent[("R", stage, mb)] = out
            else:
                out, loss = held.pop((stage, mb))
                _no_sync(_module(model, stage))
                torch.autograd.backward(out, d.grads[mb]) if loss is None else loss.backward()
                del out, loss
                x = d.inputs[mb]
                if isinstance(x, torch.Tensor) and x.grad is not None:
                    if ("G", stage, mb) in kept:
                        sent[("G", stage, mb)] = x.grad
                    x.grad = None
        sent.clear()
        for stage in sorted({s for _, s, _ in self.order}):
            if _is_fsdp(_module(model, stage)):
                fsdp_reduce_after_pipeline(_module(model, stage))
        for p in model.parameters():  # the schedule's scale_grads: the mean over micro-batches
            if p.grad is not None:
                p.grad.div_(self.microbatches)
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), self.clip_grad_norm)
        self.optimizer.step()
        return torch.stack(losses).mean() if losses else torch.zeros(())


def _is_fsdp(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if _is_fsdp(m)]


def _gathered(module: nn.Module) -> None:
    """An FSDP2 stage's parameters gathered at the step's start. A stage sharded as torchtitan
    shards one (no resharding after the forward, none after a backward but the last) gathers each
    unit's in its first forward and keeps them to the end of the step; gathering them first makes
    every micro-batch's forward alike, which the profile needs, and moves no peak: a stage holds the
    most after its first forwards, when the real one has gathered everything too."""
    for m in _fsdp_modules(module):
        m.unshard()


def reshard(module: nn.Module) -> None:
    """Every FSDP2 module of ``module`` resharded (a forward with no backward, or a step, left
    their parameters gathered)."""
    for m in _fsdp_modules(module):
        m.reshard()


def _no_sync(module: nn.Module) -> None:
    """Before each backward of an FSDP2 stage, what ``PipelineStage.backward_maybe_with_nosync``
    does: no gradient reduction and no resharding, so the stage's parameters stay gathered and its
    gradients accumulate unsharded over the micro-batches until the step's end
    (``fsdp_reduce_after_pipeline``)."""
    if _is_fsdp(module):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def _module(model: nn.Module, stage: int) -> nn.Module:
    if isinstance(model, nn.ModuleDict) and str(stage) in model:
        return model[str(stage)]
    return model


def makespan(orders: list[list[Action]], fwd_s: dict[int, float], bwd_s: dict[int, float]) -> float:
    """Seconds one step of the pipeline takes when each rank runs its actions in ``orders`` (as
    ``rank_orders`` gives them), stage s's forward of a micro-batch taking ``fwd_s[s]`` and its
    backward ``bwd_s[s]``: a forward waits for the previous stage's forward of that micro-batch,
    a backward for the next stage's backward of it (the last stage's for its own forward), and
    each rank for its previous action. Communication is free."""
    last = max(fwd_s)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(orders)
    at = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r, order in enumerate(orders):
            while at[r] < len(order):
                kind, s, mb = order[at[r]]
                if kind in "RG":
                    at[r] += 1
                    remaining -= 1
                    moved = True
                    continue
                need = (("F", s - 1, mb) if s > 0 else None) if kind == "F" else (
                    ("B", s + 1, mb) if s < last else ("F", s, mb))
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need is not None else 0.0)
                clock[r] = start + (fwd_s[s] if kind == "F" else bwd_s[s])
                done[(kind, s, mb)] = clock[r]
                at[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise MemfitError("the schedule's actions wait on each other: no rank can go on")
    return max(clock)
