"""What the ``memfit`` commands do, once parsed: build the model a flag or a schedule names,
profile it, and call the API; cli.py parses and reports errors."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError

_MODEL_FLAGS = ("scenario", "model", "input_shape", "units", "optimizer", "device", "repeat")


def _given(args: argparse.Namespace, names: tuple[str, ...] = _MODEL_FLAGS) -> list[str]:
    """The model flags the user gave, spelled as on the command line."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]


def _scenario(args: argparse.Namespace) -> Any:
    from memfit.scenarios import DEFAULT, Scenario, load_scenario

    if args.scenario and args.model:
        raise MemfitError("give either --scenario or --model, not both")
    if args.model:
        shape = _shape(args.input_shape) if args.input_shape else None
        sc = Scenario(name=args.model, model=args.model, input_shape=shape)
    else:
        sc = load_scenario(args.scenario or DEFAULT)
        if args.input_shape:
            sc.input_shape = _shape(args.input_shape)
    if args.units:
        sc.units = args.units
    if args.optimizer:
        sc.optimizer = args.optimizer
    return sc


def _shape(text: str) -> list[int]:
    try:
        dims = [int(d) for d in text.lower().replace(",", "x").split("x")]
    except ValueError:
        raise MemfitError(f"--input-shape is dimensions joined by x, e.g. 8x3x224x224; got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise MemfitError(f"--input-shape needs positive dimensions, got {text!r}")
    return dims


def _device(text: str | None) -> str:
    """--device, checked; by default CUDA when there is a GPU, else the CPU."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise MemfitError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise MemfitError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MemfitError(f"--device {text}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise MemfitError(f"--device {text}: there are {torch.cuda.device_count()} CUDA devices (0-based)")
    return str(device)


def _build(sc: Any, device: str) -> tuple[Any, Any]:
    print(f"building {sc.name} ({sc.model}) on {device}", file=sys.stderr)
    return sc.build(device)


def _profile(args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    from memfit.profiler import profile

    repeat = 5 if args.repeat is None else args.repeat
    if repeat < 1:
        raise MemfitError("--repeat must be at least 1")
    sc = _scenario(args)
    device = _device(args.device)
    model, inputs = _build(sc, device)
    check_interrupt()
    optimizer = None if sc.optimizer == "none" else sc.optimizer
    with tqdm(total=4 + repeat, desc="profiling", unit="pass", file=sys.stderr, leave=False, disable=None) as bar:
        started = []

        def progress(message: str) -> None:  # called as each pass begins
            check_interrupt()  # an interrupt swallowed during the last pass stops the run here
            if started:
                bar.update(1)
            started.append(message)
            bar.set_postfix_str(message)

        result = profile(model, inputs, units=sc.units, optimizer=optimizer, repeat=repeat, progress=progress)
        bar.update(1)
    result.source = sc.source()
    return result


def cmd_profile(args: argparse.Namespace) -> int:
    from memfit.jsonio import check_writable
    from memfit.report import profile_report

    check_writable(args.output, "profile file")  # before minutes of profiling, not after
    prof = _profile(args)
    write_output(prof.save, args.output)
    if args.json:
        print(json.dumps({"format": "memfit.profile/1", **asdict(prof)}, indent=2))
    else:
        print(profile_report(prof))
        print(f"\nwrote {args.output}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from memfit.budget import format_bytes, parse_bytes
    from memfit.jsonio import check_writable
    from memfit.optimizer.planner import plan
    from memfit.profile import Profile
    from memfit.report import schedule_report

    budget = parse_bytes(args.budget)  # fail on a bad budget before minutes of profiling
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise MemfitError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    if args.max_segment < 2:
        raise MemfitError(f"--max-segment must be at least 2 (units in one checkpointed run), got {args.max_segment}")
    output = "schedule.json" if args.output is None else args.output
    if args.profile:
        if given := _given(args):
            raise MemfitError(
                f"{', '.join(given)} cannot change a profile that was already measured: drop "
                f"{'it' if len(given) == 1 else 'them'}, or profile again with those flags instead of --profile"
            )
        if Path(args.profile).resolve() == Path(output).resolve():
            raise MemfitError(f"-o {output} would overwrite the profile it plans from; write the schedule elsewhere")
    check_writable(output, "schedule file")
    prof = Profile.load(args.profile) if args.profile else _profile(args)
    schedule = plan(prof, budget, strategy=args.strategy, solver=args.solver, time_limit=args.time_limit,
                    segments=not args.no_segments, max_segment=args.max_segment)
    check_interrupt()
    idle = not schedule.checkpointed
    write = args.output is not None or not idle
    if write:
        write_output(schedule.save, output)
    if args.json:
        print(json.dumps({"format": "memfit.schedule/1", **asdict(schedule)}, indent=2))
        return 0
    if idle and args.strategy in ("ilp", "none"):
        print(f"fits without checkpointing: the step peaks at {format_bytes(schedule.predicted_peak_bytes)} "
              f"of the {format_bytes(budget)} budget ({format_bytes(budget - schedule.predicted_peak_bytes)} "
              "to spare), so memfit has nothing to recompute.")
        print("memfit.apply is not needed at this budget; to use the spare memory, raise the batch size or "
              "sequence length and plan again.")
        print(f"\nwrote {output} (it checkpoints nothing)" if write else
              "\nno schedule written (give -o FILE to write the do-nothing schedule anyway)")
        return 0
    print(schedule_report(schedule, prof))
    print(f"\nwrote {output}; in train.py:\n"
          f'    model = memfit.apply(model, memfit.load_schedule("{output}"))')
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from memfit.report import validation_report
    from memfit.runtime.validate import validate
    from memfit.schedule import load_schedule

    if args.steps < 1:
        raise MemfitError("--steps must be at least 1 (timed rounds of the plain and the scheduled step)")
    schedule = load_schedule(args.schedule)
    sc, device = _validation_setup(args, schedule)
    model, inputs = _build(sc, device)
    check_interrupt()
    optimizer = None if sc.optimizer == "none" else sc.optimizer
    print("measuring the plain and the scheduled step", file=sys.stderr)
    result = validate(model, inputs, schedule, optimizer=optimizer, steps=args.steps)
    check_interrupt()
    if args.json:
        print(json.dumps({**asdict(result), "error": result.error, "fits": result.fits, "ok": result.ok}, indent=2))
    else:
        print(validation_report(result))
    return 0 if result.ok else 1


def _validation_setup(args: argparse.Namespace, schedule: Any) -> tuple[Any, str]:
    """The model, optimizer and device the schedule was made for; flags that say otherwise are
    refused with the one that differs, since measuring another setup would prove nothing."""
    from memfit.scenarios import cli_flag, scenario_from_source

    source = schedule.source
    planned_opt = schedule.optimizer or "none"
    if args.optimizer and args.optimizer != planned_opt:
        raise MemfitError(f"the schedule was planned with --optimizer {planned_opt}, not {args.optimizer}: its "
                          "peak counts that optimizer's state; drop --optimizer, or plan again with yours")
    if args.device and _device(args.device) != schedule.device:
        raise MemfitError(f"the schedule was profiled on {schedule.device}, not {args.device}: memory differs "
                          f"between devices; validate with --device {schedule.device}, or plan again on {args.device}")
    if not source:  # a schedule from memfit.plan() in Python, or from an older memfit
        sc = _scenario(args)
    elif not _given(args, ("scenario", "model", "input_shape", "units")):
        sc = scenario_from_source(source)
    else:
        sc = _scenario(args)
        mine = sc.source()
        for key, flag in (("scenario", "--scenario"), ("model", "--model"), ("input_shape", "--input-shape"),
                          ("units", "--units"), ("dtype", "dtype")):
            if source.get(key) != mine.get(key):
                raise MemfitError(
                    f"the schedule was made for {cli_flag(source)} (units {source.get('units')}), but {flag} says "
                    f"otherwise ({mine.get(key)!r} instead of {source.get(key)!r}); drop the model flags to "
                    "validate what the schedule was made for"
                )
    sc.optimizer = planned_opt
    return sc, _device(args.device or schedule.device)


def cmd_show(args: argparse.Namespace) -> int:
    from memfit.errors import FileFormatError
    from memfit.jsonio import read_json
    from memfit.profile import PROFILE_FORMAT, Profile
    from memfit.report import profile_report, schedule_report
    from memfit.schedule import SCHEDULE_FORMAT, load_schedule

    fmt = read_json(args.file, None)["format"]
    if fmt == SCHEDULE_FORMAT:
        print(schedule_report(load_schedule(args.file)))
    elif fmt == PROFILE_FORMAT:
        print(profile_report(Profile.load(args.file)))
    else:
        raise FileFormatError(f"{args.file}: field 'format' is {fmt!r}; expected {SCHEDULE_FORMAT} or {PROFILE_FORMAT}")
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    from memfit.report import table
    from memfit.scenarios import BUILTIN_DIR, DEFAULT, builtin_names, load_scenario

    names = builtin_names()
    if not names:
        raise MemfitError(f"no built-in scenarios in {BUILTIN_DIR}: this memfit installation is incomplete; "
                          "reinstall it")
    rows = []
    for name in names:
        sc = load_scenario(name)
        rows.append([name + (" (default)" if name == DEFAULT else ""), sc.model, sc.description])
    print(table(["scenario", "factory", "description"], rows, [False, False, False]))
    return 0
