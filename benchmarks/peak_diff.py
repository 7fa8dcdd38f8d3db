"""What an eager plan holds at its peak that torch.compile's does not, block by block.

    python benchmarks/peak_diff.py --scenario vit-tiny --policy derive --budget 0.6
    python benchmarks/peak_diff.py --scenario benchmarks/uneven-gpt.toml --policy derive:products --budget 0.6

Every unit under ``--policy`` (eager), against the model compiled with
``activation_memory_budget=--budget`` (aot_eager, as benchmarks/vs_compile_budget.py). After two
warm-up steps each runs one recorded step; the allocator's events (the profiler's event tree,
as measure/memory.py reads it) give the live blocks at the step's peak, each with the op that
made it and, with --stack, the Python lines above that op. Printed: both peaks, then the
blocks (size, maker) that one holds and the other does not, as counts. A block made outside any
op (a Python number wrapped as a tensor) has an empty maker. One thread, the CPU.
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
from peer_tools import training_copy

from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss, training_step
from memfit.policy import as_policies
from memfit.scenarios import load_scenario
from memfit.torch_private import ProfiledAllocation
from memfit.units import find_units

Live = collections.Counter[tuple[int, str]]


def live_at_peak(runner: Any, inputs: Inputs, state: StepState, stack: bool) -> tuple[int, Live]:
    """The step's peak above its start, and the blocks live then, as (bytes, maker) counts."""
    for _ in range(2):
        state.zero_grad()
        training_step(runner, inputs, default_loss, state)
    state.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                with_stack=stack) as prof:
        training_step(runner, inputs, default_loss, state)
    events: list[tuple[int, int, int, str]] = []
    todo = [(e, "") for e in reversed(prof.profiler.kineto_results.experimental_event_tree())]
    while todo:
        e, maker = todo.pop()
        f = e.extra_fields
        if isinstance(f, ProfiledAllocation):
            if f.device.type == "cpu":
                events.append((e.start_time_ns, f.alloc_size, f.ptr, maker))
        else:
            name = f"{maker} > {e.name}" if stack and maker else e.name
            todo.extend((c, name) for c in reversed(e.children))
    events.sort(key=lambda x: x[0])
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at: list[tuple[int, str]] = []
    for _, size, ptr, maker in events:
        if size > 0:
            live[ptr] = (size, maker)
            now += size
        elif ptr in live:
            now -= live.pop(ptr)[0]
        if now > peak:
            peak, at = now, list(live.values())
    return peak, collections.Counter(at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="vit-tiny", help="a built-in scenario the CPU runs, or a .toml")
    parser.add_argument("--policy", default="derive", help="every unit's policy in the eager step")
    parser.add_argument("--budget", type=float, default=0.6, help="torch.compile's activation_memory_budget")
    parser.add_argument("--stack", action="store_true", help="name each maker by its Python lines too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sc = load_scenario(args.scenario)
    model, raw = sc.build("cpu")
    model.train()
    inputs = Inputs.of(raw)
    eager, _, _ = training_copy(model, as_policies(dict.fromkeys(find_units(model, sc.units), args.policy)))
    compiled, _, runner = training_copy(model, budget=args.budget)
    a, held = live_at_peak(eager, inputs, StepState(sc.train_step, eager), args.stack)
    b, other = live_at_peak(runner, inputs, StepState(sc.train_step, compiled), args.stack)
    print(f"eager {args.policy}: {a:,} bytes at its peak; compile {args.budget}: {b:,}; difference {a - b:+,}")
    for title, more in (("eager only", held - other), ("compile only", other - held)):
        print(f"\n{title}: {sum(s * n for (s, _), n in more.items()):,} bytes")
        for (size, maker), n in sorted(more.items(), key=lambda kv: -kv[0][0] * kv[1]):
            print(f"  {n} x {size:,} bytes  {maker[-300:] or '(made outside any op)'}")


if __name__ == "__main__":
    main()
