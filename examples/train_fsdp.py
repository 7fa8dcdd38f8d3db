"""Training under FSDP2 with a per-rank memfit schedule, launched by torchrun.

    memfit plan --scenario gpt-small --budget 250MB --parallel fsdp --world-size 2 -o fsdp.json
    torchrun --nproc-per-node 2 examples/train_fsdp.py --schedule fsdp.json --steps 5

gloo on the CPU, NCCL with one GPU per rank. The order matters: ``fully_shard`` each unit, then
the root, then ``memfit.apply``, as the schedule's per-rank profile was measured. Each rank
prints its loss and, on the CPU, its measured peak, to set beside the plan's prediction.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist

import memfit
from memfit.measure.ranks import shard
from memfit.runtime.harness import measure_steps
from memfit.scenarios import scenario_from_source
from memfit.units import find_units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="fsdp.json", help="a per-rank schedule from memfit plan --parallel")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        schedule = memfit.load_schedule(args.schedule)
        kind = schedule.parallel.get("kind", "fsdp")
        sc = scenario_from_source(schedule.source)
        model, batch = sc.build(f"cuda:{rank}" if cuda else "cpu")
        names = find_units(model, sc.units)
        wrapped = shard(model, names, kind)  # FSDP2 per unit and on the root, or DDP
        memfit.apply(model, schedule)  # after sharding, as the per-rank profile was measured
        run = measure_steps(wrapped, batch, step=schedule.train_step, steps=args.steps)
        print(f"rank {dist.get_rank()}: loss {run.losses[-1]:.4f}; peak {memfit.format_bytes(run.peak_bytes)} "
              f"measured, {memfit.format_bytes(schedule.predicted_peak_bytes)} predicted "
              f"(budget {memfit.format_bytes(schedule.budget_bytes)})", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # the application decides what is shown:
    logging.getLogger("memfit").setLevel(logging.INFO)  # memfit's one-line reports
    main()
