"""The project's device check: measure the built-in scenarios for real, plan three budgets each,
validate every plan, and set the estimate beside the measurement.

    python benchmarks/gpu_check.py                         # on a CUDA machine: every scenario that fits
    python benchmarks/gpu_check.py --device cpu --scenarios gpt-small cnn-mixed --steps 2   # the same on the CPU

For each scenario, in its own training step and again with amp-bf16 and 2 micro-batches (the
step people train with; ``--no-variants`` leaves that out): the measured profile
(``memfit.profile``) and the estimated one (``estimate``, for the device spec whose name matches
this GPU, or --target); three budgets between the smallest feasible peak and the un-checkpointed
one; for each, the plan's predicted peak and slowdown beside ``memfit.validate``'s measured ones,
on CUDA the allocator's reserved peak and the memory outside it (the figures a device spec's
context and margin are learned from), and the estimated profile's prediction of the same plan.
Scenarios whose plain step does not fit the device are skipped.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

import memfit
from memfit.budget import format_bytes
from memfit.devices import DEVICES
from memfit.profiler.estimate import estimate
from memfit.report import table
from memfit.scenarios import builtin_names, load_scenario
from memfit.steps.validate import measure_levels

# their plain step needs 63 GiB and more, or 8 ranks: run them by name on a large GPU
SKIP = {"llama2-7b", "llama3-8b", "llama3-8b-fsdp"}


def target_for(device: str) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    for spec in DEVICES.values():
        if spec.cuda and spec.title.lower() in name:
            return spec.name
    return "h100"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scenarios", nargs="+", help="default: every built-in one that fits")
    parser.add_argument("--target", help="the device spec to estimate for (default: the one matching this GPU)")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds per validation")
    parser.add_argument("--no-variants", action="store_true", help="each scenario's own step only")
    add_run_flags(parser, "scenario")
    args = parser.parse_args()
    target = args.target or target_for(args.device)
    print(fill_check(args.device), flush=True)
    rows: list[list[str]] = []
    began = time.perf_counter()
    for name in args.scenarios or sorted((n for n in builtin_names() if n not in SKIP), key=_size_order):
        if time.perf_counter() - began > args.deadline:
            print(f"{name}: not started (deadline)", flush=True)
            continue
        base = load_scenario(name)
        steps = [base.train_step]
        if not args.no_variants and (base.precision, base.accumulate) != ("amp-bf16", 2):
            steps.append(replace(base.train_step, precision="amp-bf16", accumulate=2))
        for step in steps:
            sc = replace(base, dtype="float32") if step.precision == "amp-bf16" else base
            label = f"{name} ({step.describe()})"
            try:
                rows += _check(sc, step, label, target, args)
            except (torch.OutOfMemoryError, memfit.MemfitError) as exc:
                print(f"{label}: skipped ({str(exc).splitlines()[0][:100]})", flush=True)
            except Exception:  # one scenario's failure is a finding, not the end of the run
                print(f"{label}: FAILED", flush=True)
                traceback.print_exc()
            gc.collect()  # a model in a reference cycle holds its memory until collected
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            if args.out:
                with open(args.out, "w") as f:
                    f.write(_title(args.device, target) + "\n\n" + markdown(HEADS, rows))
    print("\n" + _title(args.device, target))
    print(table(HEADS, rows))


HEADS = ["scenario (step)", "budget", "predicted", "allocated", "error", "reserved", "margin", "context",
         "pred. slowdown", "meas. slowdown", "estimated", "est. error", "est. slowdown", "validate"]


def _check(sc: Any, step: Any, label: str, target: str, args: argparse.Namespace) -> list[list[str]]:
    """One scenario's step: measured profile, three plans validated, the estimate's prediction of each."""
    model, inputs = sc.build(args.device)
    started = time.perf_counter()
    prof = memfit.profile(model, inputs, units=sc.units, step=step)
    took = time.perf_counter() - started
    try:
        est = estimate(lambda: sc.build("cpu"), target=target, units=sc.units, step=step)
    except Exception:
        print(f"{label}: the estimate FAILED", flush=True)
        traceback.print_exc()
        est = None
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    rows = []
    for frac in (0.2, 0.5, 0.8):
        sched = memfit.plan(prof, int(lo + frac * (hi - lo)))
        v = memfit.validate(model, inputs, sched, steps=args.steps)
        guess = memfit.predict(est, sched.policies) if est is not None else None
        rows.append([label, format_bytes(sched.budget_bytes), format_bytes(v.predicted_peak_bytes),
                     format_bytes(v.measured_peak_bytes), f"{v.error * 100:+.2f}%",
                     format_bytes(v.cuda["reserved_peak_bytes"]) if v.cuda else "-",
                     f"{v.margin * 100:+.1f}%" if v.margin is not None else "-",
                     format_bytes(v.context_bytes) if v.context_bytes is not None else "-",
                     f"{v.predicted_overhead * 100:+.1f}%", f"{v.measured_overhead * 100:+.1f}%",
                     format_bytes(guess.peak_bytes) if guess else "-",
                     f"{(guess.peak_bytes - v.measured_peak_bytes) / v.measured_peak_bytes * 100:+.2f}%"
                     if guess else "-", f"{guess.overhead * 100:+.1f}%" if guess else "-",
                     "ok" if v.ok else "FAILED: " + _why(v)])
        print(" | ".join(rows[-1]), f"(profiled in {took:.0f} s; gradients differ by at most {v.max_grad_diff:.3g}, "
              f"the plain step from itself by {v.plain_grad_diff:.3g})", flush=True)
        if v.measured_peak_bytes > v.predicted_peak_bytes or args.phases:
            print("  where measured exceeds predicted:", phase_gaps(model, inputs, sched), flush=True)
    return rows


def fill_check(device: str) -> str:
    """``derive:products`` re-makes dropout's masks from the generator's state (runtime/derive_rng.Fill):
    on CUDA through the fused ``native_dropout``, which the CPU tests run only by calling it directly.
    A nanoGPT with dropout, every block under it, three SGD steps against a plain copy: the bytes the
    first block sheds beyond ``derive`` (its masks and probabilities) and whether losses and
    gradients are bit-equal."""
    import copy

    from memfit import zoo
    from memfit.policy import parse
    from memfit.runtime.apply import set_policies
    from memfit.runtime.derive import Derive
    from memfit.units import find_units

    model, batch = zoo.nanogpt(batch=4, seq=64, vocab=256, d_model=64, n_head=4, n_layer=3, dropout=0.1)
    model, batch = model.to(device), {k: v.to(device) for k, v in batch.items()}
    names = find_units(model, "auto")
    shed = []
    for level in (0, 1):
        d = Derive(model.get_submodule(names[0]), level)
        model(**batch).backward()
        d.remove()
        shed.append(d.derived_bytes)
    model.zero_grad(set_to_none=True)
    twin = copy.deepcopy(model)
    set_policies(twin, dict.fromkeys(names, parse("derive:products")))
    results = []
    for m in (model, twin):
        torch.manual_seed(0)
        if device.startswith("cuda"):
            torch.cuda.manual_seed(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = m(**batch)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        results.append((losses, [p.grad for p in m.parameters()]))
    same = all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True)) and all(
        torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    return (f"dropout re-made on {device}: derive:products sheds {shed[1] - shed[0]:,} bytes a block beyond "
            f"derive; 3 steps {'bit-equal' if same else 'DIFFER'} to the plain copy")


def phase_gaps(model: Any, inputs: Any, sched: Any, loss_fn: Any = None, top: int = 4) -> str:
    """The phases whose measured peak most exceeds the plan's, with the live level's difference at
    their start: where a measured step rose above its prediction."""
    measured = measure_levels(model, inputs, sched, loss_fn=loss_fn, step=sched.train_step)
    plan = sched.levels.get("plan", [])
    if len(measured) != len(plan):
        return f"(marks differ: {len(measured)} measured, {len(plan)} planned)"
    gaps = sorted(((m[2] - p[2], m[0], m[1] - p[1]) for m, p in zip(measured, plan, strict=True)), reverse=True)
    return "; ".join(f"{name}: peak {d / 2**20:+.3f} MiB, level {lv / 2**20:+.3f} MiB" for d, name, lv in gaps[:top])


def _why(v: Any) -> str:
    return ", ".join(what for what, ok in [("over budget", v.fits), ("reserved", v.reserved_fits),
                                           ("losses", v.losses_equal), ("grads", v.grads_equal),
                                           ("buffers", v.buffers_equal), ("time", v.time_ok)] if not ok)


def _size_order(name: str) -> int:
    """Small scenarios first, so that a deadline cuts the large ones."""
    order = ["gpt-small", "cnn-mixed", "nanogpt", "vit-tiny", "hf-gpt2", "hf-llama", "bert-large", "vit-large",
             "gpt-750m", "gpt2-xl", "gpt-1b"]
    return order.index(name) if name in order else len(order)


def add_run_flags(parser: argparse.ArgumentParser, item: str) -> None:
    """The flags both device checks take (this and vision_check.py): a deadline, the table written
    after each ``item``, the phases where a measured step rose over its prediction."""
    parser.add_argument("--deadline", type=float, default=float("inf"),
                        help=f"seconds after which no new {item} is started")
    parser.add_argument("--out", help=f"also write the table (markdown) to this file, after every {item}")
    parser.add_argument("--phases", action="store_true",
                        help="print each plan's phases that most exceed the prediction (always where the peak does)")


def device_title(device: str) -> str:
    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    return f"{where}, torch {torch.__version__}"


def _title(device: str, target: str) -> str:
    return f"{device_title(device)}; estimates for {target}"


def markdown(heads: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads), *("| " + " | ".join(r) + " |" for r in rows)]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
