"""Training under FSDP2 with a per-rank memfit schedule, launched by torchrun.

    memfit plan --scenario gpt-small --budget 250MB --parallel fsdp --world-size 2 -o fsdp.json
    torchrun --nproc-per-node 2 examples/train_fsdp.py --schedule fsdp.json --steps 5

    memfit plan --scenario hf-llama --budget 80% --parallel fsdp --world-size 4 --tp 2 --sequence-parallel -o mesh.json
    torchrun --nproc-per-node 4 examples/train_fsdp.py --schedule mesh.json

gloo on the CPU, NCCL with one GPU per rank. The order matters: the model sharded as the schedule
says (``memfit.measure.ranks.shard``: tensor parallelism first, then ``fully_shard`` each unit and
the root), then ``memfit.apply``, as the schedule's per-rank profile was measured. Each rank
prints its loss and its measured peak, to set beside the plan's prediction.
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


def train(schedule_path: str, steps: int) -> tuple[float, int, int]:
    """On this rank of a started process group: the schedule's model sharded as it was planned
    (its layout: FSDP2 per unit and on the root, DDP, tensor parallelism by the model's config
    plan, with sequence parallelism, or FSDP2 x TP on a 2-D mesh), the schedule applied, ``steps``
    steps run. Returns the last loss, the measured and the predicted peak."""
    schedule = memfit.load_schedule(schedule_path)
    if not schedule.parallel:
        raise SystemExit(f"{schedule_path} is not a per-rank schedule: plan with --parallel")
    sc = scenario_from_source(schedule.source, trusted=True)  # your own schedule: rebuild what it names
    cuda = torch.cuda.is_available()
    model, batch = sc.build(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    names = find_units(model, sc.units)
    wrapped = shard(model, names, schedule.parallel)  # as the per-rank profile was measured
    memfit.apply(model, schedule)  # after sharding
    run = measure_steps(wrapped, batch, step=schedule.train_step, steps=steps)
    return run.losses[-1], run.peak_bytes, schedule.predicted_peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="fsdp.json", help="a per-rank schedule from memfit plan --parallel")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        schedule = memfit.load_schedule(args.schedule)
        loss, peak, predicted = train(args.schedule, args.steps)
        print(f"rank {dist.get_rank()}: loss {loss:.4f}; peak {memfit.format_bytes(peak)} measured, "
              f"{memfit.format_bytes(predicted)} predicted (budget {memfit.format_bytes(schedule.budget_bytes)})",
              flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # the application decides what is shown:
    logging.getLogger("memfit").setLevel(logging.INFO)  # memfit's one-line reports
    main()
