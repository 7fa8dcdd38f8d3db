"""Pipeline stages planned each for its own micro-batches in flight, against the uniform plan
(the first k blocks of every stage checkpointed, Megatron's block method), at one per-GPU budget.

    python benchmarks/pipeline_stages.py              # both parts (~2 min on 2 cores)
    python benchmarks/pipeline_stages.py --measure    # gloo ranks only: predicted vs measured peaks
    python benchmarks/pipeline_stages.py --compare    # 4 and 8 stages: per-stage vs uniform slowdown

``--measure`` profiles each rank of tests/pipeline_models.py's GPT (4 or 8 blocks) in one process,
plans it at 85% of the fullest rank's unplanned peak, and runs torch.distributed.pipelining's own
schedule on 2 and 4 gloo ranks with nothing, the per-stage plans and the uniform plan applied:
each rank's measured peak beside its prediction. ``--compare`` plans a 16-block GPT (d 128, 128
tokens, 2 sequences a micro-batch, 1F1B with 2 micro-batches per stage) for 4 and 8 stages at
budgets between the plans' reach and the unplanned peak; the slowdowns are the pipeline's
(``memfit.pipeline.makespan`` over each rank's forward and backward times, measured here).
Times of ranks that share two cores cannot be measured here, so only the peaks are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure() -> None:
    from memfit.parallel import spawn_ranks
    from memfit.policy import KEEP
    from memfit.stages import plan_stages
    from tests.pipeline_models import run_rank, stage_profiles

    print("| schedule | stages | rank | in flight | nothing: predicted / measured | per-stage plan | uniform plan |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for schedule, stages, mbs, layers in (("1F1B", 2, 4, 4), ("GPipe", 2, 4, 4), ("1F1B", 4, 8, 8),
                                          ("GPipe", 4, 8, 8)):
        profiles = stage_profiles(schedule, stages, mbs, n_layer=layers)
        plain = [p.measured_peak_bytes[KEEP] for p in profiles]
        plans = plan_stages(profiles, int(0.85 * max(plain)), schedule=schedule, microbatches=mbs)
        runs = []
        for applied in ([None] * stages, plans.schedules, plans.uniform_schedules):
            runs.append(spawn_ranks(run_rank, stages, "cpu", schedule, stages, mbs, applied, n_layer=layers)["ranks"])
        for r in range(stages):
            cells = [f"{plain[r]:,} / {runs[0][r]['peak']:,}",
                     f"{plans.per_stage[r].prediction.peak_bytes:,} / {runs[1][r]['peak']:,}",
                     f"{plans.uniform[r].prediction.peak_bytes:,} / {runs[2][r]['peak']:,}"]
            print(f"| {schedule} | {stages} | {r} | {plans.per_stage[r].in_flight} | " + " | ".join(cells) + " |")


def compare() -> None:
    import torch

    from memfit.policy import KEEP
    from memfit.stages import plan_stages, profile_stages
    from tests.pipeline_models import PipelinedGPT, loss_fn, stages_of

    print("| stages | budget | per-stage: checkpointed blocks by rank | slowdown | uniform: k per stage | slowdown |")
    print("|---:|---:|---|---:|---:|---:|")
    for stages in (4, 8):
        mbs = 2 * stages
        torch.manual_seed(0)
        model = PipelinedGPT(seq=128, d_model=128, n_layer=16)
        idx = torch.randint(0, 512, (2 * mbs, 128))
        tgt = torch.randint(0, 512, (2 * mbs, 128))
        profiles = profile_stages(stages_of(model, stages), idx, tgt, loss_fn, schedule="1F1B", microbatches=mbs,
                                  units="layers.*", repeat=5)
        top = max(p.measured_peak_bytes[KEEP] for p in profiles)
        for share in (0.9, 0.8, 0.7):
            try:
                plans = plan_stages(profiles, int(share * top), schedule="1F1B", microbatches=mbs)
            except Exception as exc:  # below the uniform plan's reach
                print(f"| {stages} | {share:.0%} | {exc} | | | |")
                continue
            counts = [sum(str(p) != "none" for p in s.policies.values()) for s in plans.schedules]
            print(f"| {stages} | {share:.0%} of {top / 2**20:.1f} MiB | {' '.join(map(str, counts))} | "
                  f"{plans.per_stage_s / plans.plain_s - 1:+.1%} | {plans.uniform_k} of {len(profiles[0].units)} | "
                  f"{plans.uniform_s / plans.plain_s - 1:+.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="only the gloo ranks' peaks")
    ap.add_argument("--compare", action="store_true", help="only the per-stage vs uniform table")
    args = ap.parse_args()
    both = not (args.measure or args.compare)
    if args.measure or both:
        measure()
    if args.compare or both:
        compare()


if __name__ == "__main__":
    main()
