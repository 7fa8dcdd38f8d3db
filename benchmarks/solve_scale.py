"""Solve time against the number of units, for each backend.

    python benchmarks/solve_scale.py                    # 10, 100, 1000, 5000 units
    python benchmarks/solve_scale.py --units 10 100 --time-limit 60
    python benchmarks/solve_scale.py --units 80 --fine 3   # issue 11: finer options and segments of up to 8

Synthetic chains (memfit.planning.synthetic) with MiB-sized figures; "options" is the number of
roles a unit can take: 2 = none/full, 3 = also segments of 2 units, 4 = segments of up to 3;
with ``--fine K``, "2+K fine, seg<=8" adds K finer options per unit and segments of up to 8
(what ``plan --granularity fine`` solves).
The budget is halfway between the smallest feasible peak and the un-checkpointed one. Each cell
is one solve (with one worker for CP-SAT, as memfit runs it), in seconds; "-" means skipped,
">60" that the time limit passed with no answer, "(feasible)" an answer without a proof of
optimality. The first CP-SAT call includes OR-Tools' start-up (about 0.4 s).
"""

from __future__ import annotations

import argparse
import time

import memfit
from memfit.planning.ilp import solve
from memfit.planning.intmodel import IntModel
from memfit.planning.synthetic import random_profile
from memfit.report import table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, nargs="+", default=[10, 100, 1000, 5000])
    parser.add_argument("--solvers", nargs="+", default=["cpsat", "cbc", "dp"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--dp-max", type=int, default=100, help="largest chain given to the DP (its front grows fast)")
    parser.add_argument("--fine", type=int, default=0, help="also: this many finer options per unit, segments <= 8")
    args = parser.parse_args()
    rows = []
    for n in args.units:
        configs = [("2", 1, 0), ("3", 2, 0), ("4", 3, 0)]
        if args.fine:
            configs.append((f"2+{args.fine} fine, seg<=8", 8, args.fine))
        for options, max_segment, fine in configs:
            prof = random_profile(n, seed=n, scale=2**20, fine=fine)
            model = IntModel.of(prof, segments=max_segment > 1, max_segment=max(2, max_segment), fine=fine > 0)
            least = solve(model, None, solver="cbc", minimize="peak")
            assert least is not None
            budget = (least.objective * model.quantum + memfit.predict(prof, {}).peak_bytes) // 2
            row = [str(n), options]
            objectives = set()
            for solver in args.solvers:
                if solver == "dp" and n > args.dp_max:
                    row.append("-")
                    continue
                t0 = time.perf_counter()
                try:
                    sol = solve(model, budget, solver=solver, time_limit=args.time_limit)
                except memfit.MemfitError:
                    row.append(f">{args.time_limit:.0f}")
                    continue
                seconds = time.perf_counter() - t0
                assert sol is not None
                if sol.status == "optimal":
                    objectives.add(sol.objective)
                row.append(f"{seconds:.3f}" + ("" if sol.status == "optimal" else " (feasible)"))
            row.append("yes" if len(objectives) <= 1 else "NO")
            rows.append(row)
            print(" | ".join(row), flush=True)
    print()
    print(table(["units", "options", *args.solvers, "same optimum"], rows))


if __name__ == "__main__":
    main()
