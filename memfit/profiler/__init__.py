"""Measuring a model's training step: per-unit memory phases and times (CUDA or the CPU)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.profile import OptionCost, Profile
from memfit.formats.schedule import model_fingerprint
from memfit.measure.inputs import Inputs, forward_names
from memfit.measure.memory import device_memory
from memfit.measure.meters import Meters
from memfit.measure.step import LossFn, StepState, default_loss, static_bytes, storage_bytes, training_step
from memfit.measure.timing import alternate, ratio_uncertainties
from memfit.measure.userstep import StepFn, UserStepState
from memfit.planning.options import GRANULARITIES
from memfit.policy import COARSE, FULL, KEEP, Children, Derive, Option, Policy, Selective
from memfit.profiler import costs
from memfit.profiler import phases as timeline
from memfit.profiler.options import fine_options
from memfit.profiler.saved import UnitFacts, unit_facts
from memfit.runtime.apply import is_checkpointed
from memfit.runtime.harness import StepHarness
from memfit.runtime.marks import Stretch, check_same_shape, stretches
from memfit.trainstep import OptimizerFactory, TrainStep, step_of
from memfit.units import find_units, require_module

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class _Instruments:
    meters: Meters | None = None  # None: the model's device's own
    foreach_default: bool | None = None  # the optimizer's foreach choice where the device cannot tell


_INSTRUMENTS: ContextVar[_Instruments | None] = ContextVar("memfit_instruments", default=None)


@contextmanager
def measuring_with(meters: Meters, foreach_default: bool | None = None) -> Iterator[None]:
    """``profile`` inside measures with ``meters`` and, with ``foreach_default``, runs the optimizer
    kernels PyTorch would pick on another device: estimate mode's fake meters (measure/fake.py),
    kept out of ``profile``'s signature because no user passes them."""
    token = _INSTRUMENTS.set(_Instruments(meters, foreach_default))
    try:
        yield
    finally:
        _INSTRUMENTS.reset(token)


