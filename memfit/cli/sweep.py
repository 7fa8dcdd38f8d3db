"""``memfit sweep``: every strategy at many budgets, the memory-vs-slowdown curve as a table, CSV
and plot, and with --measure each distinct plan run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from memfit.cli import modelflags
from memfit.cli.flags import Command, granularity_flags, profile_file_flags, save_profile_flag, source_flags, title
from memfit.cli.plan import check_outputs, flag_options
from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError
from memfit.planning.options import check_strategies
from memfit.policy import as_policies


def cmd_sweep(args: argparse.Namespace) -> int:
    from memfit.budget import budget_range, parse_bytes
    from memfit.plots import check_plot_path, curve

    budgets = budget_range(args.budgets) if args.budgets else None
    if budgets is not None and args.points is not None:
        raise MemfitError("give either --budgets or --points, not both")
    strategies = check_strategies([s.strip() for s in args.strategies.split(",") if s.strip()], "--strategies")
    settings = flag_options(solver=args.solver, segments=not args.no_segments, max_segment=args.max_segment,
                            granularity=args.granularity)
    if args.steps < 1:
        raise MemfitError("--steps must be at least 1")
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    outputs = {"--csv": (args.csv, "CSV file")} if args.csv else {}
    check_outputs(args, {**outputs, **modelflags.profile_output(args)})
    if args.plot:
        check_plot_path(args.plot)
    from memfit.jsonio import write_atomic
    from memfit.planning.sweep import sweep
    from memfit.plots import shape_curves
    from memfit.report import shape_name, sweep_report

    profs = modelflags.plan_profiles(args)
    if budgets is None and len(profs) > 1:  # one range for every shape: rows side by side, curves on one axis
        from memfit.planning.sweep import default_budgets

        ends = [default_budgets(p, 2, settings) for p in profs]
        lo, hi, points = min(e[0] for e in ends), max(e[-1] for e in ends), args.points or 30
        budgets = sorted({lo + (hi - lo) * k // (points - 1) for k in range(points)})
    frames = {}
    for prof in profs:
        if args.measure and not prof.source:
            raise MemfitError("--measure needs the model: this profile does not say how it was built; profile it "
                              "with memfit profile (or give --scenario/--model instead of --profile)")
        frame = sweep(prof, budgets, settings, points=args.points or 30, strategies=strategies)
        check_interrupt()
        if args.measure:
            _measure_rows(args, prof, frame)
        frames[shape_name(prof)] = frame
    if len(frames) > 1:  # one table: each row says its shape
        import pandas as pd

        frame = pd.concat([f.assign(shape=name) for name, f in frames.items()], ignore_index=True)
        frame.insert(0, "shape", frame.pop("shape").astype("string"))
    if device_memory is None and prof.memory:  # the line on the plot: what the card leaves to a step
        from memfit.devices import usable_bytes

        device_memory = usable_bytes(prof.memory)
    if args.csv:
        write_output(lambda path: write_atomic(path, lambda tmp: frame.to_csv(tmp, index=False)), args.csv)
    if args.plot:
        heading = title(prof, "memory vs slowdown")
        if len(frames) > 1:
            heading = heading.replace(f"inputs {prof.input_shapes}", ", ".join(frames))
        write_output(lambda path: curve(frame, path, title=heading, device_memory=device_memory) if len(frames) == 1
                     else shape_curves(frames, path, title=heading, device_memory=device_memory), args.plot)
    if args.json:
        print(frame.to_json(orient="records", indent=2))
    else:
        print("\n\n".join((f"== {name} ==\n" if len(frames) > 1 else "") + sweep_report(f)
                          for name, f in frames.items()))
        if prof.memory:
            from memfit.devices import describe_memory

            print(f"device memory: {describe_memory(prof.memory)}")
        for flag, path in (("csv", args.csv), ("plot", args.plot)):
            if path:
                print(f"wrote {path} ({flag})")
    return 1 if bool(frame["frontier_violation"].any()) else 0


def _measure_rows(args: argparse.Namespace, prof: Any, frame: Any) -> None:
    """``sweep --measure``: each distinct plan's measured peak and slowdown, as two more columns."""
    from tqdm import tqdm

    from memfit.scenarios import scenario_from_source
    from memfit.steps.validate import measure_plans

    plans = [p for p in dict.fromkeys(frame["policies"].dropna()) if p]
    sc = scenario_from_source(prof.source, trusted=not args.profile or args.trust_source)
    model, inputs = modelflags.build_model(sc, prof.device)
    with tqdm(total=len(plans), desc="measuring plans", unit="plan", file=sys.stderr, leave=False,
              disable=None) as bar:
        read = [as_policies(json.loads(p)) for p in plans]  # the table's text, back into policies
        peaks, overheads, sure = measure_plans(model, inputs, read, step=prof.train_step, steps=args.steps,
                                               progress=lambda: (check_interrupt(), bar.update(1)))
    frame["measured_peak_bytes"] = frame["policies"].map(dict(zip(plans, peaks, strict=True))).astype("Int64")
    frame["measured_overhead"] = frame["policies"].map(dict(zip(plans, overheads, strict=True))).astype(float)
    frame["measured_uncertainty"] = frame["policies"].map(dict(zip(plans, sure, strict=True))).astype(float)


def add_parsers(command: Command) -> None:
    """The sweep subcommand and its flags."""
    from memfit.planning import SOLVERS
    from memfit.planning.sweep import DEFAULT_STRATEGIES

    sw = command("sweep", "plan every strategy at many budgets: the memory-vs-slowdown curve, as a table, CSV "
                 "and plot")
    profile_file_flags(sw)
    source_flags(sw)
    sw.add_argument("--budgets", help="START:STOP:STEP such as 100MB:500MB:20MB, or a list such as 200MB,300MB "
                    "(default: --points budgets from the smallest feasible peak to the un-checkpointed one)")
    sw.add_argument("--points", type=int, help="how many budgets when --budgets is not given (default: 30)")
    sw.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help="comma-separated: ilp and baselines (default: %(default)s)")
    sw.add_argument("--solver", choices=SOLVERS, default="cpsat",
                    help="ILP backend for units that are not a chain; chains use the exact frontier DP")
    sw.add_argument("--max-segment", type=int, default=8, help="longest checkpointed run of units (default: 8)")
    save_profile_flag(sw)
    sw.add_argument("--no-segments", action="store_true", help="checkpoint single units only")
    granularity_flags(sw, "let the ILP choose checkpoints inside units too (as plan --granularity fine)")
    sw.add_argument("--measure", action="store_true",
                    help="run every distinct plan: measured peak and slowdown beside the predicted ones")
    sw.add_argument("--steps", type=int, default=3, help="timed rounds with --measure (default: %(default)s)")
    sw.add_argument("--csv", metavar="FILE", help="write the table as CSV")
    sw.add_argument("--plot", metavar="FILE", help="draw the curve (.png or .svg)")
    sw.add_argument("--device-memory", metavar="SIZE",
                    help="draw the memory a step may use as a line, e.g. 22GB (default: the GPU's usable memory, "
                    "profiled or estimated for one)")
    sw.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    sw.set_defaults(func=cmd_sweep)
