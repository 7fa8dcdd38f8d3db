"""One plan of the default scenario, eager and under torch.compile: measured peak and step time of
the plain and the scheduled step for each way of running it.

    python benchmarks/compile_step.py                      # ILP plan at 400MB, eager vs aot_eager vs inductor
    python benchmarks/compile_step.py --budget 300MB --backends aot_eager

The plan is the eager plan without segments (what runs under torch.compile). Peaks come from
one steady-state step each (memfit.steps.validate.measure_steps); times from one interleaved
series over all configurations, built at once (the order reverses every round, each timed step
follows an untimed step of its own, GC held off), medians over --rounds rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import memfit
from memfit.budget import format_bytes
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss
from memfit.measure.timing import alternate, timed_step
from memfit.report import table
from memfit.runtime.apply import set_policies
from memfit.runtime.harness import measure_steps
from memfit.scenarios import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="400MB")
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    sc = load_scenario("gpt-small")
    model, inputs = sc.build("cpu")
    prof = memfit.profile(model, inputs, units=sc.units, optimizer=sc.step_optimizer, repeat=3)
    schedule = memfit.plan(prof, args.budget, segments=False)
    print(f"plan at {args.budget}: {schedule.checkpointed} checkpointed; eager prediction "
          f"{format_bytes(schedule.predicted_peak_bytes)}, +{schedule.predicted_overhead * 100:.1f}%")
    modes = [None, *args.backends.split(",")]
    configs = []  # (mode, policies name, runner, model copy, optimizer)
    for mode in modes:
        for name, policies in (("plain", {}), ("plan", schedule.policies)):
            m = copy.deepcopy(model)
            set_policies(m, policies)
            peak = measure_steps(m, inputs, optimizer=sc.step_optimizer, compile=mode).peak_bytes
            runner = m if mode is None else torch.compile(m, backend=mode)
            configs.append((mode or "eager", name, runner, m, StepState(sc.train_step, m), peak))
    inp = Inputs.of(inputs)

    def step(k: int) -> float:
        _, _, runner, _model, opt, _ = configs[k]
        return timed_step(runner, inp, default_loss, opt, torch.device("cpu"))

    for k in range(len(configs)):
        step(k)  # compiles
    times = alternate(step, len(configs), args.rounds)
    rows = []
    for k, (mode, name, _, _, _, peak) in enumerate(configs):
        plain = times[k - 1] if name == "plan" else times[k]
        ratio = statistics.median(b / a for a, b in zip(plain, times[k], strict=True))
        rows.append([mode, name, format_bytes(peak), f"{statistics.median(times[k]) * 1e3:.1f} ms",
                     f"{(ratio - 1) * 100:+.1f}%"])
    print(table(["run", "model", "measured peak", "step time", "slowdown"], rows,
                [False, False, True, True, True]))


if __name__ == "__main__":
    main()
