"""The ``memfit`` command: profile, plan, validate, show, export, scenarios. Parses, calls the API, prints."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

from memfit.cli import commands, validate
from memfit.console import (
    check_interrupt,
    install_interrupt_handler,
    interrupted,
    remove_outputs,
    user_code_error,
)
from memfit.errors import InternalError, MemfitError, MemfitWarning
from memfit.formats.profile import PARALLEL
from memfit.trainstep import OPTIMIZERS, PRECISIONS, ZERO_GRADS

EPILOG = """\
examples:
  memfit plan --budget 24GB                       # the default 0.73B GPT (gpt-750m): estimated for an RTX 4090
  memfit plan --budget 80GB --scenario llama2-7b --target h100   # any scenario, estimated for any device
  memfit plan --budget 300MB --scenario gpt-small # a small GPT, measured here (CPU or GPU)
  memfit plan --budget 8GiB --model mypkg.models:build --input-shape 8x3x224x224
  memfit plan --budget 300MB --scenario gpt-small --strategy every-k   # a baseline instead of the optimum
  memfit plan --budget 300MB --scenario gpt-small --granularity fine   # finer: an attention, an MLP, derive
  memfit plan --budget 300MB --scenario gpt-small --compile inductor   # for the torch.compile'd step, measured
  memfit profile --scenario gpt-small -o p.json && memfit plan --profile p.json --budget 300MB
  memfit plan --budget 24GB --device cuda:1       # measure on the second GPU (default: cuda if there is one)
  memfit plan --budget 300MB --scenario gpt-small --parallel fsdp --world-size 2   # a plan per rank
  memfit validate --schedule schedule.json        # rebuild the planned model; measure peak, slowdown, gradients
  memfit sweep --scenario gpt-small --plot curve.png   # the memory-vs-slowdown curve over 30 budgets
  memfit sweep --scenario gpt-small --budgets 150MB:550MB:50MB --measure --csv sweep.csv
  memfit show schedule.json
  memfit export schedule.json --to hf -o memfit_plan.py   # for HF transformers; also torchtitan, sac
  memfit scenarios                                # the built-in models, and which are estimated here

