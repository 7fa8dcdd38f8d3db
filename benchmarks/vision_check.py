"""torchvision's and timm's own vision nets, as users build them, planned and validated where they
run (issue 38: predicted = measured on models memfit was not built around).

    python benchmarks/vision_check.py                          # on a CUDA machine with torchvision and timm
    python benchmarks/vision_check.py --device cpu --batch 4 --sizes 64 96 --nets mobilenet_v3_small

For each net at each image size: ``memfit.profile`` of a cross-entropy training step (AdamW, the
optimizer whose first step creates the most state), three budgets between the smallest feasible
peak and the un-checkpointed one, and for each the plan's predicted peak beside what
``memfit.validate`` measured in steady state and what the plan's *first* step measured (a fresh
optimizer; the step a loop starts with); whether each stayed within the budget, and gradients,
losses and buffers against the plain model. Nets whose packages are missing are skipped.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gpu_check import add_run_flags, device_title, markdown, phase_gaps  # benchmarks/, beside this script
from torch import nn

import memfit
from memfit.budget import format_bytes
from memfit.report import table
from memfit.runtime.harness import StepHarness


def _tv(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)()
    return build


def _timm(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, drop_path_rate=0.1)
    return build


# hardswish and squeeze-excitation; stochastic depth; layer scale and stochastic depth; timm's
# in-place activations and deep stem
NETS: dict[str, Callable[[], nn.Module]] = {
    "mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "efficientnet_b0": _tv("efficientnet_b0"),
    "convnext_tiny": _tv("convnext_tiny"),
    "timm:resnet50d": _timm("resnet50d"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    parser.add_argument("--sizes", nargs="+", type=int, default=[128, 224], help="image sizes, pixels")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed rounds per validation")
    add_run_flags(parser, "net")
    args = parser.parse_args()
    began, rows = time.perf_counter(), []
    heads = ["net", "px", "budget", "predicted", "measured", "error", "first step", "first err.",
             "fits", "pred. slowdown", "meas. slowdown", "units ckpt", "grads", "losses", "buffers"]
    for name in args.nets:
        for size in args.sizes:
            if time.perf_counter() - began > args.deadline:
                print(f"{name} at {size} px: not started (deadline)", flush=True)
                continue
            try:
                torch.manual_seed(0)
                model = NETS[name]().to(args.device)
            except ImportError as exc:
                print(f"{name}: skipped ({exc})", flush=True)
                break
            x = torch.randn(args.batch, 3, size, size, device=args.device)
            labels = torch.randint(0, 1000, (args.batch,), device=args.device)

            def loss(out: torch.Tensor, labels: torch.Tensor = labels) -> torch.Tensor:
                return F.cross_entropy(out, labels)

            started = time.perf_counter()
            prof = memfit.profile(model, x, loss_fn=loss, optimizer="adamw", repeat=3)
            took = time.perf_counter() - started
            lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
            for frac in (0.1, 0.5, 0.9):
                sched = memfit.plan(prof, int(lo + frac * (hi - lo)))
                v = memfit.validate(model, x, sched, loss_fn=loss, steps=args.steps)
                harness = StepHarness(model, x, loss_fn=loss, step=sched.train_step)
                with harness.restoring(), harness.scheduled(sched):
                    first = harness.run(steps=1).peak_bytes
                pred = v.predicted_peak_bytes
                fits = max(v.measured_peak_bytes, first) <= sched.budget_bytes
                rows.append([name, str(size), format_bytes(sched.budget_bytes), format_bytes(pred),
                             format_bytes(v.measured_peak_bytes), f"{v.error * 100:+.2f}%", format_bytes(first),
                             f"{(pred - first) / first * 100:+.2f}%", "yes" if fits else "OVER",
                             f"{v.predicted_overhead * 100:+.1f}%", f"{v.measured_overhead * 100:+.1f}%",
                             f"{len(sched.checkpointed)}/{len(prof.units)}", *("equal" if ok else "DIFFER" for ok in
                                                              (v.grads_equal, v.losses_equal, v.buffers_equal))])
                print(" | ".join(rows[-1]), f"(profiled in {took:.1f} s; gradients differ by at most "
                      f"{v.max_grad_diff:.3g}, the plain step from itself by {v.plain_grad_diff:.3g})", flush=True)
                if v.measured_peak_bytes > pred or args.phases:
                    print("  where measured exceeds predicted:", phase_gaps(model, x, sched, loss_fn=loss), flush=True)
            del model, x
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            if args.out:
                with open(args.out, "w") as f:
                    f.write(device_title(args.device) + "\n\n" + markdown(heads, rows))
    print(device_title(args.device))
    print(table(heads, rows))


if __name__ == "__main__":
    main()
