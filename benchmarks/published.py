"""Published training-memory figures of well-known configurations, reproduced in estimate mode.

    python benchmarks/published.py            # every figure (about 80 s on 2 CPU cores)
    python benchmarks/published.py --only bert

Each figure was measured by its authors on the GPU named, with the configuration given (model
dimensions, batch, sequence, precision, optimizer, parallelism, checkpointing). memfit estimates
the same training step from shapes on fake tensors for that GPU (``memfit.estimate`` with the
step as a ``memfit.TrainStep``) and predicts the allocated peak of the same checkpointing
(``memfit.predict``). Published figures are not allocated peaks: torchtitan logs the caching
allocator's reserved peak, nvidia-smi the process's whole use. So the allocated estimate is
turned into the same kind of number before the two are compared: reserved = allocated x (1 +
margin), with devices.MARGIN (the allocator margin memfit plans with); nvidia-smi = reserved +
the CUDA context the source itself measured. The ratio is that over the published figure. A
second column replaces the fixed margin with the caching allocator's model (measure/allocator.py):
what it reserved over what it allocated in the estimate's own steps, every unit kept and every
unit checkpointed (``Profile.reserved_peak_bytes``), between the two by the share of units the
figure's plan checkpoints.

A figure measured with an older stack is estimated as that stack ran it: the BERT runs (January
2022: torch 1.10, transformers of then) with ``legacy.stack_2022()``, under which softmax keeps its
input for the backward and BERT adds its mask of ones, as they did then (``--today``: as today's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import torch
from legacy import stack_2022

import memfit
from memfit.budget import format_bytes
from memfit.devices import MARGIN, MiB
from memfit.planning.peak import allocator_ratio
from memfit.policy import FULL, Policies
from memfit.profiler.estimate import estimate
from memfit.report import table
from memfit.scenarios import Scenario

GiB = 2**30
HF_PERF = ("huggingface.co/docs/transformers/v4.18.0/en/performance (bert-large-uncased, 1x V100-SXM2-16GB, "
           "HF Trainer, seq 512, 'GPU memory occupied' by pynvml after training; CUDA context measured there: 1343 MB; "
           "run on 2022-01-11, the date of its nvidia-smi output, so torch 1.10 at the latest (1.11 came out on "
           "2022-03-10) and the transformers of then (4.15; 4.16 came out on 2022-01-27))")
TORCHAO = ("github.com/pytorch/ao/blob/main/torchao/prototype/float8nocompile/README.md (torchtitan PR #778: "
           "Llama 3 8B, 8x H100, FSDP2, batch 1 x 4096, bf16 eager; 'Peak memory (GB)' = torchtitan's max reserved, "
           "GiB)")


@dataclass(slots=True)
class Figure:
    key: str
    what: str  # the configuration, in words
    source: str
    published_bytes: int
    kind: str  # "reserved" (the allocator's peak) or "nvidia-smi" (reserved + the CUDA context)
    scenario: Scenario
    checkpoint: Callable[[list[str]], Policies]  # unit names -> the policies the source ran
    context_bytes: int = 0  # for nvidia-smi figures: the context the source measured
    stack_2022: bool = False  # measured with torch 1.10 and transformers 4.15: legacy.py


def _none(units: list[str]) -> Policies:
    return {}


def _full(units: list[str]) -> Policies:
    return dict.fromkeys(units, FULL)


def _every_second(units: list[str]) -> Policies:
    """torchtitan's selective_ac_option "2": a full checkpoint on every second block."""
    return {u: FULL for i, u in enumerate(units) if i % 2 == 1}


def _bert(batch: int, accumulate: int, precision: str) -> Scenario:
    # HF Trainer of early 2022: transformers' own AdamW (one tensor at a time), max_grad_norm 1.0,
    # model.zero_grad() (set_to_none=False in torch 1.x: the gradients stay), eager attention,
    # dropout 0.1, AutoModelForSequenceClassification (2 labels).
    return Scenario(name="bert-large-cls", model="memfit.hf:bert", optimizer="adamw-single", units="auto",
                    dtype="float32", target="v100-16gb", requires="transformers",
                    args={"batch": batch, "seq": 512, "n_layer": 24, "hidden": 1024, "n_head": 16,
                          "intermediate": 4096, "vocab": 30522, "task": "classify", "attention": "eager"},
                    accumulate=accumulate, precision=precision, clip_grad_norm=1.0, zero_grad="zeros")


def _llama3_8b_fsdp() -> Scenario:
    return Scenario(name="llama3-8b-fsdp-4k", model="memfit.hf:llama", optimizer="adamw", units="auto",
                    dtype="float32", target="h100", requires="transformers", parallel="fsdp-bf16", world_size=8,
                    clip_grad_norm=1.0,
                    args={"batch": 1, "seq": 4096, "n_layer": 32, "hidden": 4096, "intermediate": 14336,
                          "n_head": 32, "kv_heads": 8, "vocab": 128256})


