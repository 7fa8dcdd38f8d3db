"""A complete small training loop that applies a memfit schedule.

    memfit plan --scenario gpt-small --budget 300MB --fallbacks 2 -o schedule.json
    python examples/train.py --schedule schedule.json --steps 20

The model comes from the same scenario the schedule was planned for; in your own script it is
simply your model: ``model = memfit.apply(model, memfit.load_schedule("schedule.json"))``.
"""

from __future__ import annotations

import argparse

import torch

import memfit
from memfit.scenarios import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="schedule.json", help="schedule JSON from `memfit plan -o`")
    parser.add_argument("--scenario", default="gpt-small", help="scenario the schedule was planned for")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    memfit.keep_freed_cpu_memory()  # CPU training: reuse freed memory instead of faulting it in every step

    model, batch = load_scenario(args.scenario).build()
    model = memfit.apply(model, memfit.load_schedule(args.schedule))
    print("checkpointed units:", ", ".join(memfit.load_schedule(args.schedule).checkpointed) or "none")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.steps):
        while True:
            try:
                optimizer.zero_grad(set_to_none=True)
                loss = memfit.default_loss(model(**batch) if isinstance(batch, dict) else model(*batch))
                loss.backward()
                break
            except torch.OutOfMemoryError:
                # The real run still did not fit (another process, fragmentation): step down to the
                # schedule's next tighter plan (memfit plan --fallbacks K) and retry this step.
                if not memfit.tighten(model):
                    raise
                print("out of memory: switched to a tighter plan", flush=True)
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