def profile(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    units: str | list[str] = "auto",
    optimizer: str | OptimizerFactory | None = "adamw",
    step: TrainStep | None = None,
    repeat: int = 5,
    progress: Progress | None = None,
    granularity: str = "module",
    children: list[str] | None = None,
    step_fn: StepFn | None = None,
) -> Profile:
    """Measure one training step of ``model`` on ``inputs`` with every unit kept, then with every
    unit checkpointed, and return the per-unit costs the planner needs. ``step``: the training
    step as the loop runs it (memfit.TrainStep: optimizer, micro-batches, precision, clipping,
    zero_grad; ``optimizer=`` alone is short for ``step=TrainStep(optimizer=...)``).
    ``granularity="fine"`` also measures finer options (see profiler/options.py), each in a step
    of its own with every unit that has it in it, for ``plan(..., granularity="fine")``;
    ``children`` (relative names such as ``["attn", "mlp", "attn+mlp"]``) names the child options
    to measure instead of the automatic choice. ``step_fn``: a step function of your own,
    ``step_fn(model, inputs)`` doing forward(s), backward and the optimizer (measure/userstep.py),
    in place of memfit's step; ``loss_fn`` and ``step`` do not apply to it. It measures with the
    model's device's own meters (estimate mode swaps in fake ones: ``measuring_with``).

    ``inputs`` is a tensor, a tuple of positional arguments or a dict of keyword arguments, on
    the model's device. The model's weights, buffers, gradients, mode and the RNG are left as
    they were.
    """
    require_module(model, "memfit.profile")
    _check_arguments(model, repeat, granularity, children)
    if step_fn is not None and (step is not None or optimizer != "adamw" or granularity != "module"):
        raise MemfitError("step_fn= is the whole step, optimizer included: give it alone, without step= or "
                          "optimizer= (and at granularity 'module': finer options need memfit's own step)")
    say = progress or (lambda _msg: None)
    tools = _INSTRUMENTS.get() or _Instruments()
    meters, foreach_default = tools.meters, tools.foreach_default
    inp = Inputs.of(inputs)
    loss = loss_fn or default_loss
    names = find_units(model, units)
    if any(is_checkpointed(model.get_submodule(n)) for n in names):
        raise MemfitError("the model already has checkpointed units; profile the plain model")
    harness = StepHarness(model, inp, loss_fn=loss, step=step_of(step, optimizer), foreach_default=foreach_default,
                          step_fn=step_fn)
    # a named optimizer has lr 0: the steps leave the weights as they are, so only the rest is put back
    with harness.restoring(weights=harness.changes_weights):
        model.train()
        state = harness.new_state()
        say("warm-up step")
        state.zero_grad()
        try:
            training_step(model, inp, loss, state)  # creates the optimizer state: steady state follows
        except Exception as exc:
            unknown = [] if step_fn is not None else inp.unknown_to(model)
            if not unknown:
                raise
            raise MemfitError(f"the model's forward failed ({type(exc).__name__}: {exc}) with inputs "
                              f"{', '.join(map(repr, unknown))}, which forward does not name; it takes "
                              f"{', '.join(forward_names(model) or [])}: check the inputs' keys") from exc
        say("saved-for-backward bytes")
        with state.autocast():
            facts = unit_facts(model, names, inp, loss, None if step_fn is None else
                               lambda on_mark: training_step(model, inp, loss, state, on_mark),
                               byte_masks=meters is not None and meters.byte_masks)
            finer = fine_options(model, names, inp, loss, facts.saved, children) if granularity == "fine" else {}
        options = [*COARSE, *dict.fromkeys(o for opts in finer.values() for o in opts)]
        _check_children(model, names, options, children)
        configs: dict[Option, dict[str, Policy]] = {
            o: {n: o if o in COARSE or o in finer[n] else KEEP for n in names} for o in options}
        memory = _memory(harness, state, names, configs, meters, say, facts)
        # units two by two as segments price a segment's members; not under autocast (no segments then)
        pairs = costs.segments(names, 2) if facts.chain and len(names) > 1 and not harness.step.amp else {}
        if meters is not None and meters.together:  # estimate mode: each memory step was timed too
            timed = [("pairs", pairs, False)] if pairs else []
            rest = [[memory[o]] for o in options] + _times(harness, state, names, timed, repeat, meters, say)
        else:
            timed = [(str(o), c, o not in COARSE) for o, c in configs.items()]
            timed += [("pairs", pairs, False)] if pairs else []
            rest = _times(harness, state, names, timed, repeat, meters, say)
        times, full_times, *rest = rest
        finer_times, pair_times = (rest[:-1], rest[-1]) if pairs else (rest, [])
        state.zero_grad()
        baseline = static_bytes(model, state, inp)
        state_bytes = storage_bytes(state.state_tensors())
    measured = timeline.Runs.of(memory[KEEP], len(names)).count
    per_step = max(measured, state.step.accumulate)  # micro-batches past the two measured repeat the second
    groups = costs.structures(model, names, facts)
    if meters is None:  # fake meters time nothing: their times are estimates
        costs.check_alike(timeline.first_runs(times, timeline.Runs.of(memory[KEEP], len(names)).forwards), groups,
                          names)
    full_sure, *finer_sure = ratio_uncertainties([costs.seconds(r) for r in times],
                                                 [[costs.seconds(r) for r in runs] for runs in (full_times, *rest)])
    pair_sure = finer_sure.pop() if pairs else math.nan
    under = [sum(p == o for p in configs[o].values()) for o in options[1:]]
    full, *finer_overheads = costs.overheads(times, [full_times, *finer_times], [full_sure, *finer_sure], under,
                                             options[1:])
    prof = _assemble(model, names, inp, state, harness.device, memory, times, facts, baseline, state_bytes,
                     costs.recompute_factor(times, full), measured, per_step, groups)
    if pairs:
        costs.add_members(prof, pairs, times, pair_times, pair_sure, measured, per_step)
    scale = per_step / measured
    for option, runs, found in zip(options[len(COARSE):], finer_times, finer_overheads, strict=True):
        _add_option(prof, option, [n in finer and option in finer[n] for n in names], memory[option], memory[KEEP],
                    times, runs, scale, facts.saved_casts, groups, found)
    _prune(prof)
    return prof


