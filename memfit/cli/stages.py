"""``memfit plan --pp N``: a Hugging Face decoder cut into pipeline stages (``hf.decoder_stages``),
each rank profiled here or estimated for a target (``stages.profile_stages``,
``stages.estimate_stages``), planned at the per-GPU budget beside the uniform plan, one schedule
file a rank."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from memfit.cli import modelflags
from memfit.errors import MemfitError

# the flags a pipeline plan does not take yet, and what they are
_NOT_WITH_PP = {"parallel": "--parallel", "tp": "--tp", "profile": "--profile", "compile": "--compile",
                "seq_lens": "--seq-lens", "seq_hist": "--seq-hist", "timeline": "--timeline",
                "save_profile": "--save-profile"}


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline stages (torch.distributed.pipelining; torchtitan's pipeline_parallel_*)")
    g.add_argument("--pp", type=int, metavar="N", help="pipeline ranks (torchtitan's pipeline_parallel_degree), a "
                   "stage each (two for interleaved schedules): a plan per rank, for the micro-batches its "
                   "schedule holds in flight; Hugging Face decoders laid out as Llama")
    g.add_argument("--pp-schedule", default="1F1B", metavar="NAME",
                   help="1F1B, GPipe, Interleaved1F1B or LoopedBFS (default: %(default)s)")
    g.add_argument("--pp-microbatches", type=int, metavar="M",
                   help="micro-batches the scenario's batch is cut into (default: 2 a stage)")


def plan_pipeline(args: argparse.Namespace, budget_text: str) -> int:
    """Profile or estimate every rank, plan each at the budget beside the uniform plan, write a
    schedule a rank (``<output stem>.rank<r>.json``) and print the table."""
    from memfit.budget import format_bytes, parse_bytes, parse_share
    from memfit.console import write_output
    from memfit.jsonio import check_replaceable

    used = [flag for key, flag in _NOT_WITH_PP.items() if getattr(args, key, None)]
    if used:
        raise MemfitError(f"--pp does not plan with {', '.join(used)} yet: drop {'it' if len(used) == 1 else 'them'}")
    if args.pp < 2:
        raise MemfitError(f"--pp {args.pp}: a pipeline has 2 stages or more")
    if args.pp_microbatches is not None and args.pp_microbatches < 1:
        raise MemfitError(f"--pp-microbatches {args.pp_microbatches}: give 1 or more")
    share = parse_share(budget_text)
    budget = parse_bytes(budget_text) if share is None else 0
    microbatches = args.pp_microbatches or 2 * args.pp
    stem = Path("schedule.json" if args.output is None else args.output)
    outputs = [stem.with_name(f"{stem.stem}.rank{r}{stem.suffix or '.json'}") for r in range(args.pp)]
    for path in outputs:
        check_replaceable(str(path), "schedule file")
    from memfit.planning.peak import predict
    from memfit.report import stages_report
    from memfit.stages import plan_stages

    _stage_count(args)  # an unknown or a split-backward schedule, before minutes of profiling
    sc = modelflags.scenario_of(args)
    _check_step(sc)
    profiles = _profiles(args, sc, microbatches)
    if share is not None:
        budget = max(1, round(share * max(predict(p, {}).peak_bytes for p in profiles)))
        print(f"budget {budget_text.strip()} of the fullest rank's unplanned peak: {format_bytes(budget)}")
    plans = plan_stages(profiles, budget, schedule=args.pp_schedule, microbatches=microbatches)
    written = [str(outputs[r]) for r in range(len(plans.schedules))]
    for schedule, path in zip(plans.schedules, written, strict=True):
        schedule.source = profiles[0].source or schedule.source
        write_output(schedule.save, path)
    if args.json:
        print(json.dumps({"format": "memfit.schedules/1", "schedule": plans.schedule, "microbatches": microbatches,
                          "ranks": [s.to_dict() for s in plans.schedules]}, indent=2))
        return 0
    print(stages_report(plans))
    print(f"\nwrote {', '.join(written)}; on rank r, before PipelineStage(stage, r, ...):\n"
          f'    memfit.apply(stage, memfit.load_schedule("{stem.stem}.rank<r>{stem.suffix or ".json"}"))')
    return 0


def _check_step(sc: Any) -> None:
    step = sc.train_step
    if step.accumulate > 1 or step.amp or step.clip_grad_norm is not None or step.keep_output:
        raise MemfitError(f"{sc.name}'s step ({step.describe()}) is more than a pipeline rank's step memfit plans yet "
                          "(an optimizer, a dtype): drop --accumulate, amp precision, --clip-grad-norm and "
                          "--keep-output")


def _profiles(args: argparse.Namespace, sc: Any, microbatches: int) -> list[Any]:
    """Each rank's profile: estimated for the scenario's or the flags' target, else measured here."""
    from memfit.stages import causal_lm_loss, estimate_stages, profile_stages

    target = modelflags.target_of(args, sc)
    optimizer = sc.train_step.optimizer or "adamw"

    def build() -> tuple[list[Any], Any, Any]:
        from memfit.hf import decoder_stages

        model, inputs = sc.build("cpu" if target is not None else modelflags.parse_device(args.device))
        ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
        if ids is None:
            raise MemfitError(f"{sc.name}'s inputs have no input_ids: --pp plans Hugging Face decoders "
                              "(Llama, Qwen2, Mistral) fed token ids")
        if ids.shape[0] % microbatches:
            raise MemfitError(f"{sc.name}'s batch of {ids.shape[0]} does not split into {microbatches} micro-batches: "
                              "give --pp-microbatches a divisor of it, or --args batch=N")
        return decoder_stages(model, _stage_count(args)), ids, inputs.get("labels", ids)

    where = f"for {target.name} from shapes" if target is not None else "here"
    print(f"{'estimating' if target is not None else 'measuring'} {sc.name} in {args.pp} ranks of a "
          f"{args.pp_schedule} pipeline, {microbatches} micro-batches, {where}", file=sys.stderr)
    if target is not None:
        profiles = estimate_stages(build, causal_lm_loss, target=target, schedule=args.pp_schedule,
                                   microbatches=microbatches, optimizer=optimizer, units="layers.*")
    else:
        stages, ids, labels = build()
        profiles = profile_stages(stages, ids, labels, causal_lm_loss, schedule=args.pp_schedule,
                                  microbatches=microbatches, optimizer=optimizer, units="layers.*",
                                  repeat=5 if args.repeat is None else args.repeat)
    for p in profiles:
        p.source = sc.source()
    return profiles


def _stage_count(args: argparse.Namespace) -> int:
    """Stages: one a rank, two for the schedules that interleave."""
    from memfit.pipeline import rank_orders

    return args.pp if len(rank_orders(args.pp_schedule, args.pp, 2 * args.pp)) == args.pp else 2 * args.pp
