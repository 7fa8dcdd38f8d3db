"""From the command line's model flags to a model, its inputs and a profile: a scenario, a
``module:factory``, or the model a schedule or profile was made for; measured here or estimated
for a target device."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from memfit.console import check_interrupt, write_output
from memfit.errors import MemfitError

STEP_FLAGS = ("optimizer", "accumulate", "precision", "clip_grad_norm", "zero_grad", "keep_output",
              "autocast_cache")
MODEL_FLAGS = ("scenario", "model", "args", "input_shape", "seq_lens", "units", *STEP_FLAGS, "device", "repeat",
               "children", "target", "parallel", "world_size", "tp",
               "sequence_parallel")


def given(args: argparse.Namespace, names: tuple[str, ...] = MODEL_FLAGS) -> list[str]:
    """The model flags the user gave, spelled as on the command line."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]


def scenario_of(args: argparse.Namespace) -> Any:
    from memfit.scenarios import DEFAULT, Scenario, load_scenario

    if args.scenario and args.model:
        raise MemfitError("give either --scenario or --model, not both")
    shapes = input_shapes(args)
    if args.model:
        sc = Scenario(name=args.model, model=args.model, input_shape=shapes[0] if shapes else None)
    else:
        sc = load_scenario(args.scenario or DEFAULT)
        if shapes:
            sc.input_shape = shapes[0]
    if getattr(args, "args", None):
        sc.args = {**sc.args, **factory_args(args.args)}
    if args.units:
        sc.units = args.units
    for flag in STEP_FLAGS:
        if getattr(args, flag, None) is not None:
            setattr(sc, flag, getattr(args, flag))
    if args.precision is not None:  # the model is built for it: fp32 weights under autocast, else its dtype
        sc.dtype = _PRECISION_DTYPES.get(args.precision, "float32")
    sc.train_step  # noqa: B018 -- checks the combination now, before any model is built
    return sc


_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # amp-*: float32


