"""Rockmate at memfit's memory levels, run by ``benchmarks/peers.py --rockmate-python PATH`` in
the user's own Rockmate environment (Rockmate is no dependency of memfit):

    PATH/to/python benchmarks/rockmate_worker.py --scenario gpt-small --levels B1 B2 ... --rounds 9 --out r.json

Only memfit's light modules are imported (scenarios, the training step, the timing and the
memory meter): ortools, pulp and pandas need not be installed there. The scenario's model is built
on the CPU as peers.py builds it. Rockmate sees the model (tensor inputs, one tensor output; the
loss taken outside, as its README does: see ``for_rockmate``), through
``rockmate.from_config(model, inputs, budget, config_type="rockmate")``, and, as its README says,
a budget for activations: the level less the parameters, their gradients, the optimizer state
and the inputs. Each module built is measured with memfit's meter (plus what
Rockmate holds between steps), its gradients compared with a plain copy's, and all are timed with
the plain step in one interleaved series: slowdowns are ratios to this process's plain step.

The JSON written has ``error`` (Rockmate or memfit's modules did not import) or ``rows``, one a
level: a built module's numbers, or ``why`` not. The exit status is 0 either way.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import io
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # memfit from this checkout; peer_tools beside this file


def write(path: str, data: dict[str, Any]) -> None:
    """JSON to ``path`` atomically: a temporary file beside it, renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=".rockmate-", suffix=".json", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True, help="a built-in scenario's name or a .toml file")
    parser.add_argument("--levels", type=int, nargs="+", required=True, help="memory levels in bytes (whole step)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", required=True, help="the JSON result")
    args = parser.parse_args()
    where = f"{sys.executable} (Python {sys.version.split()[0]})"
    try:  # memfit's light modules first: they need torch, never a solver
        import torch  # noqa: F401

    except Exception as exc:
        write(args.out, {"error": f"memfit's measuring code does not import under {where}: {first_line(exc)}"})
        return 0
    try:
        import rockmate
    except Exception as exc:
        write(args.out, {"error": f"rockmate does not import under {where}: {first_line(exc)}"})
        return 0
    try:
        result = run(args, rockmate)
    except Exception as exc:  # a row for the caller; the traceback for the reader
        traceback.print_exc()
        result = {"error": f"the Rockmate worker failed under {where}: {first_line(exc)}"}
    write(args.out, result)
    return 0


