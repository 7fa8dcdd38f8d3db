"""The launch-bound regime: models of tiny tensors, where an ATen op takes a few microseconds and
what a GPU's host feels is memfit's own machinery, not the kernels it re-runs.

    python benchmarks/launch_bound.py                       # gpt, nanogpt, vit, resnet; 21 rounds (~5 min)
    python benchmarks/launch_bound.py --models gpt --rounds 31 --json launch_bound.json
    python benchmarks/launch_bound.py --options full --rounds 161   # memfit full vs torch checkpoint (~4 min)

Each model (float32, CPU, one thread), every unit (``units.find_units``) under one option at a
time: plain (twice: the second is the A/A control, the noise of the series), ``torch.utils.checkpoint``
(``use_reentrant=False``) around every unit (PyTorch's own, the reference for ``full``), and
memfit's options set with ``set_policies``: ``full``, ``derive``, ``derive:products``,
``selective:gemm``, ``selective:weights`` and the options on children the profiler offers for the
unit's class (``child:``, ``nested:``, ``derive[:products]@<child>`` with the op set it replaces on
that child beside it, gemm or weights: ``profiler.options.fine_options``; on the units that offer it,
``units`` column).
An option that fails on a model is skipped and said so. Every configuration is a deep copy of the
model, built at once and timed in one interleaved series (``measure.timing.alternate``: each timed
step after an untimed step of its own, order reversed every round, GC held off) by the thread's
CPU time and by the wall clock; medians of the per-round ratio to plain, ± two standard errors
(``measure.timing.ratio_uncertainties``: each configuration's, never below the series' pooled one,
since a few rounds' range can come out narrow by chance). The models: the zoo GPT (SDPA attention), the zoo
nanoGPT (attention written out: where ``derive:products`` and ``selective:weights`` differ), a
Hugging Face ViT (eager attention; needs transformers) and the zoo ResNet (BatchNorm).

Columns: ``step ms``: the median step by thread CPU time; ``vs plain``: its median ratio to plain
(thread time), ± two standard errors; ``wall vs plain``: the same by the wall clock; ``ops``:
ATen ops in one step, forward, backward and optimizer (counted once under a counting dispatch
mode, untimed); ``re-run``: ops more than the plain step's, the kernels the option runs again;
``re-run ms``: those ops at the plain step's *average* time per op (plain step time / plain ops:
an estimate; the re-run ops are mostly cheap ones, so it errs high); ``own ms``: the measured
extra time (thread time) less that estimate, memfit's (or checkpoint's) own cost per step, also
per unit under the option, per op of the plain step and per re-run op. ``grads``: the option's
gradients after one step against the plain model's: ``equal`` (bit for bit), else the largest
absolute difference, ``NO`` where ``torch.testing.assert_close`` fails. Below the table: memfit's
``full`` against ``torch.utils.checkpoint`` round by round (the ratio of the two in each round,
whose median the plain step's own scatter does not blur), and what that is per unit; the same for
each ``derive[:products]@<child>`` against the op set it replaces on that child.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit import zoo
from memfit.jsonio import write_json_atomic
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss, training_step
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainties, ratio_uncertainty
from memfit.policy import Children, Derive, Nested, Selective, parse, read
from memfit.profiler.options import fine_options
from memfit.profiler.saved import unit_facts
from memfit.report import table
from memfit.runtime.apply import set_policies
from memfit.torch_private import TorchDispatchMode
from memfit.trainstep import TrainStep
from memfit.units import find_units

OPTIONS = ["full", "derive", "derive:products", "selective:gemm", "selective:weights"]
Build = Callable[[], tuple[nn.Module, Any]]


def models() -> dict[str, Build]:
    def gpt() -> tuple[nn.Module, Any]:
        return zoo.gpt(batch=2, seq=16, vocab=64, d_model=32, n_head=2, n_layer=8, dropout=0.0)

    def nanogpt() -> tuple[nn.Module, Any]:
        return zoo.nanogpt(batch=2, seq=16, vocab=64, d_model=32, n_head=2, n_layer=8, dropout=0.0)

    def vit() -> tuple[nn.Module, Any]:
        from memfit import hf

        return hf.vit(batch=2, image=32, patch=8, n_layer=6, hidden=32, n_head=2, classes=10, attention="eager")

    def resnet() -> tuple[nn.Module, Any]:
        return zoo.cnn(batch=2, image=16, widths=(8, 8, 16, 16), classes=10)

    return {"gpt": gpt, "nanogpt": nanogpt, "vit": vit, "resnet": resnet}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _checkpointed(model: nn.Module, names: list[str]) -> nn.Module:
    """``torch.utils.checkpoint`` around every unit's forward, as a user writes it."""
    for name in names:
        unit = model.get_submodule(name)
        forward = type(unit).forward

        def run(*args: Any, _unit: nn.Module = unit, _f: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_f, _unit, *args, use_reentrant=False, **kwargs)

        unit.forward = run  # type: ignore[method-assign]
    return model