def _check_arguments(model: nn.Module, repeat: int, granularity: str, children: list[str] | None) -> None:
    if repeat < 1:
        raise MemfitError("repeat must be at least 1")
    if granularity not in GRANULARITIES:
        raise MemfitError(f"unknown granularity {granularity!r}; use {' or '.join(GRANULARITIES)}")
    if children is not None and granularity != "fine":
        raise MemfitError("children= names finer options: give granularity='fine' with it")
    if not any(p.requires_grad for p in model.parameters()):
        raise MemfitError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): there is no "
            "training step to plan; unfreeze the parameters you train"
        )


def _times(harness: StepHarness, state: StepState | UserStepState, names: list[str],
           configs: list[tuple[str, dict[str, Policy], bool]], repeat: int, meters: Meters | None,
           say: Progress) -> list[list[list[Stretch]]]:
    """Each configuration's timed stretches over ``repeat`` interleaved rounds (``alternate``);
    ``configs``: (name, each unit's policy, whether it learns in its first step: ``derive``).
    Under estimate mode's fake meters, whose clock is a roofline that no earlier step moves, one
    step each, after an untimed one only where the configuration learns (``_memory``'s steps
    time the rest there)."""
    options, policies = [c[0] for c in configs], [c[1] for c in configs]
    if not configs:
        return []
    if meters is not None:
        say(f"timing ({', '.join(options)})")
        out = []
        with harness.switching() as use:
            for (_, chosen, learns) in configs:
                use(chosen)
                if learns:
                    harness.marked_step(state, names, "time", meters)
                out.append([stretches(harness.marked_step(state, names, "time", meters))])
        return out
    per_round = 2 * len(options)  # each configuration: an untimed step, then a timed one
    calls = iter(range(per_round * repeat))

    with harness.switching() as use:
        def timed(k: int) -> list[Stretch]:
            if (call := next(calls)) % per_round == 0:
                say(f"timing {call // per_round + 1}/{repeat} ({', '.join(options)})")
            use(policies[k])
            return stretches(harness.marked_step(state, names, "time", meters))

        return alternate(timed, len(options), repeat)


def _check_children(model: nn.Module, names: list[str], options: list[Option], children: list[str] | None) -> None:
    """Every child the caller named is an option of some unit."""
    offered = {o.names for o in options if isinstance(o, Children)}
    for c in children or []:
        if c not in offered:
            unit = model.get_submodule(names[0])
            raise MemfitError(f"no unit has the child {c!r}; {names[0]}'s children are "
                              f"{', '.join(n for n, _ in unit.named_children())} (nested ones with dots: mlp.0)")


def _memory(harness: StepHarness, state: StepState | UserStepState, names: list[str],
            configs: dict[Option, dict[str, Policy]], meters: Meters | None, say: Progress,
            facts: UnitFacts) -> timeline.Memory:
    """The memory stretches of a steady-state step with every unit running each option, and where
    a unit's checkpoint may free what the model's own code drops after it, with alternate units
    checkpointed (``timeline.separate``). Each configuration's step follows a warm-up step in it,
    except under estimate mode's fake meters (no allocator, no caches) after the first, where
    checkpoint regions learn nothing in a step (``derive`` and op sets do). Meters that allow it
    (``Meters.together``: estimate mode's) time these steps too."""
    model, inp, loss = harness.model, harness.inputs, harness.loss_fn
    memory: timeline.Memory = {}
    what = "both" if meters is not None and meters.together else "memory"  # the estimate's steps priced at once

    def warm_up(option: Option | None) -> None:
        # fake meters: derive learns its plan, SAC's modes count what their cache serves (tests/test_estimate.py)
        if meters is None or not memory or isinstance(option, (Derive, Selective)):
            state.zero_grad()
            training_step(model, inp, loss, state)

    for option, policies in configs.items():
        say(f"memory with every unit {option}")
        with harness.options(policies):
            warm_up(option)
            memory[option] = stretches(harness.marked_step(state, names, what, meters))
        check_same_shape(memory[KEEP], memory[option], f"every unit was {option}")
    timeline.check_order(memory[KEEP], names)
    if len(names) > 1 and timeline.needs_alternating(memory, names, facts):
        for key, policies in timeline.alternating(names).items():
            say(f"memory with {key.replace(':', ' ')} units checkpointed")
            with harness.options(policies):
                warm_up(None)
                memory[key] = stretches(harness.marked_step(state, names, "memory", meters))
            check_same_shape(memory[KEEP], memory[key], key)
    return memory


