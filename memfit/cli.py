"""The ``memfit`` command: profile, plan, validate, show, scenarios. Parses, calls the API, prints."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.errors import MemfitError

EPILOG = """\
examples:
  memfit plan --budget 200MB                      # the built-in GPT scenario: profile, plan, write schedule.json
  memfit plan --budget 24GB --scenario hf-llama    # another built-in scenario (memfit scenarios lists them)
  memfit plan --budget 8GiB --model mypkg.models:build --input-shape 8x3x224x224
  memfit plan --budget 200MB --strategy every-k     # a baseline instead of the optimum
  memfit profile -o profile.json && memfit plan --profile profile.json --budget 300MB
  memfit validate --schedule schedule.json         # measure the plan: peak, slowdown, gradients
  memfit show schedule.json

memory sizes are binary: 24GB = 24GiB = 24G = 24 x 2^30 bytes; 1536MB; 0.5TB; a bare number is bytes.
in train.py:  model = memfit.apply(model, memfit.load_schedule("schedule.json"))
"""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from memfit.runtime.memory import keep_freed_cpu_memory

    keep_freed_cpu_memory()  # steadier, additive CPU step times (see its docstring)
    try:
        return int(args.func(args) or 0)
    except MemfitError as exc:
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memfit",
        description="Plan activation checkpointing so that a PyTorch training step fits a memory budget "
        "at the least extra time.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from memfit import __version__
    from memfit.optimizer.ilp import SOLVERS
    from memfit.optimizer.planner import STRATEGY_NAMES

    p.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    prof = command("profile", "measure a model's training step per unit and write profile JSON")
    _source_args(prof)
    prof.add_argument("-o", "--output", default="profile.json", help="profile file to write (default: %(default)s)")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    prof.set_defaults(func=cmd_profile)

    plan = command("plan", "profile (or read a profile) and solve for the cheapest schedule within a budget")
    plan.add_argument("--budget", required=True, help="memory budget for the whole step, e.g. 24GB, 1536MB")
    plan.add_argument("--profile", help="a profile JSON from `memfit profile` (skips profiling)")
    _source_args(plan)
    plan.add_argument("--strategy", choices=STRATEGY_NAMES,
                      default="ilp", help="ilp (the optimum) or a baseline to use instead (default: %(default)s)")
    plan.add_argument("--solver", choices=SOLVERS, default="cpsat",
                      help="ILP backend: OR-Tools CP-SAT, PuLP/CBC, or the exact chain DP (default: %(default)s)")
    plan.add_argument("--max-segment", type=int, default=8,
                      help="longest run of units checkpointed as one region, on chains (default: %(default)s)")
    plan.add_argument("--no-segments", action="store_true", help="checkpoint single units only")
    plan.add_argument("--time-limit", type=float, help="seconds the solver may take (default: no limit)")
    plan.add_argument("-o", "--output", default="schedule.json", help="schedule file to write (default: %(default)s)")
    plan.add_argument("--json", action="store_true", help="print the schedule as JSON instead of tables")
    plan.set_defaults(func=cmd_plan)

    val = command("validate", "run the plain and the scheduled model: measured vs predicted peak and slowdown, "
                  "equal gradients; exits 1 if the peak exceeds the budget or results differ")
    val.add_argument("--schedule", required=True, help="a schedule JSON from `memfit plan`")
    _source_args(val)
    val.add_argument("--steps", type=int, default=5,
                     help="timed rounds, one plain and one scheduled step counted in each (default: %(default)s)")
    val.add_argument("--json", action="store_true", help="print the result as JSON")
    val.set_defaults(func=cmd_validate)

    show = command("show", "print a schedule or profile JSON as tables")
    show.add_argument("file", help="schedule.json or profile.json")
    show.set_defaults(func=cmd_show)

    scen = command("scenarios", "list the built-in scenarios")
    scen.set_defaults(func=cmd_scenarios)
    return p


def _source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (default: the built-in gpt-small scenario)")
    g.add_argument("--scenario", help="a built-in scenario name or a scenario .toml file")
    g.add_argument("--model", help="your own model: module:factory returning a model or (model, inputs)")
    g.add_argument("--input-shape", help="random input shape when the factory returns only a model, e.g. 8x3x224x224")
    g.add_argument("--units", nargs="+", help="unit module names or globs (default: the repeated blocks)")
    g.add_argument("--optimizer", choices=["adamw", "adam", "sgd", "sgd-momentum", "none"],
                   help="optimizer whose state and step count (default: the scenario's, else adamw)")
    g.add_argument("--repeat", type=int, default=5,
                   help="timed rounds of plain and all-checkpointed steps when profiling (default: %(default)s)")


def _scenario(args: argparse.Namespace) -> Any:
    from memfit.scenarios import DEFAULT, Scenario, load_scenario

    if args.scenario and args.model:
        raise MemfitError("give either --scenario or --model, not both")
    if args.model:
        shape = _shape(args.input_shape) if args.input_shape else None
        sc = Scenario(name=args.model, model=args.model, input_shape=shape)
    else:
        sc = load_scenario(args.scenario or DEFAULT)
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


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    sc = _scenario(args)
    print(f"building {sc.name} ({sc.model})", file=sys.stderr)
    model, inputs = sc.build()
    return sc, model, inputs


def _profile(args: argparse.Namespace) -> Any:
    from tqdm import tqdm

    from memfit.profiler import profile

    sc, model, inputs = _build(args)
    optimizer = None if sc.optimizer == "none" else sc.optimizer
    with tqdm(total=4 + args.repeat, desc="profiling", unit="pass", file=sys.stderr, leave=False, disable=None) as bar:
        started = []

        def progress(message: str) -> None:  # called as each pass begins
            if started:
                bar.update(1)
            started.append(message)
            bar.set_postfix_str(message)

        result = profile(model, inputs, units=sc.units, optimizer=optimizer, repeat=args.repeat, progress=progress)
        bar.update(1)
    return result


def cmd_profile(args: argparse.Namespace) -> int:
    from memfit.report import profile_report

    prof = _profile(args)
    prof.save(args.output)
    if args.json:
        print(json.dumps({"format": "memfit.profile/1", **asdict(prof)}, indent=2))
    else:
        print(profile_report(prof))
        print(f"\nwrote {args.output}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from memfit.budget import parse_bytes
    from memfit.optimizer.planner import plan
    from memfit.profile import Profile
    from memfit.report import schedule_report

    budget = parse_bytes(args.budget)  # fail on a bad budget before minutes of profiling
    if args.profile and (args.scenario or args.model):
        raise MemfitError("give either --profile or a model (--scenario/--model), not both")
    prof = Profile.load(args.profile) if args.profile else _profile(args)
    schedule = plan(prof, budget, strategy=args.strategy, solver=args.solver, time_limit=args.time_limit,
                    segments=not args.no_segments, max_segment=args.max_segment)
    schedule.save(args.output)
    if args.json:
        print(json.dumps({"format": "memfit.schedule/1", **asdict(schedule)}, indent=2))
        return 0
    print(schedule_report(schedule, prof))
    print(f"\nwrote {args.output}; in train.py:\n"
          f'    model = memfit.apply(model, memfit.load_schedule("{args.output}"))')
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from memfit.report import validation_report
    from memfit.runtime.validate import validate
    from memfit.schedule import load_schedule

    if args.steps < 1:
        raise MemfitError("--steps must be at least 1 (timed rounds of the plain and the scheduled step)")
    schedule = load_schedule(args.schedule)
    sc, model, inputs = _build(args)
    optimizer = None if sc.optimizer == "none" else sc.optimizer
    print("measuring the plain and the scheduled step", file=sys.stderr)
    result = validate(model, inputs, schedule, optimizer=optimizer, steps=args.steps)
    if args.json:
        print(json.dumps({**asdict(result), "error": result.error, "fits": result.fits, "ok": result.ok}, indent=2))
    else:
        print(validation_report(result))
    return 0 if result.ok else 1


def cmd_show(args: argparse.Namespace) -> int:
    from memfit.errors import FileFormatError
    from memfit.profile import PROFILE_FORMAT, Profile
    from memfit.report import profile_report, schedule_report
    from memfit.schedule import SCHEDULE_FORMAT, load_schedule

    path = Path(args.file)
    try:
        fmt = json.loads(path.read_text(encoding="utf-8")).get("format")
    except FileNotFoundError:
        raise MemfitError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise FileFormatError(f"{path}: not a memfit JSON file") from None
    if fmt == SCHEDULE_FORMAT:
        print(schedule_report(load_schedule(path)))
    elif fmt == PROFILE_FORMAT:
        print(profile_report(Profile.load(path)))
    else:
        raise FileFormatError(f"{path}: field 'format' is {fmt!r}; expected {SCHEDULE_FORMAT} or {PROFILE_FORMAT}")
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    from memfit.report import table
    from memfit.scenarios import DEFAULT, builtin_names, load_scenario

    rows = []
    for name in builtin_names():
        sc = load_scenario(name)
        rows.append([name + (" (default)" if name == DEFAULT else ""), sc.model, sc.description])
    print(table(["scenario", "factory", "description"], rows, [False, False, False]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
