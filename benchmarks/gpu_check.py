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
import time
from dataclasses import replace

import torch

import memfit
from memfit.budget import format_bytes
from memfit.devices import DEVICES
from memfit.profiler.estimate import estimate
from memfit.report import table
from memfit.scenarios import builtin_names, load_scenario

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
    args = parser.parse_args()
    target = args.target or target_for(args.device)
    rows = []
    for name in args.scenarios or [n for n in builtin_names() if n not in SKIP]:
        base = load_scenario(name)
        steps = [base.train_step]
        if not args.no_variants and (base.precision, base.accumulate) != ("amp-bf16", 2):
            steps.append(replace(base.train_step, precision="amp-bf16", accumulate=2))
        for step in steps:
            sc = replace(base, dtype="float32") if step.precision == "amp-bf16" else base
            label = f"{name} ({step.describe()})"
            try:
                model, inputs = sc.build(args.device)
                started = time.perf_counter()
                prof = memfit.profile(model, inputs, units=sc.units, step=step)
                took = time.perf_counter() - started
            except (torch.OutOfMemoryError, memfit.MemfitError) as exc:
                print(f"{label}: skipped ({str(exc).splitlines()[0][:100]})", flush=True)
                continue
            est = estimate(lambda sc=sc: sc.build("cpu"), target=target, units=sc.units, step=step)
            lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
            for frac in (0.2, 0.5, 0.8):
                sched = memfit.plan(prof, int(lo + frac * (hi - lo)))
                v = memfit.validate(model, inputs, sched, steps=args.steps)
                guess = memfit.predict(est, sched.policies)
                reserved = format_bytes(v.cuda["reserved_peak_bytes"]) if v.cuda else "-"
                rows.append([label, format_bytes(sched.budget_bytes), format_bytes(v.predicted_peak_bytes),
                             format_bytes(v.measured_peak_bytes), f"{v.error * 100:+.2f}%", reserved,
                             f"{v.margin * 100:+.1f}%" if v.margin is not None else "-",
                             format_bytes(v.context_bytes) if v.context_bytes is not None else "-",
                             f"{v.predicted_overhead * 100:+.1f}%", f"{v.measured_overhead * 100:+.1f}%",
                             format_bytes(guess.peak_bytes),
                             f"{(guess.peak_bytes - v.measured_peak_bytes) / v.measured_peak_bytes * 100:+.2f}%",
                             f"{guess.overhead * 100:+.1f}%", "ok" if v.ok else "FAILED"])
                print(" | ".join(rows[-1]), f"(profiled in {took:.0f} s)", flush=True)
            del model, inputs
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    where = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"
    print(f"\n{where}, torch {torch.__version__}; estimates for {target}")
    print(table(["scenario (step)", "budget", "predicted", "allocated", "error", "reserved", "margin", "context",
                 "pred. slowdown", "meas. slowdown", "estimated", "est. error", "est. slowdown", "validate"], rows))


if __name__ == "__main__":
    main()