def run(args: argparse.Namespace, rockmate: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from peer_tools import same_gradients
    from torch import nn

    from memfit.budget import format_bytes
    from memfit.measure.inputs import Inputs, iter_tensors
    from memfit.measure.step import (
        StepState,
        default_loss,
        local,
        static_bytes,
        storage_bytes,
        storage_key,
        training_step,
    )
    from memfit.measure.timing import alternate, median_ratio, timed_step
    from memfit.runtime.harness import measure_steps
    from memfit.scenarios import load_scenario
    from memfit.zoo import GPT

    class Unsupported(Exception):
        pass

    class Rocked(nn.Module):
        """A Rockmate module in memfit's training step: the parameters are the original model's
        (as the optimizer and the gradients see them), the output a dict with the loss, taken
        outside Rockmate (see ``for_rockmate``).

        Rockmate keeps its run-time state in one process-wide ``RK_Storage`` (a singleton), which
        building the next module would reset: each module gets that object's state of its own,
        switched in when it runs, as if each ran in a process of its own."""

        def __init__(self, net: nn.Module, rk: Any, keys: list[str], loss: Callable[..., Any]) -> None:
            super().__init__()
            self.net = net
            object.__setattr__(self, "rk", rk)
            self.keys, self.loss = keys, loss
            self.storage = rk.compiler.storage
            self.state = self.storage.__dict__
            self.storage.__dict__ = {}  # the next module built starts from a state of its own

        def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            self.storage.__dict__ = self.state
            out = self.rk(*args, *(kwargs[k] for k in self.keys))[0]
            return {"loss": self.loss(out, kwargs)}

        def train(self, mode: bool = True) -> Rocked:
            self.rk.train(mode)
            return super().train(mode)

        def held_bytes(self, inputs: Inputs) -> int:
            """What Rockmate holds between steps beyond the parameters, their gradients and the
            inputs (the meter counts what a step allocates, not what was there before it)."""
            params = list(self.net.parameters())
            known = [*params, *self.net.buffers(), *(p.grad for p in params if p.grad is not None), *inputs.tensors()]
            tensors = []
            for t in iter_tensors(list(self.state.get("ld", {}).values())):
                tensors += [t, t.grad] if t.is_leaf and t.grad is not None else [t]
            return storage_bytes(tensors, exclude={storage_key(local(t).untyped_storage()) for t in known})

    def for_rockmate(model: nn.Module, inputs: Inputs) -> tuple[nn.Module, list[Any], list[str], Callable[..., Any]]:
        """``model`` as Rockmate takes it (named tensor arguments, read from the signature; one
        tensor out: the model's first floating-point output), its example inputs, the keyword
        inputs it takes, and the loss outside it.

        Rockmate disables every operation with "loss" in its name (its marker for the end of the
        forward pass: ``refine`` in rockmate/simulation.py), so a loss computed inside the module
        comes out empty. As its README does, the loss is taken outside, on the output: the zoo
        GPT's own cross-entropy against its ``targets``; for a model that computes no loss,
        memfit's default (the output's mean square)."""
        if isinstance(model, GPT) and "targets" in inputs.kwargs:
            def loss(out: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
                return F.cross_entropy(out.flatten(0, 1), kw["targets"].flatten())  # as GPT.forward takes it
            keys = [k for k in inputs.kwargs if k != "targets"]
        elif "labels" in inputs.kwargs:
            raise Unsupported("the model computes its own loss from labels inside, where Rockmate would disable it "
                              "(every operation named *loss*); this worker takes the loss outside for memfit.zoo "
                              "models only")
        else:
            def loss(out: torch.Tensor, kw: dict[str, Any]) -> torch.Tensor:
                return default_loss(out)
            keys = list(inputs.kwargs)
        n = len(inputs.args)
        names = [f"arg{k}" for k in range(n)] + keys
        call = ", ".join(names[:n] + [f"{k}={k}" for k in keys])
        scope: dict[str, Any] = {"first": lambda out: next(t for t in iter_tensors(out) if t.is_floating_point())}
        exec(f"def forward(self, {', '.join(names)}):\n    return first(self.model({call}))\n", scope)
        module = type("Net", (nn.Module,), {"forward": scope["forward"]})()
        module.model = model
        return module, [*inputs.args, *(inputs.kwargs[k] for k in keys)], keys, loss

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    sc = load_scenario(args.scenario)
    model, raw = sc.build("cpu")
    inputs = Inputs.of(raw)
    plain = copy.deepcopy(model)
    plain_run = measure_steps(plain, raw, optimizer=sc.step_optimizer)
    plain_opt = StepState(sc.train_step, plain)
    training_step(plain, inputs, default_loss, plain_opt)  # the optimizer state, as it lives across steps
    fixed = static_bytes(plain, plain_opt, inputs) + storage_bytes(p.grad for p in plain.parameters()
                                                                    if p.grad is not None)
    say(f"rockmate worker: plain step {format_bytes(plain_run.peak_bytes)}; parameters, gradients, optimizer "
        f"state and inputs {format_bytes(fixed)}")

    rows: list[dict[str, Any]] = []
    built: list[tuple[dict[str, Any], Rocked]] = []
    for level in args.levels:  # every module built before any runs (see Rocked)
        budget = level - fixed
        row: dict[str, Any] = {"level": level, "budget": budget}
        rows.append(row)
        if budget <= 0:
            row["why"] = (f"the level leaves nothing for activations: parameters, gradients, optimizer state and "
                          f"inputs take {format_bytes(fixed)}")
            continue
        started = time.perf_counter()
        try:
            net, example, keys, loss = for_rockmate(copy.deepcopy(model), inputs)
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # its progress chatter
                warnings.simplefilter("ignore")
                rk = rockmate.from_config(net, example, budget, config_type="rockmate")
        except Unsupported as exc:
            row["why"] = str(exc)
            continue
        except Exception as exc:
            row["why"] = f"Rockmate raised {first_line(exc)}"
            say(f"rockmate at {format_bytes(level)}: {row['why']}")
            continue
        row["plan_s"] = time.perf_counter() - started
        if rk.op_sched is None or rk.compiler is None:
            row["why"] = f"Rockmate found no schedule within {format_bytes(budget)} for activations"
        else:
            # its own account of the plan: the peak it predicts, forward operations run again
            fwd = [op.name for op in rk.op_sched.op_list
                   if type(op).__name__ == "ComputeOp" and "FWD" in op.name and not op.disabled]
            row.update(predicted=int(rk.op_sched.peak_mem), forward_ops=len(set(fwd)),
                       recomputed=len(fwd) - len(set(fwd)))
            built.append((row, Rocked(net, rk, keys, loss)))
        say(f"rockmate at {format_bytes(level)}: planned in {row['plan_s']:.1f} s" + (
            f"; {row['why']}" if "why" in row else ""))

    for row, rocked in list(built):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                measured = measure_steps(rocked, raw, optimizer=sc.step_optimizer)
        except Exception as exc:
            row["why"] = f"Rockmate's module failed in a training step: {first_line(exc)}"
            built.remove((row, rocked))
            continue
        row["held"] = rocked.held_bytes(inputs)
        measured.peak_bytes += row["held"]
        row["peak"] = measured.peak_bytes
        row["equal"] = same_gradients(plain_run, measured)
        say(f"rockmate at {format_bytes(row['level'])}: measured {format_bytes(row['peak'])}, gradients "
            f"equal: {row['equal']}")

    runs = [(plain, plain_opt)] + [(r, StepState(sc.train_step, r)) for _, r in built]

    def step(k: int) -> float:
        m, opt = runs[k]
        return timed_step(m, inputs, default_loss, opt, torch.device("cpu"))

    times = alternate(step, len(runs), args.rounds) if built else [[]]
    plain_s = statistics.median(times[0]) if built else None
    for (row, _), t in zip(built, times[1:], strict=True):
        row.update(step_s=statistics.median(t), plain_step_s=plain_s, slowdown=median_ratio(times[0], t) - 1)
    try:
        version = importlib.metadata.version("rockmate")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"python": sys.executable, "torch": torch.__version__, "rockmate": version, "scenario": sc.name,
            "rounds": args.rounds, "plain": {"peak": plain_run.peak_bytes, "step_s": plain_s, "fixed": fixed},
            "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
