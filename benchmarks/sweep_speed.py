"""A 30-budget sweep against one plan() at the middle budget, on one profile each of the default
scenario and a synthetic 80-unit chain (the issue's target: the sweep at most 5x the plan).

    python benchmarks/sweep_speed.py                       # profiles gpt-small first (~25 s)
    python benchmarks/sweep_speed.py --profile p.json      # or an existing profile

Both run in one process, interleaved (the order reverses every round), GC held off while timed,
medians over --rounds rounds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import memfit
from memfit.planning.sweep import sweep
from memfit.planning.synthetic import random_profile
from memfit.report import table


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="profile JSON of the default scenario (default: profile it now)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--points", type=int, default=30)
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()
    if args.profile:
        default = memfit.Profile.load(args.profile)
    else:
        from memfit.scenarios import load_scenario

        model, inputs = load_scenario("gpt-small").build()
        default = memfit.profile(model, inputs)
    rows = []
    for name, prof in (("gpt-small", default), ("synthetic 80-unit chain", random_profile(80, 7))):
        mid = (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2
        jobs = {"plan": lambda p=prof, b=mid: memfit.plan(p, b),
                "sweep": lambda p=prof: sweep(p, points=args.points)}
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for _ in (0, 1):  # warm-up: imports, solver start-up
            for fn in jobs.values():
                fn()
        for r in range(args.rounds):
            for key in (list(jobs) if r % 2 == 0 else list(reversed(jobs))):
                times[key].append(timed(jobs[key]))
        plan_s, sweep_s = statistics.median(times["plan"]), statistics.median(times["sweep"])
        rows.append([name, str(len(prof.units)), f"{plan_s:.3f}", f"{sweep_s:.3f}", f"{sweep_s / plan_s:.1f}x"])
    print(table(["profile", "units", "plan() s", f"sweep({args.points}) s", "ratio"], rows))


if __name__ == "__main__":
    main()
