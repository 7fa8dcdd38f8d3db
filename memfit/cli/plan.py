"""``memfit profile`` and ``memfit plan``: build the model a flag or a profile names, profile or
estimate it, solve, and print the schedule beside the baselines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memfit.cli import modelflags
from memfit.cli.flags import Command, granularity_flags, profile_file_flags, save_profile_flag, source_flags, title
from memfit.cli.stages import add_flags as stages_flags
from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError, PlanOptionError
from memfit.planning.options import PlanOptions


def cmd_profile(args: argparse.Namespace) -> int:
    from memfit.formats.profile import PROFILE_FORMAT, PROFILES_FORMAT, save_profiles
    from memfit.jsonio import check_replaceable
    from memfit.report import profile_report

    check_replaceable(args.output, "profile file")  # before minutes of profiling, not after
    profs = modelflags.profiles_of(args)
    write_output(lambda path: save_profiles(profs, path), args.output)
    if args.json:
        print(json.dumps({"format": PROFILE_FORMAT, **profs[0].to_dict()} if len(profs) == 1 else
                         {"format": PROFILES_FORMAT, "profiles": [p.to_dict() for p in profs]}, indent=2))
    else:
        print("\n\n".join(profile_report(p) for p in profs))
        print(f"\nwrote {args.output}" + (f" ({len(profs)} input shapes: memfit plan --profile {args.output} plans "
                                          "them all)" if len(profs) > 1 else ""))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from memfit.budget import format_bytes, parse_bytes, parse_share
    from memfit.cli.stages import pipeline_asked, plan_pipeline
    from memfit.planning.planner import plan
    from memfit.plots import check_plot_path, timeline
    from memfit.report import schedule_report, shapes_report

    if pipeline_asked(args):
        return plan_pipeline(args, args.budget)
    share = parse_share(args.budget)  # "60%": of the unplanned peak, known once profiled
    budget = parse_bytes(args.budget) if share is None else 0  # fail on a bad budget before minutes of profiling
    settings = _plan_options(args)
    if (args.no_segments or args.compile) and args.strategy == "sqrt":
        raise MemfitError(f"{'--compile' if args.compile else '--no-segments'} rules out --strategy sqrt, which "
                          "checkpoints segments of units")
    if args.compile:
        from memfit.steps.compiled_budget import check_backend

        check_backend(args.compile)
        if args.fallbacks:
            raise MemfitError("--fallbacks is planned for the eager step only; drop it with --compile")
    elif args.no_compiler_budget:
        raise MemfitError("--no-compiler-budget is a choice of compiled planning: give --compile BACKEND too")
    output = "schedule.json" if args.output is None else args.output
    check_outputs(args, {"-o": (output, "schedule file"), **modelflags.profile_output(args)})
    if args.timeline:
        check_plot_path(args.timeline)
    several = len(modelflags.input_shapes(args)) > 1 or args.seq_lens
    if args.seq_hist and not Path(args.seq_hist).is_file():
        raise MemfitError(f"--seq-hist {args.seq_hist}: no such file (a CSV of length,count rows)")
    profs = modelflags.plan_profiles(args)
    if args.compile and (several or len(profs) > 1):
        raise MemfitError("--compile plans one input shape (each shape compiles to a graph of its own, measured "
                          "apart): plan each shape with --compile on its own")
    shares = modelflags.shares_of(args, profs)
    prof = profs[-1]
    if share is not None:
        from memfit.planning.peak import predict

        budget = max(1, round(share * max(predict(p, {}).peak_bytes for p in profs)))
        print(f"budget {args.budget.strip()} of the unplanned peak: {format_bytes(budget)}")
    if args.compile:
        schedule = _plan_compiled(args, prof, budget, settings)
    else:
        schedule = plan(profs if len(profs) > 1 else prof, budget, settings, shares=shares)
        prof = next(p for p in profs if p.input_shapes == schedule.input_shapes)  # the largest shape's
    check_interrupt()
    # the compiler's own plan checkpoints no unit of memfit's and is a plan: its budget
    idle = not any(p.checkpointed for p in schedule.plans) and "memory_budget" not in (schedule.compile or {})
    write = args.output is not None or not idle
    if write:
        replaced = _schedule_for_another_model(output, schedule)
        write_output(schedule.save, output)
        if replaced:
            print(f"memfit: note: {output} was a schedule for {replaced}; replaced by this one for "
                  f"{schedule.fingerprint.get('model_class', 'this model')}", file=sys.stderr)
    if args.timeline:
        write_output(lambda path: timeline(schedule.levels, path, title=title(prof, f"{schedule.strategy} plan"),
                                           budget=schedule.budget_bytes, checkpointed=schedule.checkpointed),
                     args.timeline)
        print(f"wrote {args.timeline}", file=sys.stderr)  # stdout may be --json
    if args.json:
        print(json.dumps({"format": "memfit.schedule/1", **schedule.to_dict()}, indent=2))
        return 0
    if idle and args.strategy in ("ilp", "none"):
        _say_nothing_to_do(args, profs, schedule, schedule.budget_bytes, output, write)
        return 0
    print(shapes_report(schedule, profs) if schedule.shapes else schedule_report(schedule, prof))
    print(f"\nwrote {output}; in train.py:\n"
          + (f'    schedule = memfit.load_schedule("{output}")\n    model = memfit.apply(model, schedule)\n'
             "    model = torch.compile(model, backend=memfit.compile_backend(schedule))" if schedule.compile else
             f'    model = memfit.apply(model, memfit.load_schedule("{output}"))'))
    return 0


def _say_nothing_to_do(args: argparse.Namespace, profs: list[Any], schedule: Any, budget: int, output: str,
                       write: bool) -> None:
    """The budget fits the plain step (of every shape planned): say so, where checkpointing would
    matter."""
    from memfit.budget import format_bytes
    from memfit.formats.layout import describe_layout
    from memfit.planning.planner import min_budget_bytes
    from memfit.report import device_notes

    prof = next(p for p in profs if p.input_shapes == schedule.input_shapes)  # the largest shape's

    per_rank = f" on each rank ({describe_layout(schedule.parallel)})" if schedule.parallel else ""
    print(f"fits without checkpointing: the step peaks at {format_bytes(schedule.predicted_peak_bytes)}{per_rank} "
          f"of the {format_bytes(budget)} budget ({format_bytes(budget - schedule.predicted_peak_bytes)} "
          "to spare), so memfit has nothing to recompute.")
    for note in device_notes(schedule, prof):
        print(note)
    least = min_budget_bytes(prof, segments=not args.no_segments, max_segment=args.max_segment,
                             fine=args.granularity == "fine")
    print(f"checkpointing matters between {format_bytes(least)} (the smallest budget it reaches) and "
          f"{format_bytes(schedule.predicted_peak_bytes)}; memfit.apply is not needed at this budget: to use "
          "the spare memory, raise the batch size or sequence length and plan again.")
    print(f"\nwrote {output} (it checkpoints nothing)" if write else
          "\nno schedule written (give -o FILE to write the do-nothing schedule anyway)")
    if not args.profile and not args.save_profile:
        print("to plan at another budget without profiling again, add --save-profile FILE, then: memfit plan "
              "--profile FILE --budget SIZE")


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """The planning flags as one record, checked before any profiling."""
    return flag_options(strategy=args.strategy, solver=args.solver, segments=not args.no_segments,
                         max_segment=args.max_segment, granularity=args.granularity, time_limit=args.time_limit,
                         fallbacks=args.fallbacks)


def flag_options(**settings: Any) -> PlanOptions:
    """A PlanOptions from flags; a mistake names the flag (--max-segment, not max_segment)."""
    try:
        return PlanOptions(**settings)
    except PlanOptionError as e:
        raise e.spelled(lambda name: "--" + name.replace("_", "-")) from None


def _plan_compiled(args: argparse.Namespace, prof: Any, budget: int, options: PlanOptions) -> Any:
    """The plan whose step, compiled with ``args.compile``, is measured to fit (plan_compiled)."""
    from memfit.scenarios import scenario_from_source
    from memfit.steps.compiled import plan_compiled

    if not prof.source:
        raise MemfitError("--compile measures the compiled step, but this profile does not record its model (it was "
                          "made in Python): give --scenario or --model instead of --profile")
    sc = scenario_from_source(prof.source, trusted=not args.profile or args.trust_source)
    model, inputs = modelflags.build_model(sc, prof.device)

    def progress(message: str) -> None:
        check_interrupt()
        print(message, file=sys.stderr)

    return plan_compiled(model, inputs, prof, budget, args.compile, options, step=prof.train_step,
                         progress=progress, compiler_budget=not args.no_compiler_budget)


def _schedule_for_another_model(path: str, schedule: Any) -> str | None:
    """The model class of the schedule already at ``path``, where it is another model's."""
    from memfit.formats.schedule import load_schedule

    if not Path(path).is_file():
        return None
    try:
        old = load_schedule(path)
    except MemfitError:
        return None
    mine, theirs = schedule.fingerprint, old.fingerprint
    if mine.get("params_sha256") == theirs.get("params_sha256") and mine.get("model_class") == theirs.get(
            "model_class"):
        return None
    return str(theirs.get("model_class", "another model"))


