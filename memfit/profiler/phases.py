"""From measured stretches to the Profile's units and phases, for steps that run a unit more than once.

A unit runs once per micro-batch: memfit's step measures two micro-batches (every later one
repeats the second), a user's step function may run it several times. Each run's forward costs
what the first one does; its first backward creates the gradients, every later one accumulates
into them (``OptionCost.later_*``). Marks name the run (``fwd:3@2``, runtime/marks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit.formats.profile import OptionCost, Phase, UnitProfile, after_forwards
from memfit.policy import COARSE, FULL, KEEP, Option, Policy
from memfit.profiler import costs
from memfit.profiler.saved import UnitFacts
from memfit.runtime.marks import Stretch

# each all-units option's memory run, and the two ALTERNATE runs (named by these strings)
Memory = dict[Option | str, list[Stretch]]


@dataclass(frozen=True, slots=True)
class Label:
    """A mark's label read back: ``kind`` (``fwd``, ``bwd_end``, ``forward``, ``step``, ...),
    the unit's index (None for the step's own marks) and the run (1 for the first)."""

    kind: str
    unit: int | None
    run: int

    @staticmethod
    def of(label: str) -> Label:
        body, _, run = label.partition("@")
        kind, _, idx = body.partition(":")
        return Label(kind, int(idx) if idx else None, int(run) if run else 1)


@dataclass(slots=True)
class Runs:
    """Where each unit's runs sit among one step's stretches."""

    forwards: list[list[int]]  # per unit, its forward stretches in order
    backwards: list[list[int]]  # per unit, its backward stretches in the order they ran

    @staticmethod
    def of(run: list[Stretch], n: int) -> Runs:
        out = Runs([[] for _ in range(n)], [[] for _ in range(n)])
        for k, s in enumerate(run):
            lab = Label.of(s.label)
            if lab.kind in ("fwd", "bwd") and lab.unit is not None:
                (out.forwards if lab.kind == "fwd" else out.backwards)[lab.unit].append(k)
        return out

    @property
    def count(self) -> int:
        """Runs of a unit in the step (the most of any unit)."""
        return max((len(f) for f in self.forwards), default=0)


def units(names: list[str], memory: Memory, times: list[list[Stretch]], facts: UnitFacts,
          factor: float, sure: float, runs_per_step: int, param_bytes: list[int],
          groups: list[int], freed: list[int], later: list[int]) -> list[UnitProfile]:
    """Each unit's times and its coarse options' memory figures. A checkpointed unit runs its
    forward once more inside each backward, at the cost measured for all units together
    (``factor``, sure within ``sure`` of it), ``runs_per_step`` times a step. Units of one
    structure (``groups``: profiler/costs.py) share their times' samples; ``freed`` and ``later``:
    what checkpointing each frees right after its forward and a unit later (``separate``)."""
    runs = Runs.of(memory[KEEP], len(names))
    every = [True] * len(names)
    released = {o: releases(memory[KEEP], memory[o], every, facts.saved_casts) for o in COARSE}
    for i, name in enumerate(names):
        if not runs.forwards[i] or not runs.backwards[i]:
            raise MemfitError(
                f"unit {name!r} did not take part in the backward pass (no gradient reached its "
                "output); choose units whose outputs the loss depends on"
            )
    fwd = costs.pooled(first_runs(times, runs.forwards), groups)
    bwd = costs.pooled(first_runs(times, runs.backwards), groups)
    out: list[UnitProfile] = []
    for i, name in enumerate(names):
        fwd_s, bwd_s = fwd[i], bwd[i]
        options = {o: option_cost(memory[o], runs, i, name, 0.0 if o == KEEP else fwd_s * factor * runs_per_step,
                                  released[o][i], 0.0 if o == KEEP else fwd_s * sure * runs_per_step)
                   for o in COARSE}
        options[KEEP].holds_outside = False
        out.append(UnitProfile(name, fwd_s, bwd_s, facts.inputs[i], facts.saved[i], param_bytes[i], options,
                               facts.outputs[i]))
    _share_outputs(out, facts)
    for u, f, late in zip(out, freed, later, strict=True):
        u.options[FULL].freed_after_bytes, u.options[FULL].freed_later_bytes = f, late
    return out


def first_runs(times: list[list[Stretch]], where: list[list[int]]) -> list[list[float]]:
    """Per unit, the seconds of its first run's stretch (``where``: ``Runs.forwards`` or
    ``Runs.backwards``) in each timed round."""
    return [[r[ks[0]].seconds for r in times] for ks in where]


def option_cost(run: list[Stretch], runs: Runs, i: int, name: str, recompute_s: float,
                release: int = 0, uncertainty_s: float = 0.0) -> OptionCost:
    """Unit ``i``'s figures in a step where it ran one option, every run checked against the first
    of its kind (a unit whose runs differ, as with inputs of other sizes, cannot be planned so)."""
    fwd, bwd = [run[k] for k in runs.forwards[i]], [run[k] for k in runs.backwards[i]]
    for what, series in (("forward", fwd), ("later backward", bwd[1:])):
        for s in series[1:]:
            if (s.peak, s.end) != (series[0].peak, series[0].end):
                raise MemfitError(
                    f"unit {name!r} ran its {what} at different sizes within one step ({series[0].peak:,} and "
                    f"{s.peak:,} bytes at the peak): memfit plans steps whose runs of a unit see the same shapes")
    later = (bwd[1].peak, bwd[1].end) if len(bwd) > 1 else (None, None)
    return OptionCost(fwd[0].peak, fwd[0].end, bwd[0].peak, bwd[0].end, recompute_s, *later, release, uncertainty_s)


def releases(plain: list[Stretch], run: list[Stretch], has: list[bool], weights: list[int]) -> list[int]:
    """Each unit's ``release_bytes`` in ``run`` (the units that ``has`` the option ran it): what
    leaving autocast freed there beyond the plain step, shared by the weight casts each unit saves
    when kept (checkpointed, its cache alone holds them), the whole exact for the run itself."""
    at = [k for k, s in enumerate(plain) if Label.of(s.label).kind == "release"]
    if not at:
        return [0] * len(has)
    extra = plain[at[0]].end - run[at[0]].end
    for k in at[1:]:
        if plain[k].end - run[k].end != extra:
            raise MemfitError("leaving autocast freed different bytes in two micro-batches of one step")
    units = [j for j, h in enumerate(has) if h]
    total = sum(weights[j] for j in units)
    out = [0] * len(has)
    for n, j in enumerate(units):  # shares rounded down; the rest to the last unit: the sum is exact
        out[j] = extra * weights[j] // total if total > 0 else extra // len(units)
        if n == len(units) - 1:
            out[j] += extra - sum(out)
    return [max(0, v) for v in out]


ALTERNATE = ("alternate:even", "alternate:odd")  # memory runs: the even units full, the rest none; the reverse


def alternating(names: list[str]) -> dict[str, dict[str, Policy]]:
    """The two memory runs that tell apart, after a unit's forward, what checkpointing that unit
    frees from what checkpointing any unit keeps (``separate``)."""
    return {key: {n: FULL if i % 2 == parity else KEEP for i, n in enumerate(names)}
            for parity, key in enumerate(ALTERNATE)}


def needs_alternating(memory: Memory, names: list[str], facts: UnitFacts) -> bool:
    """Whether some remainder right after a unit's forward may end otherwise with that unit
    checkpointed (a unit saves an output the next does not take, or the all-checkpointed step
    ends such a remainder elsewhere): the alternating runs tell what that unit's option frees
    from what any checkpoint keeps, which can cancel out in the all-checkpointed step."""
    after = after_forwards(phases(memory, names, "run"))
    return any(facts.may_free_output) or any(memory[FULL][t].end != memory[KEEP][t].end for t in after)


def separate(memory: Memory, steps: list[Phase], n: int) -> tuple[list[int], list[int]]:
    """Split the remainders right after a unit's forward (of ``steps``, the step's phases) with the
    alternating runs where they were made. The remainder after unit ``j`` ends at the level the
    checkpoints keep there (B, its ``ckpt_end_bytes``, set here), less what checkpointing ``j``
    frees (``x = x + block(x)``), less what checkpointing ``j - 1`` frees a unit late (an output
    the model's loop holds until ``j`` returns): in the run where ``j`` is kept ``j - 1`` is
    checkpointed (B - late), in the other ``j`` is (B - freed), in the all-checkpointed run both
    are. Returns what checkpointing each unit frees right after it and a unit later (the least
    over its runs). What ``j`` frees may be negative: its checkpoint keeps its input, which the
    plain step frees there (under autocast, where the next product saves a cast of it: BERT's
    fp32 hidden state). A phase that does not add up (a late free comes out negative, B below the
    plain step's end) keeps the cautious rule and frees nothing."""
    none, full = memory[KEEP], memory[FULL]
    runs = (memory[ALTERNATE[0]], memory[ALTERNATE[1]]) if ALTERNATE[0] in memory else None
    if n == 1:
        runs = (full, none)
    by_unit: dict[int, list[int]] = {}
    later: dict[int, list[int]] = {}
    for t, j in after_forwards(steps).items():
        freed = late = 0
        if runs is not None:
            kept, ckpt = runs[1 - j % 2][t].end, runs[j % 2][t].end  # unit j kept (j - 1 not); unit j checkpointed
            both = full[t].end
            # no unit before the first to free anything late: there the two checkpointed runs agree
            if (j > 0 or ckpt == both) and ckpt >= both and kept + ckpt - both >= none[t].end:
                steps[t].ckpt_end_bytes, freed, late = kept + ckpt - both, kept - both, ckpt - both
        by_unit.setdefault(j, []).append(freed)
        if j > 0:
            later.setdefault(j - 1, []).append(late)
    return [min(by_unit.get(j, [0])) for j in range(n)], [min(later.get(j, [0])) for j in range(n)]


def hold_peaks(steps: list[Phase]) -> None:
    """Raise each remainder's checkpointed peak to its plain peak plus what the checkpoints keep past
    it (``ckpt_end_bytes`` over ``end_bytes``): the plain step may free those tensors inside the
    remainder, before its peak (the mask the blocks share, when the model's forward returns and
    before the head and the loss run), so that a plan whose checkpoints keep them peaks there by
    that much more. The all-checkpointed run alone does not show it where its last unit, being
    checkpointed, lowers the same peak (BLOOM under bf16 autocast: 8,064 bytes). Cautious where the
    plain step frees them after its peak."""
    for ph in steps:
        held = ph.ckpt_end_bytes - ph.end_bytes
        if ph.unit is None and held > 0:
            ph.ckpt_peak_bytes = max(ph.peak_with(True), ph.peak_bytes + held)


def option_frees(memory: list[Stretch], plain: list[Stretch], steps: list[Phase], has: list[bool],
                 later: list[int], holds: bool) -> list[int]:
    """What the remainder after each forward of a unit that ``has`` a finer option frees beyond
    the plain step (``steps``: its phases): only what the option's own run ends below the plain
    one (the least over the unit's runs), so never more than the option frees whatever the other
    units do. Where the unit before has the option too, what it may free a unit late is taken off
    (at most what checkpointing it whole frees so, ``later``): a finer option's late frees are
    not counted (cautious). An option that ``holds`` outside tensors frees nothing, and where its
    run ends above what the checkpoints keep there (a child region that keeps the unit's input,
    as ``full`` does under autocast: ``separate``), that is booked to the unit, negative."""
    by_unit: dict[int, list[int]] = {}
    for t, j in after_forwards(steps).items():
        if has[j]:
            before = later[j - 1] if j > 0 and has[j - 1] else 0
            if holds:
                by_unit.setdefault(j, []).append(min(0, steps[t].ckpt_end_bytes - memory[t].end - before))
            else:
                by_unit.setdefault(j, []).append(max(0, plain[t].end - memory[t].end - before))
    return [min(by_unit.get(j, [0])) for j in range(len(has))]


def holds_outside(memory: list[Stretch], plain: list[Stretch], steps: list[Phase], booked: set[int]) -> bool:
    """Whether a step with every unit in an option (``memory``) keeps tensors made outside the units
    longer than the plain step, as a checkpoint region that takes them does (a mask the blocks
    share, kept for their recompute): some remainder ends higher, or peaks higher where nothing
    of the option's own is booked (``after_peak_bytes`` right after a forward; ``booked``: the
    remainders whose changes ``add_tail`` folds into the unit). Cautious: any rise counts."""
    after = after_forwards(steps)
    return any(t not in booked and (memory[t].end > plain[t].end or (t not in after and memory[t].peak > plain[t].peak))
               for t, ph in enumerate(steps) if ph.unit is None)


def tail_phases(steps: list[Phase], j: int) -> tuple[list[int], list[int]]:
    """Where unit ``j``'s tail runs (runtime/derive.py): the remainders right after each of its
    forwards, and those right before each of its backwards (the loss's and the head's backward)."""
    after = [t for t, u in after_forwards(steps).items() if u == j]
    before = [t for t in range(len(steps) - 1) if steps[t].unit is None and steps[t + 1].unit == j
              and steps[t + 1].kind == "backward"]
    return after, before


def add_tail(cost: OptionCost, memory: list[Stretch], plain: list[Stretch], steps: list[Phase], j: int) -> None:
    """Book what the tail of unit ``j``'s option changes in the remainders around it (the figures
    of ``memory``, the step with that option, against ``plain``'s): the peak right after its
    forward (``after_peak_bytes``), and the head's backward, which re-makes the re-derived tensors
    and so no longer frees them: folded into the unit's own backward, which follows it, so that
    every solver takes it as it takes a unit's backward. The remainder's peak is the step's
    constant (``Phase.peak_with``, the larger of the plain and the checkpointed runs', whichever a
    plan takes): the backward's peak is raised to cover the remainder's with the option, counted
    from where the remainder began."""
    after, before = tail_phases(steps, j)
    if after:
        cost.after_peak_bytes = max(memory[t].peak - plain[t].peak for t in after)
    for n, t in enumerate(before[:2]):  # the first backward and a later one (every later one alike)
        d_end = memory[t].end - plain[t].end
        d_peak = memory[t].peak - plain[t].peak
        cover = steps[t].peak_with(True) + d_peak - steps[t].end_bytes  # the remainder's peak, from its end
        if n == 0:
            cost.bwd_peak_bytes = max(cost.bwd_peak_bytes + d_end, cover)
            cost.bwd_end_bytes += d_end
        elif cost.later_bwd_peak_bytes is not None and cost.later_bwd_end_bytes is not None:
            cost.later_bwd_peak_bytes = max(cost.later_bwd_peak_bytes + d_end, cover)
            cost.later_bwd_end_bytes += d_end


def phases(memory: Memory, names: list[str], word: str) -> list[Phase]:
    """The step's phases: each unit's forwards and backwards, and the remainder between them;
    ``word`` names a unit's later runs (``micro-batch``, or ``run`` for a user's step)."""
    out = []
    seen: set[int] = set()
    for s_none, s_full in zip(memory[KEEP], memory[FULL], strict=True):
        lab = Label.of(s_none.label)
        if lab.kind in ("fwd", "bwd") and lab.unit is not None:
            label = f"{'forward' if lab.kind == 'fwd' else 'backward'} {names[lab.unit]}" + _nth(lab.run, word)
            later = lab.kind == "bwd" and lab.unit in seen
            if lab.kind == "bwd":
                seen.add(lab.unit)
            out.append(Phase(label, lab.unit, "forward" if lab.kind == "fwd" else "backward", later=later))
        else:
            # The remainder's end and peak can be higher with checkpointing (tensors made outside
            # the units, kept for recompute): the plain run's, and the larger of the two runs'
            # where some unit holds such tensors; never taken lower. Leaving autocast frees what
            # its cache alone holds: the units' release_bytes. Right after a unit's forward,
            # ``separate`` may tell apart what that unit's option frees.
            freed = lab.kind == "release"
            peak, end = s_none.peak, s_none.end
            ckpt_end = end if freed else max(s_none.end, s_full.end)
            ckpt_peak = s_full.peak if s_full.peak > peak else None
            out.append(Phase(remainder_label(lab, names, word), None, "remainder", peak, end, ckpt_end,
                             releases=freed, ckpt_peak_bytes=ckpt_peak))
    return out


def check_order(run: list[Stretch], names: list[str]) -> None:
    """Units must be named in the order their first forwards run: the memory model walks them so."""
    ran = [lab.unit for lab in map(Label.of, (s.label for s in run))
           if lab.kind == "fwd" and lab.run == 1 and lab.unit is not None]
    missing = [names[i] for i in range(len(names)) if i not in ran]
    if missing:
        raise MemfitError(
            f"unit {missing[0]!r} never ran as a module in the forward pass (a ModuleList or a container whose "
            "forward is not called is not a unit: name its blocks, e.g. --units 'h.*' or units=['h.*'])"
        )
    if ran != sorted(ran):
        order = ", ".join(names[i] for i in ran)
        raise MemfitError(f"the units run in the order {order}, not as given; list them in the order they run")


def last_micro_batch(run: list[Stretch]) -> float:
    """Seconds of the last measured micro-batch: from its ``forward@n`` to clipping or the step."""
    starts = [k for k, s in enumerate(run) if Label.of(s.label).kind == "forward"]
    ends = [k for k, s in enumerate(run) if s.label in ("clip", "step")]
    if not starts or not ends:
        return 0.0
    return sum(s.seconds for s in run[starts[-1]:ends[0]])


def _nth(run: int, word: str) -> str:
    return f" ({word} {run})" if run > 1 else ""


def remainder_label(lab: Label, names: list[str], word: str = "run") -> str:
    nth = _nth(lab.run, word)
    if lab.kind == "forward":
        return "forward before the units" + nth
    if lab.kind == "fwd_end" and lab.unit is not None:
        return f"forward after {names[lab.unit]}" + (" (head, loss)" if lab.unit == len(names) - 1 else "") + nth
    if lab.kind == "backward":
        return "backward of loss and head" + nth
    if lab.kind == "bwd_end" and lab.unit is not None:
        return f"backward before {names[lab.unit]}" + nth
    names_of = {"clip": "gradient clipping", "step": "optimizer step", "release": "leaving autocast"}
    return names_of.get(lab.kind, lab.kind) + ("" if lab.kind in ("clip", "step") else nth)


def _share_outputs(units: list[UnitProfile], facts: UnitFacts) -> None:
    """Attribute the freeing of a shared output to the unit whose option decides it.

    When unit j saves its own output (a closing ReLU) and unit j+1 takes it, the output lives
    until the later of the two backwards to need it. Kept, unit j frees it at the end of its own
    backward (so measured); checkpointed, nothing of unit j holds it and it goes when unit j+1's
    backward ends, which the all-checkpointed run books to unit j+1 whatever unit j does. Moving
    that free to the start of unit j's checkpointed backward makes mixed schedules add up; the
    same holds for a later run's backward.
    """
    for j in range(len(units) - 1):
        if facts.keeps_output[j]:
            out = facts.outputs[j]
            nxt, cur = units[j + 1].options[FULL], units[j].options[FULL]
            nxt.bwd_end_bytes += out
            cur.bwd_peak_bytes -= out
            cur.bwd_end_bytes -= out
            if (nxt.later_bwd_end_bytes is not None and cur.later_bwd_peak_bytes is not None
                    and cur.later_bwd_end_bytes is not None):
                nxt.later_bwd_end_bytes += out
                cur.later_bwd_peak_bytes -= out
                cur.later_bwd_end_bytes -= out