def _assemble(
    model: nn.Module,
    names: list[str],
    inp: Inputs,
    state: StepState | UserStepState,
    device: torch.device,
    memory: timeline.Memory,
    times: list[list[Stretch]],
    facts: UnitFacts,
    baseline: int,
    state_bytes: int,
    factor: tuple[float, float],
    measured: int,
    per_step: int,
    groups: list[int],
) -> Profile:
    """The Profile of a step whose units ran ``measured`` times and run ``per_step`` times in a
    whole step (the micro-batches past the two measured repeat the second); ``factor``: the
    recompute factor and its uncertainty."""
    params = list(model.parameters())
    unit_params = [storage_bytes(list(model.get_submodule(n).parameters())) for n in names]
    steps = timeline.phases(memory, names, "micro-batch")
    freed, later = timeline.separate(memory, steps, len(names))
    timeline.hold_peaks(steps)
    units = timeline.units(names, memory, times, facts, *factor, per_step, unit_params, groups, freed, later)
    extra = per_step - measured  # micro-batches like the last one measured
    step_s = statistics.median(costs.seconds(run) + extra * timeline.last_micro_batch(run) for run in times)
    trainable = [p for p in params if p.requires_grad]
    measured = {o: baseline + max(0, max(s.peak for s in _cumulative(memory[o]))) for o in COARSE}
    return Profile(
        model_class=model_fingerprint(model, names)["model_class"],
        device=str(device),
        optimizer=state.optimizer_name,
        input_shapes=inp.describe(),
        baseline_bytes=baseline,
        param_bytes=storage_bytes(params),
        grad_bytes=storage_bytes(trainable),
        buffer_bytes=storage_bytes(list(model.buffers())),
        optimizer_state_bytes=state_bytes,
        input_bytes=storage_bytes(inp.tensors()),
        step_s=step_s,
        units=units,
        phases=steps,
        fingerprint=model_fingerprint(model, names),
        measured_peak_bytes=measured,
        torch_version=torch.__version__,
        recompute_factor=factor[0],
        chain=facts.chain,
        rng_state_bytes=torch.get_rng_state().untyped_storage().nbytes() if device.type == "cpu" else 0,
        step=state.record(),
        memory=device_memory(device),
    )


def _cumulative(run: list[Stretch]) -> list[Stretch]:
    """Stretches with peaks relative to the step's start instead of their own start."""
    level, out = 0, []
    for s in run:
        out.append(Stretch(s.label, level + s.peak, level + s.end, s.seconds))
        level += s.end
    return out


