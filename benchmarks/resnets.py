"""ResNets as users write them (torchvision's blocks, HF's ResNet from a config; BatchNorm and
``out += identity``): ILP plans at 25, 50 and 75% of the range between the smallest feasible
peak and the unplanned one, predicted vs measured peak, gradients and buffers against the plain
model, and what the old BatchNorm handling (outputs kept with ``allow_cache_entry_mutation``)
gave on the same plans.

    python benchmarks/resnets.py            # batch 8 x 3 x 64 x 64, about a minute on 2 cores
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memfit
from memfit.runtime.regions import Region
from tests.test_real_models import BLOCKS, _old_contexts


def main() -> None:
    for name in ("resnet18", "hf-resnet"):
        factory, names = BLOCKS[name]
        model, x = factory(batch=8, image=64)
        prof = memfit.profile(copy.deepcopy(model), x, units=names, optimizer="sgd-momentum", repeat=1)
        lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
        for frac in (0.25, 0.5, 0.75):
            sched = memfit.plan(prof, int(lo + frac * (hi - lo)))
            now = memfit.validate(copy.deepcopy(model), x, sched, steps=0)
            fixed = Region._contexts
            Region._contexts = _old_contexts  # type: ignore[method-assign]
            try:
                old = memfit.validate(copy.deepcopy(model), x, sched, steps=0)
            finally:
                Region._contexts = fixed  # type: ignore[method-assign]
            print(f"{name} budget {memfit.format_bytes(sched.budget_bytes)}: {len(sched.checkpointed)}/{len(names)} "
                  f"checkpointed; predicted {memfit.format_bytes(now.predicted_peak_bytes)}, measured "
                  f"{memfit.format_bytes(now.measured_peak_bytes)}; gradients equal {now.grads_equal}, buffers "
                  f"equal {now.buffers_equal}; the old BatchNorm handling: gradients equal {old.grads_equal}, "
                  f"max difference {old.max_grad_diff:.3g}")


if __name__ == "__main__":
    main()
