"""Text tables for the CLI: schedules, profiles and validations, in MiB/GiB and milliseconds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memfit.budget import format_bytes
from memfit.formats.layout import describe_layout
from memfit.formats.profile import Profile
from memfit.formats.schedule import Schedule
from memfit.planning.peak import predict
from memfit.planning.planner import best_baseline
from memfit.planning.roles import roles_of, unit_costs
from memfit.policy import COARSE, FULL, KEEP, Segment
from memfit.trainstep import CUSTOM, TrainStep, describe_record

if TYPE_CHECKING:
    import pandas as pd

    from memfit.steps.stages import StagePlans
    from memfit.steps.validate import Validation

BASELINE_NAMES = {
    "none": "checkpoint nothing",
    "full": "checkpoint every unit",
    "every-k": "every k-th unit",
    "sqrt": "sqrt(N) segments",
    "first-k": "first k units",
    "greedy": "greedy by bytes/second",
}


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """A plain aligned table; ``right`` marks the columns to align right (numbers)."""
    right = right or [i > 0 for i in range(len(headers))]
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _pm(x: float, sure: float) -> str:
    """A slowdown and, where known and not zero, its uncertainty (two standard errors)."""
    return _pct(x) + (f" ±{sure * 100:.1f}" if math.isfinite(sure) and sure > 0 else "")


def _unit_table(schedule: Schedule, profile: Profile | None) -> list[str]:
    """Each unit's policy and what it recomputes; with the profile, what it keeps and costs."""
    if profile is not None:
        roles = roles_of(profile, schedule.policies)
        rows: list[list[str]] = []
        kept_more = False  # a unit keeps visibly more than autograd saved: said below the table
        for j, (u, policy) in enumerate(zip(profile.units, schedule.policies.values(), strict=True)):
            cost = unit_costs(profile, j, roles[j])
            kept_more |= cost.fwd_end > 1.005 * u.saved_bytes  # more than the rounding shown
            rows.append([u.name, str(policy), policy.describe(), format_bytes(u.saved_bytes),
                         format_bytes(cost.fwd_end), _ms(cost.recompute_s)])
        head = ["unit", "policy", "recomputes", "saved for bwd", "kept to bwd", "recompute"]
        out = [table(head, rows, [False, False, False, True, True, True])]
        if kept_more:
            out.append("kept to bwd: what stays allocated from the unit's forward until its backward, which the plan "
                       "counts; it can exceed the tensors autograd saved (its output, tensors it stores, allocator "
                       "rounding)")
        if any(isinstance(p, Segment) for p in schedule.policies.values()):
            out.append("recompute: each member's own forward, once; a segment recomputes all its members together, "
                       "in the backward of its last")
    else:
        rows = [[n, str(p), p.describe()] for n, p in schedule.policies.items()]
        out = [table(["unit", "policy", "recomputes"], rows, [False, False, False])]
    return out


def _strategy_rows(schedule: Schedule, best: str | None) -> list[list[str]]:
    """The plan, then each baseline: its predicted peak, whether it fits, its slowdown."""
    budget = schedule.budget_bytes
    summary = [[f"memfit plan ({schedule.strategy})", format_bytes(schedule.predicted_peak_bytes),
                "yes" if schedule.predicted_peak_bytes <= budget else "compiled",  # plan_compiled: measured to fit
                _pct(schedule.predicted_overhead)]]
    for key, figures in schedule.baselines.items():
        name = BASELINE_NAMES.get(key, key) + ("  <- best baseline" if key == best else "")
        if not figures.get("applies", True):
            summary.append([name, "-", "n/a", "-"])
            continue
        if "peak_bytes" not in figures:  # from an older memfit, which kept no figures for a misfit
            summary.append([name, "-", "no", "-"])
            continue
        tightest = "" if figures["fits"] else " *"
        summary.append([name, format_bytes(int(figures["peak_bytes"])) + tightest, "yes" if figures["fits"] else "no",
                        _pct(figures["overhead"])])
    return summary


