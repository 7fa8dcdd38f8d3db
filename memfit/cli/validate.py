"""``memfit validate``: rebuild the model a schedule was made for, run the plain and the
scheduled step, and compare; a schedule for several input shapes is validated shape by shape."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.cli import modelflags
from memfit.cli.flags import Command, source_flags, title, trust_source_flag
from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError
from memfit.formats.layout import describe_layout


def cmd_validate(args: argparse.Namespace) -> int:
    from memfit.formats.schedule import load_schedule
    from memfit.plots import check_plot_path

    if args.steps < 1:
        raise MemfitError("--steps must be at least 1 (timed rounds of the plain and the scheduled step)")
    if not (math.isfinite(args.time_tolerance) and args.time_tolerance >= 0):
        raise MemfitError(f"--time-tolerance is percentage points, 0 or more (5: five points); got "
                          f"{args.time_tolerance}")
    schedule = load_schedule(args.schedule)
    if schedule.pipeline:
        if args.compile or args.timeline or args.save_device_spec or args.input_shape:
            raise MemfitError("a pipeline's ranks are validated as planned: drop --compile, --timeline, "
                              "--save-device-spec and --input-shape")
        from memfit.cli.stages import validate_pipeline

        return validate_pipeline(args.schedule)
    if args.compile:
        from memfit.steps.compiled_budget import check_backend

        check_backend(args.compile)
    if schedule.shapes and (args.timeline or args.save_device_spec or args.input_shape):
        flag = "--timeline" if args.timeline else "--save-device-spec" if args.save_device_spec else "--input-shape"
        raise MemfitError(f"{flag} is for a schedule of one input shape; this one plans {len(schedule.shapes)} and is "
                          "validated at each of them")
    if schedule.parallel and (args.timeline or args.save_device_spec or args.compile):
        flag = "--timeline" if args.timeline else "--save-device-spec" if args.save_device_spec else "--compile"
        raise MemfitError(f"{flag} is for one process; this schedule is per rank "
                          f"({describe_layout(schedule.parallel)})")
    if args.timeline:
        if args.compile or schedule.compile:
            raise MemfitError("--timeline draws the eager step's marks, which a compiled step does not have")
        check_plot_path(args.timeline)
        if not schedule.levels:
            raise MemfitError("this schedule holds no predicted timeline (made by an older memfit): plan it again "
                              "to draw --timeline")
    setups = [modelflags.validation_setup(args, plan) for plan in schedule.plans]  # every refusal before running
    if args.save_device_spec:
        if not setups[0][1].startswith("cuda"):
            raise MemfitError(f"--save-device-spec writes what a GPU run measures; this schedule runs on "
                              f"{setups[0][1]}")
        from memfit.jsonio import check_writable

        check_writable(args.save_device_spec)
    from memfit.report import shape_name, shapes_validation_report, validation_report

    results = []
    for k, (plan, (sc, device)) in enumerate(zip(schedule.plans, setups, strict=True)):
        if schedule.shapes:
            print(f"shape {k + 1} of {len(setups)}: {shape_name(plan)}", file=sys.stderr)
        results.append(_validate(args, plan, sc, device))
    if args.json:
        found = [{**asdict(r), "error": r.error, "fits": r.fits, "ok": r.ok, "context_bytes": r.context_bytes,
                  "margin": r.margin, "reserved_fits": r.reserved_fits, "time_judged": r.time_judged,
                  "time_ok": r.time_ok} for r in results]
        print(json.dumps(found[0] if not schedule.shapes else
                         [{"input_shapes": p.input_shapes, **f} for p, f in zip(schedule.plans, found, strict=True)],
                         indent=2))
    elif schedule.shapes:
        print(shapes_validation_report(schedule, results))
    else:
        print(validation_report(results[0]))
    return 0 if all(r.ok for r in results) else 1


def _validate(args: argparse.Namespace, schedule: Any, sc: Any, device: str) -> Any:
    """One shape's validation, with the timeline and device spec its flags ask for."""
    from memfit.plots import timeline
    from memfit.steps.validate import measure_levels, validate

    if schedule.parallel:
        from memfit.steps.parallel import validate_ranks

        layout = schedule.parallel
        print(f"measuring the plain and the scheduled step on {describe_layout(layout)}", file=sys.stderr)
        return validate_ranks(sc, schedule, device=device)
    model, inputs = modelflags.build_model(sc, device)
    check_interrupt()
    step = sc.train_step
    print("measuring the plain and the scheduled step", file=sys.stderr)
    result = validate(model, inputs, schedule, step=step, steps=args.steps, compile=args.compile,
                      time_tolerance=args.time_tolerance / 100)
    check_interrupt()
    if args.timeline:
        measured = measure_levels(model, inputs, schedule, step=step)
        levels = {**schedule.levels, "measured": measured}
        if len(measured) != len(schedule.levels["plan"]):
            raise MemfitError("the measured step has other marks than the planned one; cannot draw them side by side")
        write_output(lambda path: timeline(levels, path, title=title(schedule, "predicted and measured"),
                                           budget=schedule.budget_bytes, checkpointed=schedule.checkpointed),
                     args.timeline)
        print(f"wrote {args.timeline}", file=sys.stderr)
    if args.save_device_spec and result.cuda is not None:
        _save_device_spec(args.save_device_spec, args.schedule, result)
    return result


