"""Predicted vs measured peak memory and slowdown, per scenario, at budgets spread between the
smallest feasible peak and the un-checkpointed one.

    python benchmarks/fidelity.py                          # every built-in scenario, 5 budgets
    python benchmarks/fidelity.py gpt-small --budgets 5 --repeat 10 --steps 20
    python benchmarks/fidelity.py gpt-small nanogpt --granularity fine   # fine plans, from a fine profile

Prints one row per (scenario, budget) and a summary. Peaks, losses, gradients and buffers come
from memfit.validate; the slowdowns of all of a scenario's plans are measured in one series of
rounds (plain, then each plan, each counted step following one of its own; the order reverses
every round), each plan's step against the plain step of its round
(memfit.steps.validate.step_times). The plan with nothing
checkpointed is timed too: its "slowdown" shows the measurement's own noise.
"""

from __future__ import annotations

import argparse
import time

import torch

import memfit
from memfit.report import table
from memfit.scenarios import builtin_names, load_scenario
from memfit.steps.validate import step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=builtin_names())
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each plan per round)")
    parser.add_argument("--repeat", type=int, default=10, help="timed rounds when profiling")
    parser.add_argument("--granularity", default="module", choices=["module", "fine"])
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    memfit.keep_freed_cpu_memory()  # as the memfit command does: steady, additive CPU step times
    rows, worst_mem, worst_time = [], 0.0, 0.0
    for name in args.scenarios:
        sc = load_scenario(name)
        model, inputs = sc.build()
        opt = sc.step_optimizer
        t0 = time.perf_counter()
        prof = memfit.profile(model, inputs, units=sc.units, optimizer=opt, repeat=args.repeat,
                              granularity=args.granularity)
        prof_s = time.perf_counter() - t0
        lo, hi = memfit.min_budget_bytes(prof, fine=args.granularity == "fine"), memfit.predict(prof, {}).peak_bytes
        budgets = [int(lo + (hi - lo) * k / max(1, args.budgets - 1)) for k in range(args.budgets)]
        plans = [memfit.plan(prof, b, granularity=args.granularity) for b in budgets]
        checks = [memfit.validate(model, inputs, p, optimizer=opt, steps=0) for p in plans]
        # every plan timed in one series with shared plain steps (see memfit.steps.validate.step_times)
        _, ratios = step_times(model, inputs, [p.policies for p in plans], optimizer=opt, steps=args.steps)
        for budget, sched, v, ratio in zip(budgets, plans, checks, ratios, strict=True):
            worst_mem = max(worst_mem, abs(v.error))
            worst_time = max(worst_time, abs(sched.predicted_overhead - (ratio - 1)))
            sure = sched.predicted_uncertainty_s / prof.step_s if prof.step_s > 0 else 0.0
            rows.append([
                name, memfit.format_bytes(budget), memfit.format_bytes(v.predicted_peak_bytes),
                memfit.format_bytes(v.measured_peak_bytes), f"{v.error * 100:+.3f}%", "yes" if v.fits else "NO",
                f"{len(sched.checkpointed)}/{len(sched.policies)}",
                f"{sched.predicted_overhead * 100:+.1f}% ±{sure * 100:.1f}", f"{(ratio - 1) * 100:+.1f}%",
                "yes" if v.grads_equal and v.losses_equal and v.buffers_equal else "NO",
            ])
        print(f"{name}: profiled in {prof_s:.1f} s, step {prof.step_s * 1e3:.0f} ms", flush=True)
    print(table(["scenario", "budget", "predicted", "measured", "error", "fits", "ckpt", "slowdown pred",
                 "slowdown meas", "equal"], rows))
    print(f"\nworst |peak error| {worst_mem * 100:.3f}%; worst |slowdown error| {worst_time * 100:.1f} pp")


if __name__ == "__main__":
    main()
