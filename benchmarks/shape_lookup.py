"""What a schedule for several input shapes costs per step: the plan lookup, and a switch.

    python benchmarks/shape_lookup.py                    # gpt-small at 64, 128 and 256 tokens
    python benchmarks/shape_lookup.py --rounds 15 --calls 20000

Four copies of one model are built at once and trained in one interleaved series (each timed
step after an untimed one of its own, the order reversed every round, GC held off: timing.alternate):

- ``one plan``: the schedule of the longest length alone, fed that length;
- ``one plan, again``: a second copy of the same: how far two identical configurations differ
  in this series (the control);
- ``three plans``: the schedule for all three lengths, fed the longest (the lookup, no switch);
- ``switching``: the same, its untimed step at the shortest length, so that every timed step
  switches plans at its start (unhooks the short plan's units, hooks the long plan's).

Both run the same plan at the timed length, so their step-time ratio to ``one plan`` is what
the lookup and the switch cost, with the uncertainty of a median over the rounds. The hook itself
is also timed alone (``--calls`` calls, best of 5): the watch at a planned signature, and a switch
between two plans and back.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import memfit
from memfit.lengths import cut_to_length
from memfit.measure.timing import alternate, median_ratio, ratio_uncertainty
from memfit.report import table
from memfit.runtime.apply import use_shape
from memfit.scenarios import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="gpt-small")
    parser.add_argument("--seq-lens", default="64,128,256")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=10000)
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()
    lengths = sorted(int(n) for n in args.seq_lens.split(","))
    sc = load_scenario(args.scenario)
    sc.seq_lens = lengths
    model, batch = sc.build()
    batches = {n: cut_to_length(batch, n) for n in lengths}
    profiles = [memfit.profile(model, batches[n], units=sc.units, repeat=1) for n in lengths]
    budget = (memfit.min_budget_bytes(profiles[-1]) + memfit.predict(profiles[-1], {}).peak_bytes) // 2
    one, three = memfit.plan(profiles[-1], budget), memfit.plan(profiles, budget)
    assert three.plans[-1].policies == one.policies  # the same plan at the timed length
    models = [memfit.apply(copy.deepcopy(model), s) for s in (one, one, three, three)]
    long, short = lengths[-1], lengths[0]
    feeds = [(long, long), (long, long), (long, long), (short, long)]  # (untimed, timed) steps
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    calls = [0] * len(models)

    def run(k: int) -> float:
        n = feeds[k][calls[k] % 2]
        calls[k] += 1
        start = time.perf_counter()
        optimizers[k].zero_grad(set_to_none=True)
        memfit.default_loss(models[k](**batches[n])).backward()
        optimizers[k].step()
        return time.perf_counter() - start

    times = alternate(run, len(models), args.rounds)
    rows = [["one plan", f"{statistics.median(times[0]) * 1e3:.1f} ms", "1", "-"]]
    for k, name in ((1, "one plan, again"), (2, "three plans"), (3, "switching")):
        ratio, sure = median_ratio(times[0], times[k]), ratio_uncertainty(times[0], times[k])
        rows.append([name, f"{statistics.median(times[k]) * 1e3:.1f} ms", f"{ratio:.4f}", f"±{sure:.4f}"])
    print(f"{args.scenario} at lengths {lengths}, budget {memfit.format_bytes(budget)}; {args.rounds} rounds")
    print(table(["configuration", "median step", "ratio to one plan", "uncertainty"], rows,
                [False, True, True, True]))
    hook_times(models[2], batches, lengths, args.calls)


def hook_times(model: torch.nn.Module, batches: dict[int, dict], lengths: list[int], calls: int) -> None:
    """The watch hook alone: at a planned signature, and a plan switch there and back."""
    watch = next(h for h in model._forward_pre_hooks.values() if type(h).__name__ == "Watch")
    args, kwargs = (), batches[lengths[-1]]
    with torch.enable_grad():
        watch(model, args, kwargs)
        best = min(_per_call(lambda: watch(model, args, kwargs), calls) for _ in range(5))
    n = len(lengths) - 1
    switch = min(_per_call(lambda: (use_shape(model, 0), use_shape(model, n)), max(1, calls // 100))
                 for _ in range(5)) / 2
    print(f"watch hook at a planned signature: {best * 1e6:.1f} us per forward; a switch of plans: "
          f"{switch * 1e6:.1f} us ({len(model.get_submodule('').__dict__['_memfit_applied'].policies)} units)")


def _per_call(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


if __name__ == "__main__":
    main()
