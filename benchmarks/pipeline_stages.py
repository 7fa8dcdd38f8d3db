"""Pipeline stages planned each for its own micro-batches in flight, against the uniform plan
(the first k blocks of every stage checkpointed, Megatron's block method), at one per-GPU budget.

    python benchmarks/pipeline_stages.py              # both parts (~2 min on 2 cores)
    python benchmarks/pipeline_stages.py --measure    # gloo ranks only: predicted vs measured peaks
    python benchmarks/pipeline_stages.py --compare    # 4 and 8 stages: per-stage vs uniform slowdown
    python benchmarks/pipeline_stages.py --time       # 2 gloo ranks, a core each: measured slowdowns
                                                      # (2 stages, 1F1B; 4 stages, Interleaved1F1B)
    python benchmarks/pipeline_stages.py --estimate   # Llama 3 8B on 4 and 8 H100s, estimated

``--measure`` profiles each rank of tests/pipeline_models.py's GPT (4 or 8 blocks) in one process,
plans it at 85% of the fullest rank's unplanned peak, and runs torch.distributed.pipelining's own
schedule (1F1B and GPipe on 2 and 4 ranks; Interleaved1F1B and LoopedBFS, 4 stages on 2 ranks)
on gloo with nothing, the per-stage plans and the uniform plan applied: each rank's measured peak
beside its prediction. ``--compare`` plans a 16-block GPT (d 128, 128
tokens, 2 sequences a micro-batch, 1F1B with 2 micro-batches per stage) for 4 and 8 stages at
budgets between the plans' reach and the unplanned peak; the slowdowns are the pipeline's
(``memfit.steps.pipeline.makespan`` over each rank's forward and backward times, measured here).
``--time`` runs 2 stages (one thread and one core a rank) of a 8-block GPT under 1F1B, and 4
stages of it under Interleaved1F1B (two a rank), with nothing,
the per-stage and the uniform plan and nothing again (an A/A control), interleaved: each timed
step after an untimed one of its own configuration, the order rotated every round, GC held off,
medians over 41 rounds of the pipeline's wall time between two barriers; beside the slowdowns
``makespan`` predicts from the profiles (measured in one process, one thread). More ranks than
cores cannot be timed here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure() -> None:
    from memfit.policy import KEEP
    from memfit.steps.parallel import spawn_ranks
    from memfit.steps.stages import plan_stages
    from tests.pipeline_models import run_rank, stage_profiles

    print("| schedule | stages | rank | in flight (most of its stages) | nothing: predicted / measured "
          "| per-stage plan | uniform plan |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for schedule, stages, mbs, layers in (("1F1B", 2, 4, 4), ("GPipe", 2, 4, 4), ("1F1B", 4, 8, 8),
                                          ("GPipe", 4, 8, 8), ("Interleaved1F1B", 4, 4, 8), ("LoopedBFS", 4, 4, 8)):
        profiles = stage_profiles(schedule, stages, mbs, n_layer=layers)
        ranks = len(profiles)  # two stages a rank when interleaved
        plain = [p.measured_peak_bytes[KEEP] for p in profiles]
        plans = plan_stages(profiles, int(0.85 * max(plain)), schedule=schedule, microbatches=mbs)
        runs = []
        for applied in ([None] * stages, plans.schedules, plans.uniform_schedules):
            runs.append(spawn_ranks(run_rank, ranks, "cpu", schedule, stages, mbs, applied, n_layer=layers)["ranks"])
        for r in range(ranks):
            cells = [f"{plain[r]:,} / {runs[0][r]['peak']:,}",
                     f"{plans.per_stage[r].prediction.peak_bytes:,} / {runs[1][r]['peak']:,}",
                     f"{plans.uniform[r].prediction.peak_bytes:,} / {runs[2][r]['peak']:,}"]
            print(f"| {schedule} | {stages} | {r} | {plans.per_stage[r].in_flight} | " + " | ".join(cells) + " |")


def compare() -> None:
    import torch

    from memfit.policy import KEEP
    from memfit.steps.stages import plan_stages, profile_stages
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


def _time_rank(device: str, plans: list, rounds: int, schedule: str, n_stages: int, microbatches: int) -> dict:
    """On each rank: its stage (or stages, two a rank when interleaved) under each configuration of
    ``plans`` (per configuration, one schedule a rank, or None), timed in interleaved rounds;
    rank 0's medians."""
    import gc
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    import memfit
    from tests.pipeline_models import built, cut, loss_fn

    torch.set_num_threads(1)
    rank = dist.get_rank()
    model, vocab = built("gpt", 8, 128)
    idx = torch.randint(0, vocab, (8, 128))
    tgt = torch.randint(0, vocab, (8, 128))
    mods = cut("gpt", model, n_stages)
    mine = [s for s in range(n_stages) if s % dist.get_world_size() == rank]
    stage_mod = mods[rank] if len(mine) == 1 else nn.ModuleDict({str(s): mods[s] for s in mine})
    pipe = [PipelineStage(mods[s], s, n_stages, torch.device(device)) for s in mine]
    sched = get_schedule_class(schedule)(pipe[0] if len(mine) == 1 else pipe, microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=0.0)
    first, last = 0 in mine, n_stages - 1 in mine

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        sched.step(*([idx] if first else []), return_outputs=False, **({"target": tgt} if last else {}))
        opt.step()

    times: list[list[float]] = [[] for _ in plans]
    gc.disable()
    for r in range(rounds):
        order = list(range(len(plans)))
        order = order[r % len(order):] + order[:r % len(order)]
        for c in order:
            if "_memfit_applied" in stage_mod.__dict__:
                memfit.remove(stage_mod)
            if plans[c][rank] is not None:
                memfit.apply(stage_mod, plans[c][rank])
            step()
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            times[c].append(time.perf_counter() - t)
        gc.collect()
    gc.enable()
    return {"medians": [statistics.median(ts) for ts in times]}