def _child_options(model: nn.Module, names: list[str], inputs: Inputs) -> list[tuple[str, list[str]]]:
    """The options on a unit's children that the profiler offers (``fine_options``: ``child:``,
    ``nested:``, ``derive@<child>``, ``selective:<op set>@<child>``), each with the units that
    offer it, in the profiler's order; beside each ``derive[:level]@<child>``, the op set on that
    child that it replaces in the profiler's offer (``_op_set_twin``: the same choice at SAC's cost)."""
    probe = copy.deepcopy(model)
    facts = unit_facts(probe, names, inputs, default_loss)
    fine = fine_options(probe, names, inputs, default_loss, facts.saved)
    out: dict[str, list[str]] = {}
    for n in names:
        for o in fine[n]:
            if isinstance(o, Children | Nested) or (isinstance(o, Derive | Selective) and o.child):
                out.setdefault(str(o), []).append(n)
                if isinstance(o, Derive) and o.child:
                    out.setdefault(str(_op_set_twin(o)), []).append(n)
    return list(out.items())


def _op_set_twin(option: Derive) -> Selective:
    """The op set a ``derive`` level on a child replaces in the profiler's offer: gemm for
    ``derive@<child>``, weights (recomputing dropout under its RNG state too) for deeper ones."""
    return Selective("gemm" if option.level == 0 else "weights", option.child)


def _timed(model: nn.Module, inputs: Inputs, state: StepState) -> tuple[float, float]:
    """One training step from the loop's ``zero_grad``: (thread CPU seconds, wall seconds)."""
    state.zero_grad()
    t0, w0 = time.thread_time(), time.perf_counter()
    training_step(model, inputs, default_loss, state)
    return time.thread_time() - t0, time.perf_counter() - w0


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _grad_check(plain: list[torch.Tensor | None], other: list[torch.Tensor | None]) -> tuple[str, float]:
    """``equal``, the largest absolute difference, or ``NO (...)`` where assert_close fails."""
    if len(plain) != len(other) or any((a is None) != (b is None) for a, b in zip(plain, other, strict=True)):
        return "NO (other parameters)", float("inf")
    pairs = [(a, b) for a, b in zip(plain, other, strict=True) if a is not None and b is not None]
    diff = max((float((a - b).abs().max()) for a, b in pairs), default=0.0)
    if all(torch.equal(a, b) for a, b in pairs):
        return "equal", 0.0
    try:
        for a, b in pairs:
            torch.testing.assert_close(b, a)
    except AssertionError:
        return f"NO ({diff:.1e})", diff
    return f"{diff:.1e}", diff


def _pct(ratio: float, pm: float) -> str:
    return f"{(ratio - 1) * 100:+.1f}% ±{pm * 100:.1f}"


