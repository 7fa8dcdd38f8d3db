"""Flag groups that several commands share: the model and training step, granularity, keeping the
profile; and the title a command puts on its pictures."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.formats.layout import PARALLEL
from memfit.trainstep import OPTIMIZERS, PRECISIONS, ZERO_GRADS

Command = Callable[[str, str], argparse.ArgumentParser]  # a subcommand's parser, by name and help


def granularity_flags(p: argparse.ArgumentParser, fine: str) -> None:
    p.add_argument("--granularity", choices=["module", "fine"], default="module",
                   help=f"module: whole units only (default); fine: {fine}")
    p.add_argument("--children", nargs="+", metavar="NAME",
                   help="with --granularity fine: the unit children to offer, by relative name (attn mlp.0 "
                   "attn+mlp), instead of the ones memfit picks")


def save_profile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-profile", metavar="FILE",
                   help="also keep the profile this run measures, to plan again with --profile FILE without "
                   "profiling (nothing else is written unasked)")


def trust_source_flag(p: argparse.ArgumentParser, file_flag: str) -> None:
    p.add_argument("--trust-source", action="store_true",
                   help=f"rebuild the model that the {file_flag} file names (imports and runs its code); without it, "
                   "only built-in scenarios are rebuilt from a file")


def profile_file_flags(p: argparse.ArgumentParser) -> None:
    """--profile, planning from a file instead of profiling, and --trust-source for it."""
    p.add_argument("--profile", help="a profile JSON from `memfit profile` (skips profiling)")
    trust_source_flag(p, "--profile")


def source_flags(p: argparse.ArgumentParser, *, validate: bool = False) -> None:
    title = ("model (default: the one the schedule was made for)" if validate
             else "model (default: the built-in gpt-750m scenario)")
    g = p.add_argument_group(title)
    g.add_argument("--scenario", help="a built-in scenario name or a scenario .toml file")
    g.add_argument("--model", help="your own model: module:factory returning a model or (model, inputs)")
    g.add_argument("--args", nargs="+", metavar="NAME=VALUE",
                   help="keyword arguments for the factory, typed as in a scenario's [args] (batch=64 image=1024 "
                   "name='tiny' dims=[64,128]); over the scenario's own")
    if validate:
        g.add_argument("--input-shape", help="random input shape when the factory returns only a model, e.g. "
                       "8x3x224x224")
    else:
        g.add_argument("--input-shape", action="append",
                       help="random input shape when the factory returns only a model, e.g. 8x3x224x224; give it "
                       "several times for one schedule with a plan per shape (224 and 384 pixels: --input-shape "
                       "8x3x224x224 --input-shape 8x3x384x384)")
        g.add_argument("--seq-lens", metavar="N,N,...",
                       help="plan for these sequence lengths, one schedule with a plan each, e.g. 512,1024,2048: the "
                       "factory builds the model at the longest (its seq argument) and each length's inputs are "
                       "its inputs cut to it; at run time each batch runs the plan of the shortest planned length "
                       "that covers it (default: the scenario's seq_lens, else its one shape)")
    g.add_argument("--units", nargs="+", help="unit module names or globs (default: the repeated blocks)")
    s = p.add_argument_group("training step (default: the scenario's, else adamw, one micro-batch, its dtype)"
                             + (": by default the one planned for" if validate else ""))
    s.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="optimizer whose state and step count; -foreach / -fused force its kernels (plain: PyTorch's "
                   "choice for the device)")
    s.add_argument("--accumulate", type=int, metavar="N",
                   help="micro-batches per optimizer step (gradient accumulation; the loss divided by N)")
    s.add_argument("--precision", choices=PRECISIONS,
                   help="a pure dtype (the model's), or amp-bf16 / amp-fp16: fp32 weights and optimizer state, "
                   "autocast over forward and loss (a GradScaler for fp16)")
    s.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                   help="clip_grad_norm_ to MAX before each optimizer step")
    s.add_argument("--zero-grad", choices=ZERO_GRADS,
                   help="none: zero_grad(set_to_none=True) (default); zeros: gradients stay allocated")
    s.add_argument("--keep-output", action="store_true", default=None,
                   help="the loop holds the model's output (logits) through the backward, as "
                   "`out = model(**batch); out.loss.backward()` does")
    s.add_argument("--no-autocast-cache", dest="autocast_cache", action="store_false", default=None,
                   help="with amp-*: autocast(cache_enabled=False), as Lightning's bf16-mixed/16-mixed run it")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    if not validate:
        from memfit.devices import DEVICES

        g.add_argument("--target", help=f"estimate for this device without having it, from shapes: "
                       f"{', '.join(DEVICES)} "
                       "(default: measure here; with no GPU here, a scenario's own target)")
        g.add_argument("--device-spec", metavar="FILE",
                       help="a TOML file describing your GPU (name, memory, context, margin, tflops, bandwidth_gbs, or "
                       "base = a built-in to start from): estimate for it, or with --device cuda, plan against its "
                       "context and margin (memfit validate --save-device-spec writes one from a run)")
        g.add_argument("--parallel", choices=PARALLEL,
                       help="plan per rank: measure one of --world-size processes under FSDP2 (fully_shard per unit "
                       "and the root; fsdp-bf16: with MixedPrecisionPolicy, bf16 params, fp32 reduce), DDP, or tensor "
                       "parallelism by a Hugging Face model's own plan (tp: its config's base_model_tp_plan) (gloo "
                       "on the CPU, one GPU each with NCCL)")
        g.add_argument("--world-size", type=int, help="ranks for --parallel (default: 2); with --pp, the ranks "
                       "that hold each stage")
        g.add_argument("--tp", type=int, metavar="N",
                       help="with --parallel fsdp or fsdp-bf16: a 2-D mesh of --world-size/N FSDP2 shards by N "
                       "tensor-parallel ranks (torchtitan's data_parallel_shard_degree and tensor_parallel_degree), "
                       "tensor parallelism by the model's own Hugging Face plan")
        g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                       help="with --tp or --parallel tp: shard the norms and residuals between the products along "
                       "the sequence, as torchtitan and Megatron-LM do (Korthikanti et al.); --no-sequence-parallel "
                       "turns off a scenario's")
        g.add_argument("--repeat", type=int,
                       help="timed rounds of plain and all-checkpointed steps when profiling (default: 5)")


def title(made: Any, what: str) -> str:
    """Model, inputs, precision (the step's: amp-bf16, not the weights' float32), the device or the
    target it was estimated for, and optimizer of a profile or a schedule, for a picture."""
    source = made.source
    name = (Path(str(source["scenario"])).stem if source.get("scenario")
            else source.get("model") or made.fingerprint.get("model_class", "model"))
    precision = (made.step or {}).get("precision") or source.get("dtype")  # amp-bf16 over float32 weights
    dtype = f" - {precision}" if precision else ""
    where = f"estimated for {made.target}" if made.target else made.device
    return f"{name}: {what}\ninputs {made.input_shapes}{dtype} - {where}, optimizer {made.optimizer}"