def check_outputs(args: argparse.Namespace, outputs: dict[str, tuple[str, str]]) -> None:
    """Before any profiling: flags that cannot change a given profile, outputs that would
    overwrite it or any file that is not memfit's (a CSV may replace a CSV), outputs that cannot
    be written."""
    from memfit.jsonio import check_replaceable, check_writable

    if args.profile:
        if given := modelflags.given(args):
            raise MemfitError(
                f"{', '.join(given)} cannot change a profile that was already measured: drop "
                f"{'it' if len(given) == 1 else 'them'}, or profile again with those flags instead of --profile"
            )
        for flag, (path, _) in outputs.items():
            if Path(args.profile).resolve() == Path(path).resolve():
                raise MemfitError(f"{flag} {path} would overwrite the profile it plans from; write elsewhere")
    seen: dict[Path, str] = {}
    for flag, (path, _) in outputs.items():
        if (other := seen.setdefault(Path(path).resolve(), flag)) != flag:
            raise MemfitError(f"{other} and {flag} both name {path}: one would overwrite the other; give two files")
    for path, what in outputs.values():
        if str(path).lower().endswith(".csv"):
            check_writable(path, what)
        else:
            check_replaceable(path, what)


def add_parsers(command: Command) -> None:
    """The profile and plan subcommands and their flags."""
    from memfit.planning import SOLVERS, STRATEGY_NAMES

    prof = command("profile", "measure a model's training step per unit and write profile JSON")
    source_flags(prof)
    granularity_flags(prof, "also measure each unit's finer options (children, chains, op sets, derive)")
    prof.add_argument("-o", "--output", default="profile.json", help="profile file to write (default: %(default)s)")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    prof.set_defaults(func=cmd_profile)

    plan = command("plan", "profile (or read a profile) and solve for the cheapest schedule within a budget")
    plan.add_argument("--budget", required=True, help="memory budget for the whole step, e.g. 24GB, 1536MB, or a "
                      "share of the unplanned peak, e.g. 60%%")
    profile_file_flags(plan)
    source_flags(plan)
    plan.add_argument("--strategy", choices=STRATEGY_NAMES,
                      default="ilp", help="ilp (the optimum) or a baseline to use instead (default: %(default)s)")
    plan.add_argument("--solver", choices=SOLVERS, default="cpsat",
                      help="ILP backend: OR-Tools CP-SAT, PuLP/CBC, or the exact DP for chains (default: %(default)s)")
    plan.add_argument("--max-segment", type=int, default=8,
                      help="longest run of units checkpointed as one region, on chains (default: %(default)s)")
    plan.add_argument("--no-segments", action="store_true", help="checkpoint single units only")
    granularity_flags(plan, "also choose finer options inside units: a child module (attention, MLP), an op set "
                      "(selective checkpointing) or derive (cheap saved outputs re-derived in the backward), each "
                      "measured (needs a fine profile; profiles the model so when none is given)")
    plan.add_argument("--time-limit", type=float, metavar="SECONDS",
                      help="seconds the solver may take; then its best answer so far, or the best baseline if it "
                      "has none (default: no limit at granularity module; 60 at fine, whose solves also stop once "
                      "within 0.1%% of the optimum)")
    plan.add_argument("-o", "--output", help="schedule file to write (default: schedule.json; when nothing needs "
                      "checkpointing, only if given)")
    plan.add_argument("--seq-hist", metavar="FILE",
                      help="a CSV of length,count rows (your data's sequence lengths) to weigh each planned length's "
                      "slowdown by how often batches need it: the expected slowdown of a run")
    plan.add_argument("--fallbacks", type=int, default=0, metavar="K",
                      help="also store K tighter plans, for memfit.tighten(model) after an out-of-memory error")
    plan.add_argument("--compile", metavar="BACKEND",
                      help="plan for the step under torch.compile with this backend (inductor, aot_eager): each "
                      "option is compiled once for its figures, then each candidate plan is compiled and its peak "
                      "measured until one fits, and up to three other plans that fit are timed against it, "
                      "compiled, with the compiler's own plan (its activation memory budget, 0 to 1, the largest "
                      "that fits by bisection, with the plain gradients): the fastest is kept; compile with "
                      "memfit.compile_backend(schedule)")
    plan.add_argument("--no-compiler-budget", action="store_true",
                      help="with --compile: leave out the compiler's own plan, for a compile call that takes a "
                      "backend by name only (the Trainer's torch_compile_backend)")
    plan.add_argument("--timeline", metavar="FILE", help="draw the plan's predicted memory over the step (.png/.svg)")
    save_profile_flag(plan)
    plan.add_argument("--json", action="store_true", help="print the schedule as JSON instead of tables")
    stages_flags(plan)
    plan.set_defaults(func=cmd_plan)