FIGURES = [
    Figure("bert-bs4", "BERT-large cls, batch 4 x 512, fp32, AdamW", HF_PERF, 14949 * MiB, "nvidia-smi",
           _bert(4, 1, "fp32"), _none, 1343 * MiB, stack_2022=True),
    Figure("bert-ga4", "BERT-large cls, batch 1 x 512, 4 micro-batches, fp32", HF_PERF, 8681 * MiB, "nvidia-smi",
           _bert(1, 4, "fp32"), _none, 1343 * MiB, stack_2022=True),
    Figure("bert-ga4-gc", "the same, every layer checkpointed", HF_PERF, 6775 * MiB, "nvidia-smi",
           _bert(1, 4, "fp32"), _full, 1343 * MiB, stack_2022=True),
    Figure("bert-fp16", "BERT-large cls, batch 4 x 512, fp16 autocast + GradScaler", HF_PERF, 13939 * MiB,
           "nvidia-smi", _bert(4, 1, "amp-fp16"), _none, 1343 * MiB, stack_2022=True),
    Figure("llama3-8b-none", "Llama-3-8B, FSDP2 8 ranks, 1 x 4096, no checkpointing", TORCHAO,
           round(53.12 * GiB), "reserved", _llama3_8b_fsdp(), _none),
    Figure("llama3-8b-every2", "the same, every second layer checkpointed", TORCHAO, round(40.6 * GiB), "reserved",
           _llama3_8b_fsdp(), _every_second),
    Figure("llama3-8b-full", "the same, every layer checkpointed", TORCHAO, round(28.07 * GiB), "reserved",
           _llama3_8b_fsdp(), _full),
]


def estimated(sc: Scenario, as_2022: bool = False) -> memfit.Profile:
    """The step estimated for the figure's target; ``as_2022``: kept as torch 1.10 and transformers 4.15 kept it."""
    with stack_2022() if as_2022 else nullcontext():
        return estimate(lambda: sc.build("cpu"), target=sc.target_device(), units=sc.units, step=sc.train_step,
                        parallel=sc.parallel, world_size=sc.world_size or 1)


@dataclass(slots=True)
class Compared:
    """A figure's estimate turned into the published kind of number, two ways."""

    allocated: int  # memfit's predicted allocated peak of the source's checkpointing
    fixed: int  # allocated x (1 + the margin memfit plans with), plus the source's context
    modelled: int  # allocated x the allocator model's reserved over allocated, plus the context


def compared(f: Figure, prof: memfit.Profile) -> Compared:
    policies = f.checkpoint(prof.unit_names)
    allocated = memfit.predict(prof, policies).peak_bytes
    ratio = allocator_ratio(prof, policies)
    assert ratio is not None, "an estimate for a CUDA target has the allocator's model"
    return Compared(allocated, round(allocated * (1 + MARGIN)) + f.context_bytes,
                    round(allocated * ratio) + f.context_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="figures whose key starts with this (bert, llama3)")
    parser.add_argument("--today", action="store_true",
                        help="estimate every figure as today's torch and transformers run it, not as the source's did")
    args = parser.parse_args()
    profiles: dict[str, Any] = {}  # one estimate per distinct step, shared by its checkpointing variants
    rows, ratios = [], []
    for f in FIGURES:
        if args.only and not f.key.startswith(args.only):
            continue
        legacy = f.stack_2022 and not args.today
        key = repr((f.scenario, legacy))
        if key not in profiles:
            started = time.perf_counter()
            profiles[key] = estimated(f.scenario, legacy)
            print(f"estimated {f.key} in {time.perf_counter() - started:.0f} s", flush=True)
        c = compared(f, profiles[key])
        ratio, model_ratio = c.fixed / f.published_bytes, c.modelled / f.published_bytes
        ratios.append((ratio, model_ratio))
        rows.append([f.key, f.what, "2022" if legacy else "today's", f.kind, format_bytes(f.published_bytes),
                     format_bytes(c.allocated), format_bytes(c.fixed), f"{ratio:.3f}", format_bytes(c.modelled),
                     f"{model_ratio:.3f}"])
    print(table(["figure", "configuration", "stack", "published as", "published", "memfit allocated",
                 "+ margin, context", "ratio", "allocator model", "ratio"], rows,
                [False, False, False, False, True, True, True, True, True, True]))
    print(f"\nstack: '2022' estimates the step as the source's torch 1.10 and transformers of then (4.15) ran it "
          f"(softmax saving its input for the backward, BERT adding a mask of ones: benchmarks/legacy.py); "
          f"--today: as torch {torch.__version__} and transformers {version('transformers')} run it")
    print(f"+ margin, context: allocated x {1 + MARGIN:.2f} (the allocator margin memfit plans with), plus the "
          "CUDA context the source measured where its figure includes it (nvidia-smi)")
    print("allocator model: allocated x what the caching allocator's model reserved over what it allocated in the "
          "estimate's steps (measure/allocator.py; between every unit kept and every unit checkpointed, by the share "
          "checkpointed), plus the context")
    for k, name in enumerate(("fixed margin", "allocator model")):
        errors = [abs(r[k] - 1) for r in ratios]
        print(f"{name}: within 5% of the published figure {sum(e <= 0.05 for e in errors)} of {len(ratios)}, "
              f"mean error {sum(errors) / len(errors):.1%}, lowest ratio {min(r[k] for r in ratios):.3f}")
    for source in dict.fromkeys(f.source for f in FIGURES if not args.only or f.key.startswith(args.only)):
        print(f"source: {source}")


if __name__ == "__main__":
    main()
