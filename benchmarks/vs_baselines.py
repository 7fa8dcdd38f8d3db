"""The ILP plan against every baseline strategy, measured, at budgets across the feasible range.

    python benchmarks/vs_baselines.py                         # gpt-small, cnn-mixed, cnn-group
    python benchmarks/vs_baselines.py gpt-small --budgets 8 --steps 5

For each budget: the plan of each strategy that fits (ilp, every-k, sqrt, first-k, greedy,
full), its measured peak (CPU live-tensor accounting) and its measured slowdown against the
un-checkpointed step (median over rounds, memfit.steps.validate.step_times). Identical plans
are measured once. The last column is recompute time of the ILP / best fitting baseline (predicted; 1.00 =
as good, < 1 = better). "cnn-group" is cnn-mixed with GroupNorm.
"""

from __future__ import annotations

import argparse
import copy

import memfit
from memfit.planning import STRATEGY_NAMES
from memfit.policy import Policies
from memfit.report import table
from memfit.runtime.apply import set_policies
from memfit.runtime.harness import measure_steps
from memfit.scenarios import load_scenario
from memfit.steps.validate import step_times


def build(name: str):  # type: ignore[no-untyped-def]
    if name == "cnn-group":
        sc = load_scenario("cnn-mixed")
        sc.args["norm"] = "group"
    else:
        sc = load_scenario(name)
    model, inputs = sc.build()
    return sc, model, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=["gpt-small", "cnn-mixed", "cnn-group"])
    parser.add_argument("--budgets", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()  # as the memfit command does: steady, additive CPU step times
    rows = [row for name in args.scenarios for row in scenario_rows(name, args.budgets, args.steps)]
    heads = [s for s in STRATEGY_NAMES if s != "none"]
    print()
    print(table(["scenario", "budget", *heads, "ILP/best"], rows))


def scenario_rows(name: str, budgets: int, steps: int) -> list[list[str]]:
    rows = []
    sc, model, inputs = build(name)
    opt = sc.step_optimizer
    prof = memfit.profile(model, inputs, units=sc.units, optimizer=opt, repeat=5)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    measured: dict[tuple[str, ...], tuple[int, float]] = {}

    def measure(policies: Policies) -> tuple[int, float]:
        key = tuple(policies.values())
        if key not in measured:
            twin = copy.deepcopy(model)
            set_policies(twin, policies)
            peak = measure_steps(twin, inputs, optimizer=opt).peak_bytes
            _, (ratio,) = step_times(model, inputs, [policies], optimizer=opt, steps=steps)
            measured[key] = (peak, ratio - 1.0)
        return measured[key]

    for b in range(budgets):
        budget = int(lo + (hi - lo) * b / max(1, budgets - 1))
        cells, ilp_s, best_s = [], None, None
        for strategy in STRATEGY_NAMES:
            if strategy == "none":
                continue
            try:
                sched = memfit.plan(prof, budget, strategy=strategy)
            except memfit.InfeasibleBudgetError:
                cells.append("-")
                continue
            peak, slow = measure(sched.policies)
            cells.append(f"{memfit.format_bytes(peak)} {slow * 100:+.0f}%")
            if strategy == "ilp":
                ilp_s = sched.predicted_recompute_s
            elif best_s is None or sched.predicted_recompute_s < best_s:
                best_s = sched.predicted_recompute_s
        ratio = "-" if best_s is None or not best_s else f"{ilp_s / best_s:.2f}"
        rows.append([name, memfit.format_bytes(budget), *cells, ratio])
        print(" | ".join(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
