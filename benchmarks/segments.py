"""What a segment costs: predicted against measured, for every unit checkpointed alone and for
segments of 2, 3 and all units, beside an A/A control.

    python benchmarks/segments.py                           # nanogpt, 21 rounds, profile of 9
    python benchmarks/segments.py --scenario gpt-small --rounds 25 --repeat 9

A segment recomputes the same kernels as checkpointing each of its units alone, yet measured
dearer (nanoGPT, 2026-12-06: every block alone +20.9%, in pairs +25.9%): a unit checkpointed alone
recomputes right before its own backward, which then finds its tensors in the cache; a member
before a segment's last recomputes before the other members' backwards. The profile prices such a
member from a step of units in pairs (``UnitProfile.member_s``); this prints what that prediction
gives beside the measured slowdowns. One thread, thread CPU time; all plans are timed in one series
(each counted step after an untimed one of its own, the order reversed every round, GC held off);
"±" is two standard errors of the median ratio to the plain step.
"""

from __future__ import annotations

import argparse
import copy

import torch

import memfit
from memfit.policy import FULL
from memfit.profiler.costs import segments
from memfit.report import table
from memfit.runtime.harness import StepHarness
from memfit.scenarios import load_scenario
from memfit.units import find_units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="nanogpt")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (one step of each plan per round)")
    parser.add_argument("--repeat", type=int, default=9, help="timed rounds when profiling")
    args = parser.parse_args()
    torch.set_num_threads(1)  # thread CPU time: half the scatter of wall time on a shared machine
    memfit.keep_freed_cpu_memory()  # as the memfit command does
    sc = load_scenario(args.scenario)
    model, inputs = sc.build()
    names = find_units(model, sc.units)
    prof = memfit.profile(model, inputs, units=names, step=sc.train_step, repeat=args.repeat)
    plans = {"every unit alone": dict.fromkeys(names, FULL), "A/A: every unit alone": dict.fromkeys(names, FULL),
             **{f"segments of {k}": segments(names, k) for k in (2, 3) if k < len(names)},
             f"one segment of {len(names)}": segments(names, len(names))}
    harness = StepHarness(model, inputs, step=sc.train_step)
    with harness.restoring():
        plain_s, ratios, sure = harness.step_times(list(plans.values()), args.rounds)
    as_full = copy.deepcopy(prof)  # the price before members were measured: every member at full's
    for u in as_full.units:
        u.member_s = None
    rows = []
    for (label, policies), ratio, u in zip(plans.items(), ratios, sure, strict=True):
        pred, was = memfit.predict(prof, policies), memfit.predict(as_full, policies)
        rows.append([label, f"{pred.peak_bytes / 2**20:.2f}", f"{100 * was.overhead:+.1f}%",
                     f"{100 * pred.overhead:+.1f}%", f"{100 * (ratio - 1):+.1f}% ±{100 * u:.1f}"])
    print(f"{args.scenario}: plain step {plain_s * 1e3:.1f} ms (thread time), {args.rounds} rounds, "
          f"profile of {args.repeat}")
    print(table(["plan", "peak (MiB)", "priced as full", "predicted", "measured"], rows))


if __name__ == "__main__":
    main()
