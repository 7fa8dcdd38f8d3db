"""The ``memfit`` command: profile, plan, validate, show, export, scenarios. Parses, calls the API, prints."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn

from memfit.cli import plan, show, sweep, validate
from memfit.console import (
    check_interrupt,
    install_interrupt_handler,
    interrupted,
    remove_outputs,
    user_code_error,
)
from memfit.errors import InternalError, MemfitError, MemfitWarning

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
  memfit plan --budget 95% --scenario hf-llama --pp 2   # pipeline stages: a plan per rank for its micro-batches
  memfit plan --budget 95% --scenario hf-llama --pp 2 --parallel fsdp --world-size 4 --tp 2 --target cpu  # on a mesh
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

    p.add_argument("--version", action="version", version=f"memfit {__version__}")
    p.add_argument("--debug", action="store_true", help="show the whole traceback of an error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text, epilog=_epilog(name),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the whole traceback of an error")
        return cmd

    for module in (plan, sweep, validate, show):  # one module per command (plan: profile and plan)
        module.add_parsers(command)
    return p