memory sizes are binary: 24GB = 24GiB = 24G = 24 x 2^30 bytes; 1536MB; 0.5TB; a bare number is bytes.
in train.py:  model = memfit.apply(model, memfit.load_schedule("schedule.json"))
"""
SIZES, TRAIN = EPILOG.splitlines()[-2:]


def _epilog(command: str) -> str:
    """A subcommand's own examples from EPILOG, and the notes that concern it."""
    mine = [line for line in EPILOG.splitlines() if line.startswith("  memfit ") and f"memfit {command} " in line + " "]
    notes = [SIZES] if command in ("plan", "sweep") else []
    notes += [TRAIN] if command in ("plan", "validate") else []
    return "\n".join(["examples:", *mine, *(["", *notes] if notes else [])]) + "\n"


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """memfit's own warnings as a line of their own, like its errors; others as Python prints them."""
    if issubclass(category, MemfitWarning):
        print(f"memfit: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _negative_sizes(argv: list[str]) -> list[str]:
    """``--budget -1GB`` as ``--budget=-1GB``: argparse takes a value that starts with a dash for an
    option and says only "expected one argument"; joined, the size's own check says what is wrong."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--budget", "--budgets") and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def shadowing_folder(cwd: Path) -> str | None:
    """A folder named memfit in ``cwd`` that is not this package: Python puts a script's folder
    first on sys.path, so ``import memfit`` in a train.py beside it finds the folder (an empty
    namespace: "module 'memfit' has no attribute 'apply'"), and so does ``python -m memfit.cli``."""
    from importlib.machinery import PathFinder

    folder = cwd / "memfit"
    if not folder.is_dir() or folder.resolve() == Path(__file__).resolve().parent.parent:  # memfit/cli/..
        return None
    spec = PathFinder.find_spec("memfit", [str(cwd), *sys.path[1:]])  # as a script's import would search
    if spec is not None and spec.origin is not None and not Path(spec.origin).resolve().is_relative_to(
            folder.resolve()):
        return None  # an installed package comes first (a folder without __init__.py is only a namespace)
    return (f"the folder {folder} hides the memfit package from Python run in {cwd} (`import memfit` in a script "
            "there finds the folder, which has no memfit.apply); rename the folder, e.g. to memfit-out")


def main(argv: list[str] | None = None) -> int:
    install_interrupt_handler()  # first, so that a Ctrl-C from here on always ends the run with 130
    debug, args = False, None
    try:
        parser = _parser()
        args = parser.parse_args(_negative_sizes(sys.argv[1:] if argv is None else argv))
        debug = bool(getattr(args, "debug", False))
        if not getattr(args, "command", None):
            parser.print_help()
            return 2
        if (note := shadowing_folder(Path.cwd())) is not None:
            print(f"memfit: warning: {note}", file=sys.stderr)
        from memfit.measure.malloc import keep_freed_cpu_memory

        keep_freed_cpu_memory()  # steadier, additive CPU step times (see its docstring)
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the try, not at exit
        check_interrupt()
        return code
    except KeyboardInterrupt:
        return _interrupted()
    except BrokenPipeError:  # `memfit scenarios | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # 128 + SIGPIPE, as a shell reports a writer killed by it
    except MemfitError as exc:
        if interrupted():
            return _interrupted()
        if debug:
            raise
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2
    except InternalError as exc:
        traceback.print_exc()
        print(f"memfit: internal error, a bug in memfit rather than a mistake of yours: {exc}\nplease report it with "
              "the command line and the traceback above", file=sys.stderr)
        return 70  # EX_SOFTWARE
    except Exception as exc:
        if interrupted():
            return _interrupted()
        where = user_code_error(exc)
        if where is None or debug:
            raise  # memfit's own bug, or --debug: the whole traceback
        shape = getattr(args, "input_shape", None)
        shape = " --input-shape ".join(shape) if isinstance(shape, list) else shape
        hint = f"; does --input-shape {shape} fit the model?" if shape else ""
        print(f"memfit: error: {where}{hint} (run again with --debug for the traceback)", file=sys.stderr)
        return 2


def entry() -> None:
    """The console script: ``main`` with its exit code. After a Ctrl-C the process ends with
    ``os._exit``: a KeyboardInterrupt that once passed through an ``exec`` of a string (dataclasses
    and namedtuples make their methods so) leaves a flag in CPython that turns any later exit into
    death by SIGINT (-2 instead of 130), even though the interrupt was handled."""
    code = main()
    if interrupted():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _interrupted() -> int:
    remove_outputs()
    print("memfit: interrupted; no file written", file=sys.stderr)
    return 130


class _Parser(argparse.ArgumentParser):
    """Usage mistakes as every other mistake: one ``memfit: error:`` line, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"memfit: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="memfit",
        description="Plan activation checkpointing so that a PyTorch training step fits a memory budget "
        "at the least extra time.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from memfit import __version__
    from memfit.planning import SOLVERS, STRATEGY_NAMES

    p.add_argument("--version", action="version", version=f"memfit {__version__}")
    p.add_argument("--debug", action="store_true", help="show the whole traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text, epilog=_epilog(name),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the whole traceback of an error")
        return cmd

    prof = command("profile", "measure a model's training step per unit and write profile JSON")
    _source_args(prof)
    _granularity(prof, "also measure each unit's finer options (children, chains, op sets, derive)")
    prof.add_argument("-o", "--output", default="profile.json", help="profile file to write (default: %(default)s)")
    prof.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    prof.set_defaults(func=commands.cmd_profile)

    plan = command("plan", "profile (or read a profile) and solve for the cheapest schedule within a budget")
    plan.add_argument("--budget", required=True, help="memory budget for the whole step, e.g. 24GB, 1536MB, or a "
                      "share of the unplanned peak, e.g. 60%%")
    plan.add_argument("--profile", help="a profile JSON from `memfit profile` (skips profiling)")
    plan.add_argument("--trust-source", action="store_true",
                    help="rebuild the model that the --profile file names (imports and runs its code); without it, "
                         "only built-in scenarios are rebuilt from a file")
    _source_args(plan)
    plan.add_argument("--strategy", choices=STRATEGY_NAMES,
                      default="ilp", help="ilp (the optimum) or a baseline to use instead (default: %(default)s)")
    plan.add_argument("--solver", choices=SOLVERS, default="cpsat",
                      help="ILP backend: OR-Tools CP-SAT, PuLP/CBC, or the exact DP for chains (default: %(default)s)")
    plan.add_argument("--max-segment", type=int, default=8,
                      help="longest run of units checkpointed as one region, on chains (default: %(default)s)")
    plan.add_argument("--no-segments", action="store_true", help="checkpoint single units only")
    _granularity(plan, "also choose finer options inside units: a child module (attention, MLP), an op set "
                 "(selective checkpointing) or derive (cheap saved outputs re-derived in the backward), each measured "
                 "(needs a fine profile; profiles the model so when none is given)")
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
                      "candidate plan is compiled and its peak measured until one fits")
    plan.add_argument("--timeline", metavar="FILE", help="draw the plan's predicted memory over the step (.png/.svg)")
    _save_profile(plan)
    plan.add_argument("--json", action="store_true", help="print the schedule as JSON instead of tables")
    plan.set_defaults(func=commands.cmd_plan)

    from memfit.planning.sweep import DEFAULT_STRATEGIES

    sw = command("sweep", "plan every strategy at many budgets: the memory-vs-slowdown curve, as a table, CSV "
                 "and plot")
    sw.add_argument("--profile", help="a profile JSON from `memfit profile` (skips profiling)")
    sw.add_argument("--trust-source", action="store_true",
                    help="rebuild the model that the --profile file names (imports and runs its code); without it, "
                         "only built-in scenarios are rebuilt from a file")
    _source_args(sw)
    sw.add_argument("--budgets", help="START:STOP:STEP such as 100MB:500MB:20MB, or a list such as 200MB,300MB "
                    "(default: --points budgets from the smallest feasible peak to the un-checkpointed one)")
    sw.add_argument("--points", type=int, help="how many budgets when --budgets is not given (default: 30)")
    sw.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help="comma-separated: ilp and baselines (default: %(default)s)")
    sw.add_argument("--solver", choices=SOLVERS, default="cpsat",
                    help="ILP backend for units that are not a chain; chains use the exact frontier DP")
    sw.add_argument("--max-segment", type=int, default=8, help="longest checkpointed run of units (default: 8)")
    _save_profile(sw)
    sw.add_argument("--no-segments", action="store_true", help="checkpoint single units only")
    _granularity(sw, "let the ILP choose checkpoints inside units too (as plan --granularity fine)")
    sw.add_argument("--measure", action="store_true",
                    help="run every distinct plan: measured peak and slowdown beside the predicted ones")
    sw.add_argument("--steps", type=int, default=3, help="timed rounds with --measure (default: %(default)s)")
    sw.add_argument("--csv", metavar="FILE", help="write the table as CSV")
    sw.add_argument("--plot", metavar="FILE", help="draw the curve (.png or .svg)")
    sw.add_argument("--device-memory", metavar="SIZE",
                    help="draw the memory a step may use as a line, e.g. 22GB (default: the GPU's usable memory, "
                    "profiled or estimated for one)")
    sw.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    sw.set_defaults(func=commands.cmd_sweep)

    val = command("validate", "run the plain and the scheduled model: measured vs predicted peak and slowdown, "
                  "equal gradients; exits 1 if the peak exceeds the budget, results differ or the measured slowdown "
                  "is off the predicted by more than --time-tolerance")
    val.add_argument("--schedule", required=True, help="a schedule JSON from `memfit plan`")
    val.add_argument("--trust-source", action="store_true",
                    help="rebuild the model that the --schedule file names (imports and runs its code); without it, "
                         "only built-in scenarios are rebuilt from a file")
    _source_args(val, validate=True)
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
    val.set_defaults(func=validate.cmd_validate)

    show = command("show", "print a schedule or profile JSON as tables")
    show.add_argument("file", help="schedule.json or profile.json")
    show.set_defaults(func=commands.cmd_show)

    from memfit.export import FORMS

    exp = command("export", "write a schedule in another tool's form (Hugging Face transformers, torchtitan, PyTorch "
                  "selective checkpointing); what that form cannot express is printed as warnings and kept as "
                  "comments in the file")
    exp.add_argument("schedule", help="a schedule JSON from `memfit plan`")
    exp.add_argument("--to", required=True, choices=FORMS,
                     help="; ".join(f"{k}: {v}" for k, v in FORMS.items()).replace("%", "%%"))
    exp.add_argument("-o", "--output", help="file to write (default: print it)")
    exp.add_argument("--json", action="store_true", help="print {to, file, checkpointed, lost} as JSON (and the "
                     "exported text as 'text' without -o)")
    exp.set_defaults(func=commands.cmd_export)

    scen = command("scenarios", "list the built-in scenarios")
    scen.set_defaults(func=commands.cmd_scenarios)
    return p


