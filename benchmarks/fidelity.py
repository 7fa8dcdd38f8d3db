"""Predicted vs measured peak memory and slowdown, per scenario, at budgets spread between the
smallest feasible peak and the un-checkpointed one.

    python benchmarks/fidelity.py                          # every built-in scenario, 5 budgets
    python benchmarks/fidelity.py gpt-small --budgets 5 --steps 10

Prints one row per (scenario, budget) and a summary; the slowdown is measured with plain and
scheduled steps in alternation (memfit.runtime.validate.step_times).
"""

from __future__ import annotations

import argparse
import time

import memfit
from memfit.report import table
from memfit.scenarios import builtin_names, load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=builtin_names())
    parser.add_argument("--budgets", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each model per budget")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps when profiling")
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()  # as the memfit command does: steady, additive CPU step times
    rows, worst_mem, worst_time = [], 0.0, 0.0
    for name in args.scenarios:
        sc = load_scenario(name)
        model, inputs = sc.build()
        opt = None if sc.optimizer == "none" else sc.optimizer
        t0 = time.perf_counter()
        prof = memfit.profile(model, inputs, units=sc.units, optimizer=opt, repeat=args.repeat)
        prof_s = time.perf_counter() - t0
        lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
        for k in range(args.budgets):
            budget = int(lo + (hi - lo) * k / max(1, args.budgets - 1))
            sched = memfit.plan(prof, budget)
            v = memfit.validate(model, inputs, sched, optimizer=opt, steps=args.steps)
            worst_mem = max(worst_mem, abs(v.error))
            if sched.checkpointed:
                worst_time = max(worst_time, abs(v.predicted_overhead - v.measured_overhead))
            rows.append([
                name, memfit.format_bytes(budget), memfit.format_bytes(v.predicted_peak_bytes),
                memfit.format_bytes(v.measured_peak_bytes), f"{v.error * 100:+.3f}%", "yes" if v.fits else "NO",
                f"{len(sched.checkpointed)}/{len(sched.policies)}",
                f"{v.predicted_overhead * 100:+.1f}%", f"{v.measured_overhead * 100:+.1f}%",
                "yes" if v.grads_equal and v.losses_equal and v.buffers_equal else "NO",
            ])
        print(f"{name}: profiled in {prof_s:.1f} s, step {prof.step_s * 1e3:.0f} ms", flush=True)
    print(table(["scenario", "budget", "predicted", "measured", "error", "fits", "ckpt", "slowdown pred",
                 "slowdown meas", "equal"], rows))
    print(f"\nworst |peak error| {worst_mem * 100:.3f}%; worst |slowdown error| {worst_time * 100:.1f} pp")


if __name__ == "__main__":
    main()