def _add_option(prof: Profile, option: Option, has: list[bool], memory: list[Stretch], plain_memory: list[Stretch],
                plain: list[list[Stretch]], runs: list[list[Stretch]], scale: float, saved_casts: list[int],
                groups: list[int], found: costs.Overhead) -> None:
    """A finer option's costs, for the units that ``has`` it, from the step that ran them all so;
    ``_prune`` then drops it where another option dominates it.

    Its recompute time is ``found`` (``costs.overheads``), shared among the units by the time each
    structure spent in its own work in its forward and backward, or where none was (an op set; estimate mode)
    by how much longer they took, or the cost model where that is noise (``costs.shares``);
    ``scale``: a whole step's runs of each unit over the measured ones."""
    index = {s.label: k for k, s in enumerate(memory)}
    extra = max(0.0, found.seconds) * scale
    uncertainty_s = 0.0 if math.isnan(found.uncertainty_s) else found.uncertainty_s * scale
    where = timeline.Runs.of(memory, len(prof.units))
    released = timeline.releases(plain_memory, memory, has, saved_casts)

    last = len(prof.units) - 1
    # the last unit's derive re-derives after it too (a whole unit's: a child's has no tail)
    tail = isinstance(option, Derive) and not option.child and option.tail and has[last]

    def stretches_of(j: int) -> list[int]:  # unit j's forward and backward (the last one's tail too)
        after, before = timeline.tail_phases(prof.phases, j) if tail and j == last else ([], [])
        return [index[f"fwd:{j}"], index[f"bwd:{j}"], *after[:1], *before[:1]]

    def longer(j: int) -> list[float]:  # per round: this option's forward and backward less the plain ones
        return [sum(r[k].seconds - p[k].seconds for k in stretches_of(j)) for r, p in zip(runs, plain, strict=True)]

    units = [j for j in range(len(prof.units)) if has[j]]
    holds = timeline.holds_outside(memory, plain_memory, prof.phases,
                                   set(timeline.tail_phases(prof.phases, last)[1]) if tail else set())
    frees = timeline.option_frees(memory, plain_memory, prof.phases, has,
                                  [u.options[FULL].freed_later_bytes for u in prof.units], holds)
    made: dict[int, OptionCost] = {}
    for j in units:
        made[j] = timeline.option_cost(memory, where, j, prof.units[j].name, 0.0, released[j])
        made[j].freed_after_bytes, made[j].holds_outside = frees[j], holds
        if tail and j == last:
            timeline.add_tail(made[j], memory, plain_memory, prof.phases, j)
    if isinstance(option, Derive):  # a derive unit that ran otherwise than the others of its structure (the
        # first with the head, the last with the tail: more work outside it) is priced on its own
        figures = {j: dataclasses.astuple(made[j]) for j in units}
        own = {(groups[j], figures[j]): k for k, j in enumerate(units)}
        groups = [len(groups) + own[groups[j], figures[j]] if j in made else g for j, g in enumerate(groups)]
    if found.work_s > 0:  # per round: unit j's share of the work
        share = costs.shares_by_work({j: [sum(r[k].work_s for k in stretches_of(j)) for r in runs]
                                         for j in units}, groups, found)
    else:
        share = costs.shares({j: longer(j) for j in units}, {j: prof.units[j].fwd_s for j in units}, groups)
    for j in units:
        made[j].recompute_s, made[j].recompute_uncertainty_s = extra * share[j], uncertainty_s * share[j]
        prof.units[j].options[option] = made[j]
    prof.measured_peak_bytes[option] = prof.baseline_bytes + max(0, max(s.peak for s in _cumulative(memory)))


def _prune(prof: Profile) -> None:
    """Drop each finer option that another option of its unit dominates: no plan needs it."""
    for u in prof.units:
        for name in [o for o in u.options if o not in COARSE]:
            cost = u.options[name]
            if any(_dominates(c, cost) for o, c in u.options.items() if o != name):
                del u.options[name]


def _dominates(a: OptionCost, b: OptionCost) -> bool:
    """``a`` is never worse than ``b`` at any moment of the step, nor dearer: no plan needs ``b``
    (an op set that keeps more than autograd would, say)."""
    (a_peak, a_end), (b_peak, b_end) = a.backward(later=True), b.backward(later=True)
    return (a.stored_bytes + a.bwd_end_bytes == b.stored_bytes + b.bwd_end_bytes and a_end == b_end
            and a.freed_after_bytes == b.freed_after_bytes and a.freed_later_bytes == b.freed_later_bytes
            and a.stored_bytes <= b.stored_bytes and a.fwd_peak_bytes <= b.fwd_peak_bytes
            and a.bwd_peak_bytes <= b.bwd_peak_bytes and a_peak <= b_peak and a.recompute_s <= b.recompute_s
            and (b.holds_outside or not a.holds_outside))