def _not_plain(schedule: Schedule) -> bool:
    """The recorded step is a user's function, a callable optimizer, or not TrainStep.plain."""
    s = schedule.step
    return bool(s) and (bool(s.get("function")) or (schedule.optimizer or "").startswith(CUSTOM)
                        or not TrainStep.from_fields(s).plain)


def _step_words(schedule: Schedule) -> str:
    """``adamw, amp-bf16, 2 micro-batches, clip 1``, from the recorded step (a callable optimizer or
    step function is named, not rebuilt)."""
    s = schedule.step
    if s and s.get("function"):
        return f"your step function {s['function']} ({schedule.optimizer})"
    return describe_record(schedule.optimizer, s)


def schedule_report(schedule: Schedule, profile: Profile | None = None) -> str:
    """The units with their policies, then the plan beside the baselines."""
    out = _unit_table(schedule, profile)
    out.append("")
    budget = schedule.budget_bytes
    best = best_baseline(schedule)
    out.append(table(["strategy", "predicted peak", "fits", "slowdown"], _strategy_rows(schedule, best),
                     [False, True, False, True]))
    if best is not None and schedule.strategy == "ilp":
        theirs = schedule.baselines[best]["recompute_s"]
        ratio = schedule.predicted_recompute_s / theirs if theirs > 0 else 1.0
        out.append(f"recompute time of this plan / best baseline ({best}): {ratio:.2f}")
        noise = math.hypot(schedule.predicted_uncertainty_s, float(schedule.baselines[best].get("uncertainty_s", 0.0)))
        if noise > 0 and theirs - schedule.predicted_recompute_s <= noise:
            out.append(f"these plans cost the same within the measurement's noise: this plan saves "
                       f"{(theirs - schedule.predicted_recompute_s) * 1e3:.1f} ms, the costs are sure to "
                       f"±{noise * 1e3:.1f} ms (profile with more --repeat, on a quiet machine, to tell them apart)")
    used = sum(p != KEEP for p in schedule.policies.values())
    segments = len({p for p in schedule.policies.values() if isinstance(p, Segment)})
    in_segments = f" ({segments} segment{'s' if segments > 1 else ''})" if segments else ""
    out.append("")
    took = "" if schedule.solve_s is None else f" in {schedule.solve_s:.2f} s"
    out.append(
        f"budget {format_bytes(budget)}; {used} of {len(schedule.policies)} units checkpointed{in_segments}; "
        f"solver {schedule.solver} ({schedule.solver_status}){took}"
    )
    out += device_notes(schedule, profile)
    if _not_plain(schedule):
        out.append(f"planned for the step: {_step_words(schedule)}")
    if schedule.compile:
        budget_note = (f", the partitioner's own memory budget {schedule.compile['memory_budget']:g}: compile with "
                       "memfit.compile_backend(schedule)" if "memory_budget" in schedule.compile else "")
        out.append(f"compiled step ({schedule.compile['backend']}{budget_note}), measured: peak "
                   f"{format_bytes(schedule.compile['peak_bytes'])} (the figures above are the eager step's)")
    if any(not f["fits"] and "peak_bytes" in f for f in schedule.baselines.values()):
        out.append("*: the strategy does not fit; its tightest schedule's figures")
    if any(not f.get("applies", True) for f in schedule.baselines.values()):
        why = "no segments under autocast" if ((schedule.step or {}).get("precision") or "").startswith("amp-") else (
            "sqrt needs a chain of units")
        out.append(f"n/a: the strategy has no schedule for these units ({why})")
    if profile is not None:
        where = predict(profile, schedule.policies).peak_phase
        out.append(f"the peak is reached in: {where}")
    if schedule.fallbacks:
        steps = "; ".join(f"{k}) {format_bytes(f['predicted_peak_bytes'])} {_pct(f['predicted_overhead'])}"
                          for k, f in enumerate(schedule.fallbacks, 1))
        out.append(f"fallbacks for memfit.tighten(model), tighter each: {steps}")
    if schedule.edited:
        out.insert(0, "warning: this schedule's policies were edited after planning; the predicted figures below "
                      "are the old plan's: plan again, or memfit.predict(profile, schedule.policies)\n")
    return "\n".join(out)