def _granularity(p: argparse.ArgumentParser, fine: str) -> None:
    p.add_argument("--granularity", choices=["module", "fine"], default="module",
                   help=f"module: whole units only (default); fine: {fine}")
    p.add_argument("--children", nargs="+", metavar="NAME",
                   help="with --granularity fine: the unit children to offer, by relative name (attn mlp.0 "
                   "attn+mlp), instead of the ones memfit picks")


def _save_profile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-profile", metavar="FILE",
                   help="also keep the profile this run measures, to plan again with --profile FILE without "
                   "profiling (nothing else is written unasked)")


def _source_args(p: argparse.ArgumentParser, *, validate: bool = False) -> None:
    title = ("model (default: the one the schedule was made for)" if validate
             else "model (default: the built-in gpt-750m scenario)")
    g = p.add_argument_group(title)
    g.add_argument("--scenario", help="a built-in scenario name or a scenario .toml file")
    g.add_argument("--model", help="your own model: module:factory returning a model or (model, inputs)")
    g.add_argument("--args", nargs="+", metavar="NAME=VALUE",
                   help="keyword arguments for the factory, typed as in a scenario's [args] (batch=64 image=1024 "
                   "name='tiny' dims=[64,128]); over the scenario's own")
    if validate:
        g.add_argument("--input-shape", help="random input shape when the factory returns only a model, e.g. "
                       "8x3x224x224")
    else:
        g.add_argument("--input-shape", action="append",
                       help="random input shape when the factory returns only a model, e.g. 8x3x224x224; give it "
                       "several times for one schedule with a plan per shape (224 and 384 pixels: --input-shape "
                       "8x3x224x224 --input-shape 8x3x384x384)")
        g.add_argument("--seq-lens", metavar="N,N,...",
                       help="plan for these sequence lengths, one schedule with a plan each, e.g. 512,1024,2048: the "
                       "factory builds the model at the longest (its seq argument) and each length's inputs are "
                       "its inputs cut to it; at run time each batch runs the plan of the shortest planned length "
                       "that covers it (default: the scenario's seq_lens, else its one shape)")
    g.add_argument("--units", nargs="+", help="unit module names or globs (default: the repeated blocks)")
    s = p.add_argument_group("training step (default: the scenario's, else adamw, one micro-batch, its dtype)"
                             + (": by default the one planned for" if validate else ""))
    s.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="optimizer whose state and step count; -foreach / -fused force its kernels (plain: PyTorch's "
                   "choice for the device)")
    s.add_argument("--accumulate", type=int, metavar="N",
                   help="micro-batches per optimizer step (gradient accumulation; the loss divided by N)")
    s.add_argument("--precision", choices=PRECISIONS,
                   help="a pure dtype (the model's), or amp-bf16 / amp-fp16: fp32 weights and optimizer state, "
                   "autocast over forward and loss (a GradScaler for fp16)")
    s.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                   help="clip_grad_norm_ to MAX before each optimizer step")
    s.add_argument("--zero-grad", choices=ZERO_GRADS,
                   help="none: zero_grad(set_to_none=True) (default); zeros: gradients stay allocated")
    s.add_argument("--keep-output", action="store_true", default=None,
                   help="the loop holds the model's output (logits) through the backward, as "
                   "`out = model(**batch); out.loss.backward()` does")
    s.add_argument("--no-autocast-cache", dest="autocast_cache", action="store_false", default=None,
                   help="with amp-*: autocast(cache_enabled=False), as Lightning's bf16-mixed/16-mixed run it")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    if not validate:
        from memfit.devices import DEVICES

        g.add_argument("--target", help=f"estimate for this device without having it, from shapes: "
                       f"{', '.join(DEVICES)} "
                       "(default: measure here; with no GPU here, a scenario's own target)")
        g.add_argument("--device-spec", metavar="FILE",
                       help="a TOML file describing your GPU (name, memory, context, margin, tflops, bandwidth_gbs, or "
                       "base = a built-in to start from): estimate for it, or with --device cuda, plan against its "
                       "context and margin (memfit validate --save-device-spec writes one from a run)")
        g.add_argument("--parallel", choices=PARALLEL,
                       help="plan per rank: measure one of --world-size processes under FSDP2 (fully_shard per unit "
                       "and the root; fsdp-bf16: with MixedPrecisionPolicy, bf16 params, fp32 reduce) or DDP (gloo "
                       "on the CPU, one GPU each with NCCL)")
        g.add_argument("--world-size", type=int, help="ranks for --parallel (default: 2)")
        g.add_argument("--repeat", type=int,
                       help="timed rounds of plain and all-checkpointed steps when profiling (default: 5)")