def _save_device_spec(path: str, schedule_path: str, result: Any) -> None:
    """The card's measured context and margin as a device spec (devices.load_device_spec reads it),
    and for a plan made in estimate mode how far the card reserved over the allocator's model."""
    import torch

    from memfit.devices import by_title, spec_toml
    from memfit.jsonio import write_atomic

    card = torch.cuda.get_device_name()
    known = by_title(card)
    over = result.over_model
    text = spec_toml(name=Path(path).stem, title=card, base=known.name if known else None,
                     total=result.cuda["total_bytes"], context=result.context_bytes, margin=max(0.0, result.margin),
                     source=f"memfit validate --schedule {schedule_path} on this card, torch {torch.__version__}",
                     over_model=None if over is None else min(max(0.0, over), 0.99))
    write_output(lambda p: write_atomic(p, lambda tmp: Path(tmp).write_text(text, encoding="utf-8")), path)
    print(f"wrote {path}: plan against this card's context and margin with --device-spec {path}", file=sys.stderr)


def add_parsers(command: Command) -> None:
    """The validate subcommand and its flags."""
    val = command("validate", "run the plain and the scheduled model: measured vs predicted peak and slowdown, "
                  "equal gradients; exits 1 if the peak exceeds the budget, results differ or the measured slowdown "
                  "is off the predicted by more than --time-tolerance")
    val.add_argument("--schedule", required=True, help="a schedule JSON from `memfit plan`")
    trust_source_flag(val, "--schedule")
    source_flags(val, validate=True)
    val.add_argument("--steps", type=int, default=5,
                     help="timed rounds, one plain and one scheduled step counted in each; 3 or more judge the "
                     "slowdown (default: %(default)s)")
    val.add_argument("--time-tolerance", type=float, default=5.0, metavar="POINTS",
                     help="how many percentage points of the plain step the measured slowdown may differ from the "
                     "predicted, on top of the measurement's own uncertainty (default: %(default)s)")
    val.add_argument("--compile", metavar="BACKEND",
                     help="run both models under torch.compile with this backend (default: the one the schedule "
                     "was planned for with plan --compile, else none)")
    val.add_argument("--timeline", metavar="FILE",
                     help="draw predicted and measured memory over the step (.png or .svg)")
    val.add_argument("--save-device-spec", metavar="FILE",
                     help="on a GPU: write the card's measured CUDA context and allocator margin as a device spec "
                     "(.toml) for plan --device-spec FILE")
    val.add_argument("--json", action="store_true", help="print the result as JSON")
    val.set_defaults(func=cmd_validate)