def shapes_report(schedule: Schedule, profiles: Sequence[Profile] = ()) -> str:
    """A schedule for several input shapes: each shape's plan as ``schedule_report`` prints it,
    then a row per shape and the slowdown a run sees over the shapes' shares."""
    by_shape = {p.input_shapes: p for p in profiles}
    plans = schedule.plans
    out = []
    for k, shape in enumerate(plans):
        out += [f"== shape {k + 1} of {len(plans)}: {shape_name(shape)} ==",
                schedule_report(shape, by_shape.get(shape.input_shapes)), ""]
    shared = schedule.shapes and schedule.shapes[0].share is not None
    rows = [[shape_name(p), format_bytes(p.predicted_peak_bytes), f"{len(p.checkpointed)} of {len(p.policies)}",
             _pct(p.predicted_overhead), f"{p.share:.0%}" if p.share is not None else "-"] for p in plans]
    out.append(table(["inputs", "predicted peak", "checkpointed", "slowdown", "share"], rows,
                     [False, True, True, True, True]))
    worst = max(plans, key=lambda p: p.predicted_peak_bytes)
    out.append(f"budget {format_bytes(schedule.budget_bytes)}: every planned shape fits, the highest at "
               f"{format_bytes(worst.predicted_peak_bytes)} ({shape_name(worst)}); a batch runs the plan of the "
               "smallest planned shape that covers it, and one larger than all the largest's, with a warning")
    out.append(f"expected slowdown over the length histogram: {_pct(schedule.expected_overhead)}" if shared else
               f"expected slowdown with each shape equally often: {_pct(schedule.expected_overhead)} (--seq-hist FILE "
               "weighs them by your data's lengths)")
    return "\n".join(out)


def shape_name(made: Schedule | Profile) -> str:
    """A shape's plan or profile by its sequence length where it was made for one, else by its inputs."""
    length = made.source.get("seq_len")
    return f"length {length}" if length is not None else f"inputs {made.input_shapes}"


def profile_report(profile: Profile) -> str:
    where = f"estimated for {profile.target}" if profile.mode == "estimated" else f"on {profile.device}"
    rows = []
    for u in profile.units:
        none, full = u.options[KEEP], u.options[FULL]
        rows.append([u.name, _ms(u.fwd_s), _ms(u.bwd_s), format_bytes(u.input_bytes), format_bytes(u.saved_bytes),
                     format_bytes(none.stored_bytes), format_bytes(full.stored_bytes),
                     format_bytes(none.bwd_peak_bytes), format_bytes(full.bwd_peak_bytes)])
    head = ["unit", "fwd", "bwd", "input", "saved", "kept (none)", "kept (full)", "bwd peak (none)", "bwd peak (full)"]
    lines = [
        f"{profile.model_class} {where}, optimizer {profile.optimizer}; inputs: {profile.input_shapes}",
        table(head, rows, [False, *([True] * 8)]),
        "",
        f"parameters {format_bytes(profile.param_bytes)}, gradients {format_bytes(profile.grad_bytes)}, "
        f"optimizer state {format_bytes(profile.optimizer_state_bytes)}, buffers {format_bytes(profile.buffer_bytes)}, "
        f"inputs {format_bytes(profile.input_bytes)}",
        f"one step {_ms(profile.step_s)}; measured peak {format_bytes(profile.measured_peak_bytes.get(KEEP, 0))} "
        f"with nothing checkpointed, {format_bytes(profile.measured_peak_bytes.get(FULL, 0))} with every unit",
    ]
    if profile.fine:
        finer = [[u.name, str(o), o.describe(), format_bytes(c.stored_bytes), format_bytes(c.bwd_peak_bytes),
                  _ms(c.recompute_s)] for u in profile.units for o, c in u.options.items() if o not in COARSE]
        lines += ["", "finer options (for plan --granularity fine; an option that none or full beats is left out):",
                  table(["unit", "option", "recomputes", "kept", "bwd peak", "recompute"], finer,
                        [False, False, False, True, True, True])]
    return "\n".join(lines)