def bench(label: str, build: Build, rounds: int, only: list[str] | None = None) -> dict[str, Any]:
    model, raw = build()
    inputs = Inputs.of(raw)
    names = find_units(model, "auto")
    step = TrainStep(optimizer="sgd")
    configs: dict[str, tuple[nn.Module, list[str]]] = {
        "plain": (copy.deepcopy(model), []), "plain (A/A)": (copy.deepcopy(model), []),
        "torch checkpoint": (_checkpointed(copy.deepcopy(model), names), names)}
    skipped: dict[str, str] = {}
    offered = [(o, names) for o in OPTIONS] + _child_options(model, names, inputs)
    for option, under in [(o, u) for o, u in offered if only is None or o in only]:
        m = copy.deepcopy(model)
        try:
            set_policies(m, dict.fromkeys(under, parse(option)))
            m.train()
            training_step(m, inputs, default_loss, StepState(step, m))
        except Exception as exc:  # an option that does not apply to this model
            skipped[option] = f"{type(exc).__name__}: {str(exc)[:100]}"
            print(f"{label}: {option} skipped ({skipped[option]})")
            continue
        configs[option] = (m, under)
    states, ops, grads = {}, {}, {}
    for key, (m, _) in configs.items():
        m.train()
        states[key] = StepState(step, m)
        torch.manual_seed(0)
        training_step(m, inputs, default_loss, states[key])  # the learning step (derive), untimed
        states[key].zero_grad()
        count = _Count()
        torch.manual_seed(0)
        with count:
            training_step(m, inputs, default_loss, states[key])
        ops[key] = count.n
        grads[key] = _grads(m)
    keys = list(configs)
    times = alternate(lambda k: _timed(configs[keys[k]][0], inputs, states[keys[k]]), len(keys), rounds)
    thread = [[t for t, _ in ts] for ts in times]
    wall = [[w for _, w in ts] for ts in times]
    plain_s = statistics.median(thread[0])
    per_op = plain_s / ops["plain"]
    thread_pm = [0.0, *ratio_uncertainties(thread[0], thread[1:])]
    wall_pm = [0.0, *ratio_uncertainties(wall[0], wall[1:])]
    rows, out = [], {}
    for k, key in enumerate(keys):
        ratio, pm = median_ratio(thread[0], thread[k]), thread_pm[k]
        wall_ratio, wpm = median_ratio(wall[0], wall[k]), wall_pm[k]
        units = len(configs[key][1])
        rerun = ops[key] - ops["plain"]
        own = (ratio - 1) * plain_s - rerun * per_op
        check, diff = _grad_check(grads["plain"], grads[key])
        per_unit = f"{own / units * 1e6:+.0f}" if units else "-"
        per_rerun = f"{own / rerun * 1e6:+.1f}" if rerun > 0 else "-"
        rows.append([key, str(units), f"{statistics.median(thread[k]) * 1e3:.2f}", _pct(ratio, pm),
                     _pct(wall_ratio, wpm), str(ops[key]), str(rerun), f"{rerun * per_op * 1e3:.2f}",
                     f"{own * 1e3:+.2f}", per_unit, f"{own / ops['plain'] * 1e6:+.2f}", per_rerun, check])
        out[key] = {"units": units, "step_ms": statistics.median(thread[k]) * 1e3,
                    "wall_ms": statistics.median(wall[k]) * 1e3, "ratio": ratio, "ratio_pm": pm,
                    "wall_ratio": wall_ratio, "wall_ratio_pm": wpm, "ops": ops[key], "rerun_ops": rerun,
                    "rerun_ms_est": rerun * per_op * 1e3, "own_ms": own * 1e3,
                    "own_us_per_unit": own / units * 1e6 if units else None,
                    "own_us_per_op": own / ops["plain"] * 1e6,
                    "own_us_per_rerun_op": own / rerun * 1e6 if rerun > 0 else None,
                    "grads": check, "grads_max_abs_diff": diff}
    aa = out["plain (A/A)"]
    print(f"\n{label}: {len(names)} units, plain step {plain_s * 1e3:.2f} ms (thread), "
          f"{statistics.median(wall[0]) * 1e3:.2f} ms (wall), {ops['plain']} ops ({per_op * 1e6:.1f} µs/op), "
          f"{rounds} rounds; A/A control {_pct(aa['ratio'], aa['ratio_pm'])} thread, "
          f"{_pct(aa['wall_ratio'], aa['wall_ratio_pm'])} wall")
    print(table(["config", "units", "step ms", "vs plain", "wall vs plain", "ops", "re-run", "re-run ms",
                 "own ms", "own µs/unit", "own µs/op", "own µs/re-run op", "grads"], rows))
    # memfit's full against PyTorch's checkpoint directly, round by round: sharper than the two
    # ratios to plain (the plain step's own scatter drops out)
    if "full" in keys:
        ck, full = thread[keys.index("torch checkpoint")], thread[keys.index("full")]
        vs, vs_pm = median_ratio(ck, full), ratio_uncertainty(ck, full)
        extra_us = (vs - 1) * out["torch checkpoint"]["step_ms"] * 1e3 / len(names)
        print(f"memfit full vs torch checkpoint: {_pct(vs, vs_pm)} ({extra_us:+.0f} µs a unit)")
        out["full"]["vs_checkpoint"], out["full"]["vs_checkpoint_pm"] = vs, vs_pm
    # derive on a child against the gemm op set on that child, which it replaces in the profiler's
    # offer, round by round as well
    for key in keys:
        option = read(key)
        twin = str(_op_set_twin(option)) if isinstance(option, Derive) and option.child else ""
        if twin in keys:
            sac, ours = thread[keys.index(twin)], thread[keys.index(key)]
            vs, vs_pm = median_ratio(sac, ours), ratio_uncertainty(sac, ours)
            less_us = (1 - vs) * out[twin]["step_ms"] * 1e3 / len(configs[key][1])
            print(f"{key} vs {twin}: {_pct(vs, vs_pm)} ({less_us:.0f} µs a unit less)")
            out[key]["vs_op_set"], out[key]["vs_op_set_pm"] = vs, vs_pm
    return {"units": names, "plain_ms": plain_s * 1e3, "plain_ops": ops["plain"], "per_op_us": per_op * 1e6,
            "skipped": skipped, "configs": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(models()), choices=list(models()))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--options", nargs="+", metavar="OPTION",
                        help="only these of memfit's options (plain, its A/A copy and torch checkpoint always run); "
                             "e.g. --options full --rounds 161: memfit's full against PyTorch's checkpoint, sharply")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: bench(name, models()[name], args.rounds, args.options) for name in args.models}
    if args.json:
        write_json_atomic(args.json, {"rounds": args.rounds, "threads": 1, "torch": torch.__version__,
                                      "models": results})


if __name__ == "__main__":
    main()
