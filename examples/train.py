"""A complete small training loop under a memfit plan.

    python examples/train.py --budget 300MB --steps 20     # memfit.fit: one call (cached for the next run)

or with a plan made beforehand by the command line (fallbacks, several lengths, reviewed):

    memfit plan --scenario gpt-small --budget 300MB --fallbacks 2 -o schedule.json
    python examples/train.py --schedule schedule.json --steps 20

A schedule planned for several sequence lengths (``memfit plan --seq-lens 64,128,256``) is
trained on batches of each length in turn, as a bucketing data loader gives them: each forward
runs its length's plan.

The model comes from the same scenario the schedule was planned for; in your own script it is
simply your model: ``model = memfit.apply(model, memfit.load_schedule("schedule.json"))``. The
loop runs the step the schedule was planned for (``memfit plan --accumulate 4 --precision
amp-bf16 --clip-grad-norm 1.0``): micro-batches, autocast, clipping, as your loop would.
"""

from __future__ import annotations

import argparse
import logging

import torch

import memfit
from memfit.lengths import cut_to_length
from memfit.scenarios import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", help="plan in this script with memfit.fit (e.g. 300MB), cached between runs")
    parser.add_argument("--schedule", help="or: a schedule JSON from `memfit plan -o`")
    parser.add_argument("--scenario", default="gpt-small", help="scenario the schedule was planned for")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()  # CPU training: reuse freed memory instead of faulting it in every step

    if (args.budget is None) == (args.schedule is None):
        parser.error("give --budget SIZE (plan here with memfit.fit) or --schedule FILE (a plan made by memfit plan)")
    scenario = load_scenario(args.scenario)
    if args.budget:
        model, batch = scenario.build()
        try:
            schedule, lengths, batches = memfit.fit(model, batch, args.budget), [], [batch]  # the one call
        except memfit.InfeasibleBudgetError as exc:  # it says the smallest budget that works
            parser.exit(2, f"{exc}\n")
    else:
        schedule = memfit.load_schedule(args.schedule)
        lengths = [p.source["seq_len"] for p in schedule.shapes if p.source.get("seq_len") is not None]
        scenario.seq_lens = lengths or None  # the model built for the longest, as it was planned
        model, batch = scenario.build()
        batches = [cut_to_length(batch, n) for n in lengths] or [batch]
        model = memfit.apply(model, schedule)
    planned = schedule.train_step  # the step the plan's peak is for
    print("checkpointed units:", ", ".join(schedule.checkpointed) or "none", f"({planned.describe()})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    amp = planned.precision in ("amp-bf16", "amp-fp16")
    dtype = torch.float16 if planned.precision == "amp-fp16" else torch.bfloat16
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device, enabled=planned.precision == "amp-fp16")
    model.train()
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        while True:
            try:
                optimizer.zero_grad(set_to_none=True)
                for _ in range(planned.accumulate):
                    with torch.autocast(device, dtype=dtype, enabled=amp):
                        loss = memfit.default_loss(model(**batch) if isinstance(batch, dict) else model(*batch))
                    scaler.scale(loss / planned.accumulate).backward()
                break
            except torch.OutOfMemoryError:
                # The real run still did not fit (another process, fragmentation): step down to the
                # schedule's next tighter plan (memfit plan --fallbacks K) and retry this step.
                if not memfit.tighten(model):
                    raise
                print("out of memory: switched to a tighter plan", flush=True)
        if planned.clip_grad_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), planned.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        length = f" (length {lengths[step % len(lengths)]})" if lengths else ""
        print(f"step {step}: loss {loss.item():.4f}{length}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # the application decides what is shown:
    logging.getLogger("memfit").setLevel(logging.INFO)  # memfit's one-line reports
    main()