def validation_report(v: Validation) -> str:
    rows = [
        ["peak memory", format_bytes(v.predicted_peak_bytes), format_bytes(v.measured_peak_bytes),
         f"{v.error * 100:+.2f}%"],
        ["slowdown", _pct(v.predicted_overhead), *([_pct(v.measured_overhead),
         f"{(v.predicted_overhead - v.measured_overhead) * 100:+.1f} pp"] if math.isfinite(v.measured_overhead)
                                                  else ["-", "-"])],
    ]
    verdict = "OK" if v.ok else "FAILED"
    checks = [
        f"measured peak {'fits' if v.fits else 'EXCEEDS'} the budget of {format_bytes(v.budget_bytes)} "
        f"(plain model: {format_bytes(v.plain_peak_bytes)})",
        f"losses {'equal' if v.losses_equal else 'DIFFER'}; gradients {'equal' if v.grads_equal else 'DIFFER'} "
        f"(max difference {v.max_grad_diff:.3g}"
        + (f"; the plain step against itself: {v.plain_grad_diff:.3g}" if v.plain_grad_diff else "")
        + f"); buffers {'equal' if v.buffers_equal else 'DIFFER'}",
        *([] if v.rank_peaks else [f"step time {_ms(v.plain_step_s)} plain, {_ms(v.step_s)} scheduled"
                                   + _compiled_words(v)]),
        _time_check(v),
    ]
    if v.rank_peaks:
        checks.insert(0, f"per rank (the worst is judged): {', '.join(format_bytes(p) for p in v.rank_peaks)}, "
                         "each against this rank's prediction")
    if v.cuda is not None:
        c, context, margin = v.cuda, v.context_bytes or 0, v.margin or 0.0
        checks.append(f"on the card: reserved peak {format_bytes(c['reserved_peak_bytes'])} ({margin:+.1%} over the "
                      f"allocated peak: the allocator's margin); {format_bytes(context)} outside the allocator (CUDA "
                      f"context); {format_bytes(c['free_bytes'])} free of {format_bytes(c['total_bytes'])} at the "
                      "step's end (torch.cuda.mem_get_info)")
        if v.over_model is not None and v.reserved_ratio is not None:
            checks.append(f"the caching allocator's model (the estimate this plan was made from) predicted "
                          f"{v.reserved_ratio - 1:+.1%} over the allocated peak: the card reserved {v.over_model:+.1%} "
                          "over that (--save-device-spec keeps it as the device's over_model)")
        if not v.reserved_fits:
            checks.append("the reserved peak and the context EXCEED the card's memory: this step does not fit there")
    if v.edited:
        checks.append("the schedule's policies were EDITED after planning: the predicted figures are the old plan's, "
                      "not these policies'; plan again, or predict these policies from the profile "
                      "(memfit.predict(profile, schedule.policies))")
    return "\n".join([table(["", "predicted", "measured", "error"], rows), "", *checks, f"validation {verdict}"])


def shapes_validation_report(schedule: Schedule, results: Sequence[Validation]) -> str:
    """A validation per planned input shape: each one's report, then a row per shape."""
    out = []
    for k, (shape, v) in enumerate(zip(schedule.plans, results, strict=True)):
        out += [f"== shape {k + 1} of {len(results)}: {shape_name(shape)} ==", validation_report(v), ""]
    rows = [[shape_name(p), format_bytes(v.predicted_peak_bytes), format_bytes(v.measured_peak_bytes),
             f"{v.error * 100:+.2f}%", "yes" if v.fits else "NO", _pct(v.predicted_overhead), _pct(v.measured_overhead),
             "yes" if v.losses_equal and v.grads_equal and v.buffers_equal else "NO", "OK" if v.ok else "FAILED"]
            for p, v in zip(schedule.plans, results, strict=True)]
    out.append(table(["inputs", "predicted peak", "measured peak", "error", "fits", "slowdown", "measured",
                      "results equal", ""], rows, [False, True, True, True, False, True, True, False, False]))
    failed = sum(not v.ok for v in results)
    out.append(f"validation {'OK' if not failed else 'FAILED'}: {len(results) - failed} of {len(results)} shapes")
    return "\n".join(out)


