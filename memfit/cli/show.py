"""``memfit show``, ``memfit export`` and ``memfit scenarios``: files and built-ins as tables, a
schedule in another tool's form."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memfit.cli.flags import Command
from memfit.console import write_output
from memfit.errors import MemfitError


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


def add_parsers(command: Command) -> None:
    """The show, export and scenarios subcommands and their flags."""
    from memfit.export import FORMS

    show = command("show", "print a schedule or profile JSON as tables")
    show.add_argument("file", help="schedule.json or profile.json")
    show.set_defaults(func=cmd_show)

    exp = command("export", "write a schedule in another tool's form (Hugging Face transformers, torchtitan, PyTorch "
                  "selective checkpointing); what that form cannot express is printed as warnings and kept as "
                  "comments in the file")
    exp.add_argument("schedule", help="a schedule JSON from `memfit plan`")
    exp.add_argument("--to", required=True, choices=FORMS,
                     help="; ".join(f"{k}: {v}" for k, v in FORMS.items()).replace("%", "%%"))
    exp.add_argument("-o", "--output", help="file to write (default: print it)")
    exp.add_argument("--json", action="store_true", help="print {to, file, checkpointed, lost} as JSON (and the "
                     "exported text as 'text' without -o)")
    exp.set_defaults(func=cmd_export)

    scen = command("scenarios", "list the built-in scenarios")
    scen.set_defaults(func=cmd_scenarios)
