"""The kernels a step runs: plain eager, torch.compile at an activation memory budget, and memfit
with one option on every unit, op by op (torch.profiler, CPU).

    python benchmarks/op_times.py --scenario vit-tiny --budget 0.3 --policy derive:projections --rounds 7

For each aten op: how many times each configuration's step calls it, and its least self CPU time
over ``--rounds`` profiled steps (each after an untimed step of its own, the configurations
interleaved, one thread): what separates an option from the compiler's partition when both
recompute the same tensors is then visible as kernels (more calls, slower ones) or as the rest.
The least of a few steps, not a median: this answers "which kernels", not "how much slower"
(benchmarks/vs_compile_budget.py times the steps).
"""

from __future__ import annotations

import argparse

import torch
from peer_tools import training_copy
from torch.profiler import ProfilerActivity, profile

from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss
from memfit.measure.timing import timed_step
from memfit.policy import parse
from memfit.report import table
from memfit.scenarios import load_scenario
from memfit.units import find_units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="vit-tiny", help="a built-in scenario the CPU can run")
    parser.add_argument("--budget", type=float, default=0.3, help="torch.compile's activation_memory_budget")
    parser.add_argument("--policy", default="derive:projections", help="memfit's option on every unit")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--least-ms", type=float, default=0.5, help="ops below this in every column are left out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sc = load_scenario(args.scenario)
    model, raw = sc.build("cpu")
    inputs = Inputs.of(raw)
    units = find_units(model, sc.units)
    configs = {}
    for label, policies, budget in (("plain", None, None), (f"compile {args.budget}", None, args.budget),
                                    (f"memfit {args.policy}", dict.fromkeys(units, parse(args.policy)), None)):
        m, _, runner = training_copy(model, policies, budget)
        configs[label] = (runner, StepState(sc.train_step, m))
    cpu = torch.device("cpu")
    calls: dict[str, dict[str, int]] = {}
    least: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for label, (runner, state) in configs.items():
            timed_step(runner, inputs, default_loss, state, cpu)  # untimed: compiles, learns, warms up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timed_step(runner, inputs, default_loss, state, cpu)
            ops = {e.key: e for e in prof.key_averages() if e.key.startswith("aten::")}
            calls[label] = {k: e.count for k, e in ops.items()}  # the last round's (the first compiled ones trace)
            now = {k: e.self_cpu_time_total / 1e3 for k, e in ops.items()}
            seen = least.get(label, now)
            least[label] = {k: min(seen.get(k, 0.0), now.get(k, 0.0)) for k in seen.keys() | now.keys()}
    keys = sorted({k for c in least.values() for k in c}, key=lambda k: -max(c.get(k, 0.0) for c in least.values()))
    rows = [[k, *(f"{calls[c].get(k, 0)}  {least[c].get(k, 0.0):.1f} ms" for c in configs)]
            for k in keys if max(c.get(k, 0.0) for c in least.values()) >= args.least_ms]
    rows.append(["all ops", *(f"{sum(calls[c].values())}  {sum(least[c].values()):.1f} ms" for c in configs)])
    print(f"{args.scenario}: calls and least self CPU time of each aten op over {args.rounds} profiled steps, "
          "one thread")
    print(table(["op", *configs], rows))


if __name__ == "__main__":
    main()