def _compiled_words(v: Validation) -> str:
    if not v.compile:
        return ""
    under = "" if v.compile_memory_budget is None else f"; the plan at memory budget {v.compile_memory_budget:g}"
    return f", both compiled ({v.compile}{under})"


def _time_check(v: Validation) -> str:
    """The slowdown's verdict: measured against predicted, within the tolerance and its uncertainty."""
    from memfit.measure.timing import MIN_TIMED_ROUNDS  # here: timing imports torch, which a table needs not

    if v.rank_peaks:
        return "slowdown not measured on ranks (they share this machine's cores): time your own run's steps"
    if not math.isfinite(v.measured_overhead):
        return "slowdown not measured (no timed rounds)"
    if not v.time_judged:
        return (f"slowdown not judged: {MIN_TIMED_ROUNDS} timed rounds or more tell how sure the measurement is "
                "(--steps 5)")
    gap = (v.measured_overhead - v.predicted_overhead) * 100
    limit = (v.time_tolerance + v.overhead_uncertainty) * 100
    return (f"measured slowdown {'within' if v.time_ok else 'OFF'} the predicted by {gap:+.1f} points: tolerance "
            f"{v.time_tolerance * 100:.1f} + this run's uncertainty {v.overhead_uncertainty * 100:.1f} = {limit:.1f}"
            + ("" if v.time_ok else "; the plan's times are not this machine's now: profile again here, or raise "
               "--time-tolerance if the machine is shared and busy"))


def sweep_report(frame: pd.DataFrame) -> str:
    """One line per budget: the ILP plan, each baseline's slowdown, measured figures if any."""
    strategies = list(dict.fromkeys(frame["strategy"]))
    others = [s for s in strategies if s != "ilp"]
    measured = "measured_peak_bytes" in frame
    head = ["budget"]
    if "ilp" in strategies:
        head += ["plan peak", "slowdown", "ckpt"] + (["measured peak", "measured"] if measured else [])
    head += [f"{s} slowdown" for s in others]
    rows = []
    by = {(r.strategy, r.budget_bytes): r for r in frame.itertuples()}
    for budget in sorted(set(frame["budget_bytes"])):
        row = [format_bytes(budget)]
        if "ilp" in strategies:
            r = by["ilp", budget]
            if r.status == "infeasible":
                row += ["does not fit", "-", "-"] + (["-", "-"] if measured else [])
            else:
                row += [format_bytes(r.predicted_peak_bytes),
                        _pm(r.predicted_overhead, getattr(r, "predicted_uncertainty", math.nan))
                        + (" !" if r.frontier_violation else ""), str(r.checkpointed)]
                if measured:
                    row += [format_bytes(r.measured_peak_bytes),
                            _pm(r.measured_overhead, getattr(r, "measured_uncertainty", math.nan))]
        for s in others:
            r = by[s, budget]
            row.append("n/a" if r.status == "n/a" else "-" if r.status == "infeasible" else _pct(r.predicted_overhead))
        rows.append(row)
    out = [table(head, rows)]
    out.append("\n'-': does not fit the budget; 'n/a': the strategy does not apply to these units")
    if "ilp" in strategies and frame.loc[frame["strategy"] == "ilp", "frontier_violation"].any():
        out.append("'!': a smaller budget had a cheaper plan: the optimum cannot do that; please report it")
    return "\n".join(out)