def time_stages(rounds: int = 41) -> None:
    """2 ranks, a core each: 2 stages under 1F1B, and 4 stages (two a rank) under Interleaved1F1B."""
    import torch

    from memfit.policy import KEEP
    from memfit.steps.parallel import spawn_ranks
    from memfit.steps.stages import plan_stages
    from tests.pipeline_models import stage_profiles

    torch.set_num_threads(1)
    print("| schedule | stages | budget | per-stage: predicted / measured | uniform: predicted / measured "
          "| A/A (nothing twice) |")
    print("|---|---:|---:|---:|---:|---:|")
    for schedule, n_stages in (("1F1B", 2), ("Interleaved1F1B", 4)):
        profiles = stage_profiles(schedule, n_stages, 4, n_layer=8, seq=128, repeat=7)
        top = max(p.measured_peak_bytes[KEEP] for p in profiles)
        for share in (0.9, 0.8):
            plans = plan_stages(profiles, int(share * top), schedule=schedule, microbatches=4)
            configs = [[None, None], plans.schedules, plans.uniform_schedules, [None, None]]
            m = spawn_ranks(_time_rank, 2, "cpu", configs, rounds, schedule, n_stages, 4)["medians"]
            print(f"| {schedule} | {n_stages} | {share:.0%} | {plans.per_stage_s / plans.plain_s - 1:+.1%} / "
                  f"{m[1] / m[0] - 1:+.1%} | {plans.uniform_s / plans.plain_s - 1:+.1%} / {m[2] / m[0] - 1:+.1%} | "
                  f"{m[3] / m[0] - 1:+.1%} |")


def estimate_llama(stages_list: tuple[int, ...] = (4, 8), budget: str = "40GB") -> None:
    """Llama 3 8B (config only, pure bf16 with AdamW, 8192 tokens a micro-batch, 2 micro-batches a
    stage under 1F1B, the loss on fp32 logits as Hugging Face and torchtitan take it) estimated for
    H100s: each rank's plan at one per-GPU budget beside the uniform plan."""
    import time

    import torch

    from memfit.hf import decoder_stages, llama
    from memfit.report import stages_report
    from memfit.steps.stages import causal_lm_loss, estimate_stages, plan_stages

    for n in stages_list:
        mbs = 2 * n

        def build(n: int = n, mbs: int = mbs) -> tuple:
            torch.set_default_dtype(torch.bfloat16)
            try:
                model, _ = llama(batch=1, seq=8192, n_layer=32, hidden=4096, intermediate=14336, n_head=32,
                                 kv_heads=8, vocab=128256, tied=False)
            finally:
                torch.set_default_dtype(torch.float32)
            ids = torch.randint(0, 128256, (mbs, 8192))
            return decoder_stages(model, n), ids, ids.clone()

        t = time.time()
        profiles = estimate_stages(build, causal_lm_loss, target="h100", schedule="1F1B", microbatches=mbs,
                                   units="layers.*")
        print(f"Llama 3 8B, {n} stages: estimated in {time.time() - t:.0f} s")
        print(stages_report(plan_stages(profiles, budget, schedule="1F1B", microbatches=mbs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="only the gloo ranks' peaks")
    ap.add_argument("--compare", action="store_true", help="only the per-stage vs uniform table")
    ap.add_argument("--time", action="store_true", help="only the timed 2-rank runs (2 and 4 stages)")
    ap.add_argument("--estimate", action="store_true", help="only Llama 3 8B on 4 and 8 H100s, estimated")
    args = ap.parse_args()
    both = not (args.measure or args.compare or args.time or args.estimate)
    if args.measure or both:
        measure()
    if args.compare or both:
        compare()
    if args.time or both:
        time_stages()
    if args.estimate or both:
        estimate_llama()


if __name__ == "__main__":
    main()