def factory_args(items: list[str]) -> dict[str, Any]:
    """``--args batch=64 image=1024 name=tiny``: each value read as a TOML value, as a scenario's
    ``[args]`` are (64 an integer, 0.1 a float, true, [64, 128], 'text'), else taken as a string."""
    from memfit.scenarios import tomllib

    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip().isidentifier():
            raise MemfitError(f"--args {item!r}: write NAME=VALUE, e.g. --args batch=64 image=1024")
        try:
            out[name.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[name.strip()] = value
    return out


def input_shapes(args: argparse.Namespace) -> list[list[int]]:
    """Every --input-shape given (plan, profile and sweep take several; validate one)."""
    given = getattr(args, "input_shape", None)
    return [parse_shape(t) for t in ([given] if isinstance(given, str) else given or [])]


def scenarios_of(args: argparse.Namespace) -> list[Any]:
    """The scenario once per input shape to plan for: each --input-shape, each of --seq-lens (or
    the scenario's seq_lens), or the one."""
    import dataclasses

    from memfit.lengths import parse_lengths

    sc = scenario_of(args)
    shapes = input_shapes(args)
    if getattr(args, "seq_lens", None):
        if len(shapes) > 1:
            raise MemfitError("give either --seq-lens or several --input-shape, not both")
        sc.seq_lens = parse_lengths(args.seq_lens)
    if len(shapes) > 1:
        if len({tuple(s) for s in shapes}) != len(shapes):
            raise MemfitError("the same --input-shape is given twice; give each shape once")
        return [dataclasses.replace(sc, input_shape=s) for s in shapes]
    return sc.shapes()


def profiles_of(args: argparse.Namespace) -> list[Any]:
    """A profile per input shape the flags ask for (``scenarios_of``), each measured or estimated
    as ``profile_of`` does."""
    variants = scenarios_of(args)
    out = []
    for k, sc in enumerate(variants):
        if len(variants) > 1:
            what = f"sequence length {sc.seq_len}" if sc.seq_len is not None else f"input shape {sc.input_shape}"
            print(f"shape {k + 1} of {len(variants)}: {what}", file=sys.stderr)
        out.append(profile_of(args, sc))
    return out


def profile_output(args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """``--save-profile``'s file, for the outputs checked before any profiling."""
    if args.save_profile and args.profile:
        raise MemfitError(f"--save-profile keeps a profile this run measures; with --profile {args.profile} it "
                          "measures none: drop one of them")
    return {"--save-profile": (args.save_profile, "profile file")} if args.save_profile else {}


def plan_profiles(args: argparse.Namespace) -> list[Any]:
    """The profiles to plan from: read from --profile, or measured (and kept with --save-profile,
    before any planning, so that a budget that cannot be met still leaves them)."""
    from memfit.formats.profile import load_profiles, save_profiles

    if args.profile:
        return load_profiles(args.profile)
    profs = profiles_of(args)
    if args.save_profile:
        write_output(lambda path: save_profiles(profs, path), args.save_profile)
        print(f"wrote {args.save_profile}: plan at another budget without profiling again: memfit plan --profile "
              f"{args.save_profile} --budget SIZE", file=sys.stderr)  # stdout may be --json
    return profs


def shares_of(args: argparse.Namespace, profiles: list[Any]) -> list[float] | None:
    """Each profile's share of the steps from --seq-hist (None without it): the profiles must be
    of sequence lengths (--seq-lens)."""
    from memfit.lengths import read_histogram

    if not getattr(args, "seq_hist", None):
        return None
    lengths = [p.source.get("seq_len") for p in profiles]
    if len(profiles) < 2 or None in lengths:
        raise MemfitError("--seq-hist weighs the sequence lengths of a plan for several: give --seq-lens (or a "
                          "profile made with it)")
    counts = dict(zip(sorted(lengths), read_histogram(args.seq_hist, sorted(lengths)), strict=True))
    return [counts[n] for n in lengths]


def parse_shape(text: str) -> list[int]:
    try:
        dims = [int(d) for d in text.lower().replace(",", "x").split("x")]
    except ValueError:
        raise MemfitError(f"--input-shape is dimensions joined by x, e.g. 8x3x224x224; got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise MemfitError(f"--input-shape needs positive dimensions, got {text!r}")
    return dims


def parse_device(text: str | None) -> str:
    """--device, checked; by default CUDA when there is a GPU, else the CPU."""
    import torch

    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise MemfitError(f"--device must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise MemfitError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MemfitError(f"--device {text}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise MemfitError(f"--device {text}: there are {torch.cuda.device_count()} CUDA devices (0-based)")
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"  # as profiles say
    return "cpu"


def target_of(args: argparse.Namespace, sc: Any) -> Any:
    """The device to estimate for (a ``devices.Device``): --target or --device-spec; else, with no
    GPU here and no --device, the scenario's own target; else None (measure here)."""
    import torch

    from memfit.devices import device_spec, load_device_spec

    spec_file = getattr(args, "device_spec", None)
    if args.target is not None and spec_file is not None:
        raise MemfitError("give either --target NAME or --device-spec FILE, not both (a spec file's base = NAME "
                          "starts from a built-in device)")
    if spec_file is not None and args.device is not None:
        return None  # measured on that device; the spec gives its context and margin (profile_of)
    if args.target is not None or spec_file is not None:
        if args.device is not None:
            raise MemfitError("--target estimates for a device without using one; drop --device (or --target to "
                              "measure on the device)")
        return device_spec(args.target) if args.target is not None else load_device_spec(spec_file)
    if sc.target and args.device is None and not torch.cuda.is_available():
        return sc.target_device()
    return None


def layout_from(args: argparse.Namespace, sc: Any) -> Any:
    """The ranks the flags (over the scenario's own ``parallel``, ``world_size``, ``tp``,
    ``sequence_parallel``) ask for, checked (``formats.layout.layout_of``); None for one process."""
    from memfit.formats.layout import layout_of

    if args.world_size is not None and args.parallel is None and sc.parallel is None:
        raise MemfitError("--world-size is the number of ranks for --parallel; give --parallel too")
    parallel = args.parallel or sc.parallel
    ranks = args.world_size if args.world_size is not None else (
        sc.world_size if parallel == sc.parallel and sc.world_size else 2)
    same = parallel == sc.parallel and args.world_size in (None, sc.world_size)
    tp = args.tp if args.tp is not None else (sc.tp or 1) if same else 1
    sp = args.sequence_parallel if args.sequence_parallel is not None else (sc.sequence_parallel and same)
    if (args.tp is not None or args.sequence_parallel) and parallel is None:
        raise MemfitError("--tp and --sequence-parallel shape the ranks of --parallel; give --parallel too")
    return layout_of(parallel, ranks, tp, sp) if parallel is not None else None


def mesh_arguments(layout: Any) -> dict[str, Any]:
    """``layout`` as the keyword arguments of ``estimate`` and ``estimate_stages``."""
    from memfit.formats.layout import tp_degree

    if layout is None:
        return {}
    return {"parallel": layout["kind"], "world_size": int(layout["world_size"]), "tp": tp_degree(layout),
            "sequence_parallel": bool(layout.get("sequence_parallel"))}


def build_model(sc: Any, device: str) -> tuple[Any, Any]:
    print(f"building {sc.name} ({sc.model}) on {device}", file=sys.stderr)
    return sc.build(device)


def profile_of(args: argparse.Namespace, sc: Any = None) -> Any:
    """The profile the flags ask for (of ``sc``, one of ``scenarios_of``; by default the
    flags' one shape): estimated for a target, or measured here."""
    import torch

    from memfit.devices import DEVICES
    from memfit.formats.layout import describe_layout

    repeat = 5 if args.repeat is None else args.repeat
    if repeat < 1:
        raise MemfitError("--repeat must be at least 1")
    if args.children and args.granularity != "fine":
        raise MemfitError("--children names finer options to measure: give --granularity fine with it")
    sc = scenario_of(args) if sc is None else sc
    target = target_of(args, sc)
    if target is not None and getattr(args, "compile", None):
        raise MemfitError(f"--compile measures the compiled step, which needs the device; {sc.name} would be estimated "
                          f"for {target.name} from shapes: plan without --compile here, or with it on that GPU")
    if sc.pp is not None:
        raise MemfitError(f"{sc.name} is a pipeline of {sc.pp} ranks (its pp): memfit plan --scenario {sc.name} plans "
                          "each rank; profile and sweep take one model")
    step = sc.train_step
    layout = layout_from(args, sc)  # checked before it says what it does
    if layout is not None and target is None:
        from memfit.steps.parallel import profile_ranks

        print(f"measuring {sc.name} on one rank of {describe_layout(layout)}", file=sys.stderr)
        return profile_ranks(sc, **mesh_arguments(layout), repeat=repeat, granularity=args.granularity,
                             device=parse_device(args.device))
    if target is not None:
        from memfit.profiler.estimate import estimate

        print(f"estimating {sc.name} ({sc.model}) for {target.name} from shapes (fake tensors, nothing allocated)",
              file=sys.stderr)
        result = estimate(lambda: sc.build("cpu"), target=target, units=sc.units, step=step,
                          granularity=args.granularity, children=args.children, progress=lambda _m: check_interrupt(),
                          **mesh_arguments(layout))
        result.source = sc.source()
        _say_units(sc, result)
        return result
    device = parse_device(args.device)
    try:
        measured = _measured(args, sc, device, step, repeat)
    except torch.OutOfMemoryError:
        raise MemfitError(
            f"{sc.name} does not fit {device} unplanned, and memfit measures the plain step: estimate it instead "
            f"with --target (one of {', '.join(DEVICES)}), which needs no GPU memory"
        ) from None
    _say_units(sc, measured)
    if getattr(args, "device_spec", None) and measured.memory:  # this card's own context and margin
        from memfit.devices import load_device_spec

        spec = load_device_spec(args.device_spec)
        measured.memory = {**measured.memory, "context_bytes": spec.context_bytes, "margin": spec.margin,
                           "source": f"total: torch.cuda.mem_get_info; context and margin: {args.device_spec}"}
    return measured


def _say_units(sc: Any, prof: Any) -> None:
    """Which blocks the automatic choice took, so that a class it left out shows before the plan."""
    if sc.units == "auto":
        from memfit.units import summary

        print(f"units: {summary(prof.unit_names)} (the repeated blocks; --units names others)", file=sys.stderr)


def _measured(args: argparse.Namespace, sc: Any, device: str, step: Any, repeat: int) -> Any:
    from tqdm import tqdm

    from memfit.profiler import profile

    model, inputs = build_model(sc, device)
    check_interrupt()
    with tqdm(total=4 + repeat, desc="profiling", unit="pass", file=sys.stderr, leave=False, disable=None) as bar:
        started = []

        def progress(message: str) -> None:  # called as each pass begins
            check_interrupt()  # an interrupt swallowed during the last pass stops the run here
            if started:
                bar.update(1)
            started.append(message)
            if len(started) > bar.total:  # fine granularity: a pass for each finer option found
                bar.total = len(started)
                bar.refresh()
            bar.set_postfix_str(message)

        result = profile(model, inputs, units=sc.units, step=step, repeat=repeat, progress=progress,
                         granularity=args.granularity, children=args.children)
        bar.update(1)
    result.source = sc.source()
    return result


def validation_setup(args: argparse.Namespace, schedule: Any) -> tuple[Any, str]:
    """The model, optimizer and device the schedule was made for; flags that say otherwise are
    refused with the one that differs, since measuring another setup would prove nothing."""
    from memfit.scenarios import cli_flag, load_scenario, scenario_from_source

    source = schedule.source
    planned = _planned_flags(schedule)
    for flag, value in planned.items():
        mine = getattr(args, flag, None)
        if mine is not None and mine != value:
            spelled = "--" + flag.replace("_", "-")
            raise MemfitError(f"the schedule was planned with {spelled} {value}, not {mine}: its peak is that step's; "
                              f"drop {spelled}, or plan again with yours")
    if args.device and parse_device(args.device) != schedule.device:
        raise MemfitError(f"the schedule was profiled on {schedule.device}, not {args.device}: memory differs "
                          f"between devices; validate with --device {schedule.device}, or plan again on {args.device}")
    model_flags = ("scenario", "model", "input_shape", "units")
    if schedule.parallel and not source:
        from memfit.formats.layout import describe_layout

        raise MemfitError(f"this schedule is per rank, for {describe_layout(schedule.parallel)}, and does not record "
                          "which model it was made for: "
                          "check it in your distributed run (examples/train_fsdp.py prints each rank's measured peak)")
    if schedule.target and not args.device:
        import torch

        if schedule.device == "cuda" and not torch.cuda.is_available():
            raise MemfitError(f"this schedule was estimated for {schedule.target} without one; validate it on that "
                              "GPU (memfit validate there measures the step and compares)")
    if not source:  # a schedule from memfit.plan() in Python, or from an older memfit
        if not given(args, model_flags):
            raise MemfitError("this schedule does not record which model it was made for (it was made in Python "
                              "or by an older memfit): give --scenario or --model, as when it was planned")
        sc = scenario_of(args)
    else:
        made_for = f"the schedule was made for {cli_flag(source)}"
        named = args.scenario is not None or args.model is not None
        if named:
            flag, mine = (("--scenario", load_scenario(args.scenario).origin) if args.scenario is not None
                          else ("--model", args.model))
            theirs = source.get(flag[2:])
            if mine != theirs:
                raise MemfitError(f"{made_for}, not {flag} {args.scenario or args.model}; drop the model flags to "
                                  "validate what it was made for")
        if args.input_shape is not None and input_shapes(args)[0] != source.get("input_shape"):
            planned = "x".join(map(str, source.get("input_shape") or [])) or "the factory's own inputs"
            raise MemfitError(f"{made_for} with input shape {planned}, not --input-shape {args.input_shape}")
        if args.units is not None and args.units != source.get("units"):
            planned_units = source.get("units")
            shown = " ".join(planned_units) if isinstance(planned_units, list) else planned_units
            raise MemfitError(f"{made_for} with units {shown}, not --units {' '.join(args.units)}")
        sc = scenario_from_source(source, trusted=named or args.trust_source)
    for flag, value in planned.items():
        setattr(sc, flag, value)
    return sc, parse_device(args.device or schedule.device)


def _planned_flags(schedule: Any) -> dict[str, Any]:
    """The step flags' values the schedule was planned with (TrainStep.of_record)."""
    step = schedule.train_step
    return {"optimizer": schedule.optimizer or "none", "accumulate": step.accumulate, "precision": step.precision,
            "clip_grad_norm": step.clip_grad_norm, "zero_grad": step.zero_grad, "keep_output": step.keep_output,
            "autocast_cache": step.autocast_cache}