def device_notes(schedule: Schedule, profile: Profile | None) -> list[str]:
    """What the device leaves beside the budget: an estimate's target, the usable memory after
    the CUDA context and the allocator's margin, a per-rank plan's FSDP headroom. Said with every
    plan, and when nothing needs checkpointing."""
    from memfit.devices import describe_memory, target_title, usable_bytes
    from memfit.planning.peak import card_ratio, device_cap_bytes, fsdp_headroom

    out = []
    peak = schedule.predicted_peak_bytes
    memory = schedule.memory
    headroom = fsdp_headroom(profile) if profile is not None else 0
    if schedule.target:
        title = target_title(schedule.target, memory)
        title = f"{title} ({schedule.target})" if title else schedule.target
        out.append(f"estimated for {title} from shapes on fake tensors, nothing allocated: memory exact from shapes, "
                   "times a roofline; check it on the GPU with memfit validate")
    if memory:
        out.append(f"device memory: {describe_memory(memory)}")
        usable = usable_bytes(memory)
        cap = device_cap_bytes(profile, schedule.policies) if profile is not None else None
        ratio = card_ratio(profile, schedule.policies) if profile is not None else None
        if ratio is not None and cap is not None and cap < usable - headroom:
            over = profile.memory.get("over_model") if profile is not None and profile.memory else None
            learned = " (with the card's learned over_model)" if over else ""
            out.append(f"the caching allocator's model (estimate mode) has this plan reserve {ratio - 1:.1%} over its "
                       f"allocated peak{learned}, more than the {memory['margin']:.0%} margin: it may allocate at most "
                       f"{format_bytes(cap)}")
        if schedule.asked_budget_bytes:
            out.append(f"note: the budget asked for, {format_bytes(schedule.asked_budget_bytes)}, is more than "
                       f"that: planned for {format_bytes(schedule.budget_bytes)} instead (describe the card's own "
                       "context and margin with --device-spec FILE; memfit validate on it measures them)")
        limit = cap if cap is not None else usable - headroom
        if peak > limit:
            out.append(f"warning: a peak of {format_bytes(peak)} leaves less than the allocator's margin on "
                       f"{memory['title']} and would likely run out of memory there; plan with a budget of at most "
                       f"{format_bytes(limit)}")
    if schedule.parallel:
        p = schedule.parallel
        how = "estimated for" if schedule.target else "measured on"
        out.append(f"per rank, for {describe_layout(p)} ({how} one of them)")
        if headroom:
            short = " (more than this budget leaves)" if peak + headroom > schedule.budget_bytes else ""
            out.append(f"leave {format_bytes(headroom)} of headroom{short}: a rank's peak moves by up to one "
                       "unit's gathered parameters from step to step, as collectives finish")
    return out


def stages_report(plans: StagePlans) -> str:
    """A pipeline's per-stage plan beside the uniform one: each rank's micro-batches in flight,
    units checkpointed, predicted peak and recompute, and the pipeline's step under each."""
    rows = []
    for r, (mine, same) in enumerate(zip(plans.per_stage, plans.uniform, strict=True)):
        ckpt = sum(p != KEEP for p in mine.policies.values())
        rows.append([str(r), str(mine.in_flight), f"{ckpt} of {len(mine.policies)}",
                     format_bytes(mine.prediction.peak_bytes), _ms(mine.prediction.recompute_s),
                     format_bytes(same.prediction.peak_bytes), _ms(same.prediction.recompute_s)])
    head = ["rank", "in flight", "per-stage: checkpointed", "peak", "recompute", "uniform: peak", "recompute"]
    step = plans.plain_s
    return "\n".join([
        f"{plans.schedule}, {plans.microbatches} micro-batches, {format_bytes(plans.budget_bytes)} per GPU",
        table(head, rows),
        f"pipeline step: {_ms(step)} with nothing checkpointed; per-stage plan {_pct(plans.per_stage_s / step - 1)}, "
        f"uniform plan (the first {plans.uniform_k} units of every stage) {_pct(plans.uniform_s / step - 1)}",
    ])
