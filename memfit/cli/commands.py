"""What the ``memfit`` commands do, once parsed: build the model a flag or a schedule names,
profile it, and call the API; memfit/cli/__init__.py parses and reports errors."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit.cli import modelflags
from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError, PlanOptionError
from memfit.planning.options import PlanOptions, check_strategies


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
    from memfit.planning.planner import plan
    from memfit.plots import check_plot_path, timeline
    from memfit.report import schedule_report, shapes_report

    share = parse_share(args.budget)  # "60%": of the unplanned peak, known once profiled
    budget = parse_bytes(args.budget) if share is None else 0  # fail on a bad budget before minutes of profiling
    settings = _plan_options(args)
    if (args.no_segments or args.compile) and args.strategy == "sqrt":
        raise MemfitError(f"{'--compile' if args.compile else '--no-segments'} rules out --strategy sqrt, which "
                          "checkpoints segments of units")
    if args.compile:
        from memfit.compiled import check_backend

        check_backend(args.compile)
        if args.fallbacks:
            raise MemfitError("--fallbacks is planned for the eager step only; drop it with --compile")
    output = "schedule.json" if args.output is None else args.output
    _check_outputs(args, {"-o": (output, "schedule file"), **modelflags.profile_output(args)})
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
        options = {k: v for k, v in asdict(settings).items() if k not in ("segments", "fallbacks")}
        schedule = _plan_compiled(args, prof, budget, options)
    else:
        schedule = plan(profs if len(profs) > 1 else prof, budget, **asdict(settings), shares=shares)
        prof = next(p for p in profs if p.input_shapes == schedule.input_shapes)  # the largest shape's
    check_interrupt()
    idle = not any(p.checkpointed for p in schedule.plans)
    write = args.output is not None or not idle
    if write:
        replaced = _schedule_for_another_model(output, schedule)
        write_output(schedule.save, output)
        if replaced:
            print(f"memfit: note: {output} was a schedule for {replaced}; replaced by this one for "
                  f"{schedule.fingerprint.get('model_class', 'this model')}", file=sys.stderr)
    if args.timeline:
        write_output(lambda path: timeline(schedule.levels, path, title=_title(prof, f"{schedule.strategy} plan"),
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
          f'    model = memfit.apply(model, memfit.load_schedule("{output}"))')
    return 0


def _say_nothing_to_do(args: argparse.Namespace, profs: list[Any], schedule: Any, budget: int, output: str,
                       write: bool) -> None:
    """The budget fits the plain step (of every shape planned): say so, where checkpointing would
    matter."""
    from memfit.budget import format_bytes
    from memfit.planning.planner import min_budget_bytes
    from memfit.report import device_notes

    prof = next(p for p in profs if p.input_shapes == schedule.input_shapes)  # the largest shape's

    per_rank = (f" on each of {schedule.parallel['world_size']} {schedule.parallel['kind']} ranks"
                if schedule.parallel else "")
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
    return _flag_options(strategy=args.strategy, solver=args.solver, segments=not args.no_segments,
                         max_segment=args.max_segment, granularity=args.granularity, time_limit=args.time_limit,
                         fallbacks=args.fallbacks)


def _flag_options(**settings: Any) -> PlanOptions:
    """A PlanOptions from flags; a mistake names the flag (--max-segment, not max_segment)."""
    try:
        return PlanOptions(**settings)
    except PlanOptionError as e:
        raise e.spelled(lambda name: "--" + name.replace("_", "-")) from None


def _plan_compiled(args: argparse.Namespace, prof: Any, budget: int, options: dict[str, Any]) -> Any:
    """The plan whose step, compiled with ``args.compile``, is measured to fit (plan_compiled)."""
    from memfit.compiled import plan_compiled
    from memfit.scenarios import scenario_from_source

    if not prof.source:
        raise MemfitError("--compile measures the compiled step, but this profile does not record its model (it was "
                          "made in Python): give --scenario or --model instead of --profile")
    sc = scenario_from_source(prof.source, trusted=not args.profile or args.trust_source)
    model, inputs = modelflags.build_model(sc, prof.device)

    def progress(message: str) -> None:
        check_interrupt()
        print(message, file=sys.stderr)

    return plan_compiled(model, inputs, prof, budget, args.compile, step=prof.train_step, progress=progress,
                         **options)


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


def _check_outputs(args: argparse.Namespace, outputs: dict[str, tuple[str, str]]) -> None:
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


def _title(made: Any, what: str) -> str:
    """Model, inputs, precision (the step's: amp-bf16, not the weights' float32), the device or the
    target it was estimated for, and optimizer of a profile or a schedule, for a picture."""
    source = made.source
    name = (Path(str(source["scenario"])).stem if source.get("scenario")
            else source.get("model") or made.fingerprint.get("model_class", "model"))
    precision = (made.step or {}).get("precision") or source.get("dtype")  # amp-bf16 over float32 weights
    dtype = f" - {precision}" if precision else ""
    where = f"estimated for {made.target}" if made.target else made.device
    return f"{name}: {what}\ninputs {made.input_shapes}{dtype} - {where}, optimizer {made.optimizer}"


def cmd_show(args: argparse.Namespace) -> int:
    from memfit.errors import FileFormatError
    from memfit.formats.profile import PROFILE_FORMAT, PROFILES_FORMAT, load_profiles
    from memfit.formats.schedule import SCHEDULE_FORMAT, load_schedule
    from memfit.jsonio import read_json
    from memfit.report import profile_report, schedule_report, shapes_report

    fmt = read_json(args.file, None)["format"]
    if fmt == SCHEDULE_FORMAT:
        schedule = load_schedule(args.file)
        print(shapes_report(schedule) if schedule.shapes else schedule_report(schedule))
    elif fmt in (PROFILE_FORMAT, PROFILES_FORMAT):
        print("\n\n".join(profile_report(p) for p in load_profiles(args.file)))
    else:
        raise FileFormatError(f"{args.file}: field 'format' is {fmt!r}; expected {SCHEDULE_FORMAT}, {PROFILE_FORMAT} "
                              f"or {PROFILES_FORMAT}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from memfit.export import MARK, export
    from memfit.formats.schedule import SCHEDULE_FORMAT, load_schedule
    from memfit.jsonio import check_writable, read_json, write_atomic

    if not Path(args.schedule).exists():
        raise MemfitError(f"{args.schedule}: no such file; give a schedule JSON that memfit plan wrote "
                          "(memfit plan --budget SIZE -o schedule.json)")
    if read_json(args.schedule, None)["format"] != SCHEDULE_FORMAT:  # a profile: plan it first
        raise MemfitError(f"{args.schedule} is not a schedule; plan one first: memfit plan --profile "
                          f"{args.schedule} --budget SIZE -o schedule.json")
    out = args.output and check_writable(args.output, "exported plan")
    if out and out.is_file() and MARK not in out.open(errors="replace").readline():
        raise MemfitError(f"{args.output} exists and is not a plan memfit exported; refusing to overwrite it "
                          "(remove it first, or write elsewhere)")
    made = export(load_schedule(args.schedule), args.to, Path(args.schedule).name)
    for line in made.lost:
        print(f"memfit: warning: {line}", file=sys.stderr)
    if out:
        write_output(lambda path: write_atomic(path, lambda tmp: Path(tmp).write_text(made.text)), out)
    if args.json:
        print(json.dumps({"to": made.to, "file": str(out) if out else None, "checkpointed": made.checkpointed,
                          "lost": made.lost, **({} if out else {"text": made.text})}, indent=2))
    else:
        print(f"wrote {out}" if out else made.text, end="\n" if out else "")
    return 0


def cmd_scenarios(args: argparse.Namespace) -> int:
    import torch

    from memfit.report import table
    from memfit.scenarios import BUILTIN_DIR, DEFAULT, builtin_names, load_scenario

    cuda = torch.cuda.is_available()
    names = builtin_names()
    if not names:
        raise MemfitError(f"no built-in scenarios in {BUILTIN_DIR}: this memfit installation is incomplete; "
                          "reinstall it")
    from memfit.budget import format_bytes

    rows = []
    for name in names:
        sc = load_scenario(name)
        mode = "measured" if not sc.target or cuda else f"estimated ({sc.target})"
        device = sc.target_device() if sc.target else None
        usable = format_bytes(device.usable_bytes) if device is not None and device.memory else "-"
        if sc.missing:
            mode, size = f"needs {sc.missing}", "-"
        else:
            size = f"{_count(sc.parameter_count())} {sc.dtype}"
        rows.append([name + (" (default)" if name == DEFAULT else ""), size, sc.train_step.describe(), mode, usable,
                     sc.description])
    print(table(["scenario", "parameters", "step", "here", "usable", "description"], rows,
                [False, True, False, False, True, False]))
    print("\nhere: measured on this machine, or estimated from shapes for the scenario's target device (no GPU "
          "here); --target NAME estimates any scenario for a device\n"
          "usable: what the target leaves to a training step (its total less the CUDA context and the allocator's "
          "margin); plans for it are held to that\n"
          "step: the training step each is planned for (amp-bf16: fp32 weights and AdamW state, bf16 autocast, as most "
          "people train; --precision bf16 builds a pure-bf16 model instead)")
    if any(row[3].startswith("needs transformers") for row in rows):
        print("needs transformers: pip install 'memfit[hf]' for the Hugging Face scenarios")
    return 0


def _count(n: int) -> str:
    steps = ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 0), (1, "", 0))
    return next(f"{n / scale:.{d}f}{unit}" for scale, unit, d in steps if n >= scale or scale == 1)


def cmd_sweep(args: argparse.Namespace) -> int:
    from memfit.budget import budget_range, parse_bytes
    from memfit.plots import check_plot_path, curve

    budgets = budget_range(args.budgets) if args.budgets else None
    if budgets is not None and args.points is not None:
        raise MemfitError("give either --budgets or --points, not both")
    strategies = check_strategies([s.strip() for s in args.strategies.split(",") if s.strip()], "--strategies")
    _flag_options(solver=args.solver, segments=not args.no_segments, max_segment=args.max_segment,
                  granularity=args.granularity)
    if args.steps < 1:
        raise MemfitError("--steps must be at least 1")
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    outputs = {"--csv": (args.csv, "CSV file")} if args.csv else {}
    _check_outputs(args, {**outputs, **modelflags.profile_output(args)})
    if args.plot:
        check_plot_path(args.plot)
    from memfit.jsonio import write_atomic
    from memfit.planning.sweep import sweep
    from memfit.plots import shape_curves
    from memfit.report import shape_name, sweep_report

    profs = modelflags.plan_profiles(args)
    if budgets is None and len(profs) > 1:  # one range for every shape: rows side by side, curves on one axis
        from memfit.planning.sweep import default_budgets

        ends = [default_budgets(p, 2, segments=not args.no_segments, max_segment=args.max_segment,
                                fine=args.granularity == "fine") for p in profs]
        lo, hi, points = min(e[0] for e in ends), max(e[-1] for e in ends), args.points or 30
        budgets = sorted({lo + (hi - lo) * k // (points - 1) for k in range(points)})
    frames = {}
    for prof in profs:
        if args.measure and not prof.source:
            raise MemfitError("--measure needs the model: this profile does not say how it was built; profile it "
                              "with memfit profile (or give --scenario/--model instead of --profile)")
        frame = sweep(prof, budgets, points=args.points or 30, strategies=strategies, solver=args.solver,
                      segments=not args.no_segments, max_segment=args.max_segment, granularity=args.granularity)
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
        title = _title(prof, "memory vs slowdown")
        if len(frames) > 1:
            title = title.replace(f"inputs {prof.input_shapes}", ", ".join(frames))
        write_output(lambda path: curve(frame, path, title=title, device_memory=device_memory) if len(frames) == 1
                     else shape_curves(frames, path, title=title, device_memory=device_memory), args.plot)
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

    from memfit.runtime.validate import measure_plans
    from memfit.scenarios import scenario_from_source

    plans = [p for p in dict.fromkeys(frame["policies"].dropna()) if p]
    sc = scenario_from_source(prof.source, trusted=not args.profile or args.trust_source)
    model, inputs = modelflags.build_model(sc, prof.device)
    with tqdm(total=len(plans), desc="measuring plans", unit="plan", file=sys.stderr, leave=False,
              disable=None) as bar:
        peaks, overheads, sure = measure_plans(model, inputs, [json.loads(p) for p in plans], step=prof.train_step,
                                         steps=args.steps, progress=lambda: (check_interrupt(), bar.update(1)))
    frame["measured_peak_bytes"] = frame["policies"].map(dict(zip(plans, peaks, strict=True))).astype("Int64")
    frame["measured_overhead"] = frame["policies"].map(dict(zip(plans, overheads, strict=True))).astype(float)
    frame["measured_uncertainty"] = frame["policies"].map(dict(zip(plans, sure, strict=True))).astype(float)
