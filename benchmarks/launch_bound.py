"""The launch-bound regime: models of tiny tensors, where an ATen op takes a few microseconds and
what a GPU's host feels is memfit's own machinery, not the kernels it re-runs.

    python benchmarks/launch_bound.py                       # gpt, nanogpt, vit, resnet; 21 rounds (~6 min)
    python benchmarks/launch_bound.py --models gpt --rounds 31

Each model, single-threaded, every unit under one option at a time: plain (twice: the second is
the A/A control, the noise of the series), ``torch.utils.checkpoint`` around every unit (PyTorch's
own, the reference for ``full``), and memfit's options set with ``set_policies``. Every
configuration is built at once and timed in one interleaved series (``measure.timing.alternate``:
each timed step after an untimed step of its own, order reversed every round, GC held off) by
the thread's CPU time; medians of the per-round ratio to plain, ± two standard errors.

Columns: ``ops``: ATen ops in one step (counted once under a counting dispatch mode, untimed);
``re-run``: ops more than the plain step's, the kernels the option runs again; ``re-run ms``: those
ops at the plain step's mean time per op (an estimate: the re-run ops are mostly cheap ones, so it
errs high); ``own ms``: the measured extra time less that estimate, memfit's (or checkpoint's) own
cost, also per unit and per op of the step. ``grads``: the option's gradients after one step equal
the plain model's (bit for bit).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit import zoo
from memfit.measure.step import Inputs, StepState, default_loss, training_step
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainty, timed_step
from memfit.report import table
from memfit.runtime.apply import set_policies
from memfit.torch_private import TorchDispatchMode
from memfit.trainstep import TrainStep
from memfit.units import find_units

OPTIONS = ["full", "derive", "derive:products", "selective:gemm", "selective:weights"]


def models() -> dict[str, Callable[[], tuple[nn.Module, Any, list[str]]]]:
    def gpt() -> tuple[nn.Module, Any, list[str]]:
        m, x = zoo.gpt(batch=2, seq=16, vocab=64, d_model=32, n_head=2, n_layer=8, dropout=0.0)
        return m, x, ["child:ln_1>attn.qkv+ln_2>mlp.0+mlp.1>mlp.2"]

    def nanogpt() -> tuple[nn.Module, Any, list[str]]:
        m, x = zoo.nanogpt(batch=2, seq=16, vocab=64, d_model=32, n_head=2, n_layer=8, dropout=0.0)
        return m, x, []

    def vit() -> tuple[nn.Module, Any, list[str]]:
        from memfit import hf

        m, x = hf.vit(batch=2, image=32, patch=8, n_layer=6, hidden=32, n_head=2, classes=10, attention="eager")
        return m, x, []

    def resnet() -> tuple[nn.Module, Any, list[str]]:
        m, x = zoo.cnn(batch=2, image=16, widths=(8, 8, 16, 16), classes=10)
        return m, x, []

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


def bench(label: str, build: Callable[[], tuple[nn.Module, Any, list[str]]], rounds: int) -> None:
    model, raw, extra = build()
    inputs = Inputs.of(raw)
    names = find_units(model, "auto")
    step = TrainStep(optimizer="sgd")
    configs: dict[str, nn.Module] = {"plain": copy.deepcopy(model), "plain (A/A)": copy.deepcopy(model),
                                     "torch checkpoint": _checkpointed(copy.deepcopy(model), names)}
    for option in OPTIONS + extra:
        m = copy.deepcopy(model)
        try:
            set_policies(m, dict.fromkeys(names, option))
            m.train()
            training_step(m, inputs, default_loss, StepState(step, m))
        except Exception as exc:  # an option that does not apply to this model
            print(f"{label}: {option} skipped ({type(exc).__name__}: {str(exc)[:80]})")
            continue
        configs[option] = m
    states, ops, grads = {}, {}, {}
    for key, m in configs.items():
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
        grads[key] = [p.grad for p in m.parameters()]
    keys = list(configs)
    cpu = torch.device("cpu")
    times = alternate(lambda k: timed_step(configs[keys[k]], inputs, default_loss, states[keys[k]], cpu),
                      len(keys), rounds)
    plain = times[0]
    plain_s = statistics.median(plain)
    per_op = plain_s / ops["plain"]
    rows = []
    for key, t in zip(keys, times, strict=True):
        ratio = median_ratio(plain, t)
        extra_s = (ratio - 1) * plain_s
        rerun = ops[key] - ops["plain"]
        own = extra_s - rerun * per_op
        same = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads[key], strict=True))
        slower = f"{(ratio - 1) * 100:+.1f}% ±{ratio_uncertainty(plain, t) * 100:.1f}"
        rows.append([key, f"{statistics.median(t) * 1e3:.2f}", slower,
                     str(ops[key]), str(rerun), f"{rerun * per_op * 1e3:.2f}", f"{own * 1e3:+.2f}",
                     f"{own / len(names) * 1e6:+.0f}", f"{own / ops['plain'] * 1e6:+.2f}", "yes" if same else "NO"])
    print(f"\n{label}: {len(names)} units, plain step {plain_s * 1e3:.2f} ms, {ops['plain']} ops "
          f"({per_op * 1e6:.1f} µs/op), {rounds} rounds, thread CPU time")
    print(table(["config", "step ms", "vs plain", "ops", "re-run", "re-run ms", "own ms", "own µs/unit",
                 "own µs/op", "grads"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(models()), choices=list(models()))
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        bench(name, models()[name], args.rounds)


if __name__ == "__main__":
    main()
