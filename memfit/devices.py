"""Devices memfit can plan for without having one: memory, dense throughput and bandwidth, and
what a training step can really use of the memory.

Figures are the vendors' published peaks (dense, without sparsity), each with its source. Op
times in estimate mode are ``max(FLOPs / peak, bytes moved / bandwidth) / EFFICIENCY``: a
roofline, so an estimated slowdown ranks plans well but is not a stopwatch.

Memory (``MemoryRecord``): a plan's budget is compared with the caching allocator's *allocated*
peak; an out-of-memory error is about what the process holds on the card. Between the two sit
the CUDA context (kernels, cuBLAS handles: outside the allocator) and the allocator's *margin*
(its reserved peak over its allocated peak: block rounding, cached free blocks, fragmentation).
So a step can use ``(total − context) / (1 + margin)``: ``usable_bytes``. Both figures are
learned from CUDA runs: ``memfit validate`` on a GPU measures them and writes them as a device
spec (``--save-device-spec``), which ``--device-spec FILE`` reads.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from memfit.errors import MemfitError

if TYPE_CHECKING:
    import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GiB = 2**30
MiB = 2**20
EFFICIENCY = 0.6  # share of the peak that real kernels of a training step reach (a common rule of thumb)
# What an eager step pays on the host whatever the kernel (benchmarks/launch_bound.py measures
# both on the machine it runs on): each ATen op's dispatch and launch, a floor under its time
# (2,065 ops of a tiny GPT's step took 6 µs each on the CPU here, kernels included), and each op
# that runs while a Python saved-tensor hook is in force (derive, checkpoint regions, their
# recomputation), which hands its saved tensors to Python (5 to 8 µs per tensor measured here),
# and each op that passes through an op set's Python dispatch modes (PyTorch's selective
# checkpoint: the caching mode in the forward, the cached one in the recomputation; 17 to 19 µs
# per op the modes saw). benchmarks/host_costs.py measures all three on the machine it runs on.
LAUNCH_S = 6e-6
HOOK_S = 5e-6
DISPATCH_S = 18e-6
# Defaults until a run on the card says otherwise (docs/devices.md gives the measurements): what
# processes on A100, A800 and H200 held outside PyTorch's allocator in out-of-memory messages
# (0.49 to 0.51 GiB: context and library workspaces), and the reserved over allocated peaks of
# training runs that print both (Megatron-LM on H100: 1.133; a PyTorch sweep: 1.115, 1.112).
CONTEXT_BYTES = 512 * MiB
MARGIN = 0.12


class _Memory(TypedDict):
    title: str
    total_bytes: int  # what torch.cuda.mem_get_info() reports as total (a little under the marketed size)
    context_bytes: int  # held outside the caching allocator: CUDA context, loaded kernels
    margin: float  # the allocator's reserved peak / allocated peak - 1
    source: str


class MemoryRecord(_Memory, total=False):
    """What a device leaves to a training step, and where the figures come from (files hold it)."""

    # the card's reserved peak over what estimate mode's allocator model predicted for the same
    # plan, less one (learned by ``memfit validate --save-device-spec``); absent: 0
    over_model: float


def usable_bytes(memory: MemoryRecord) -> int:
    """What a step's allocated peak may reach: the total less the context, less the margin."""
    return math.floor((memory["total_bytes"] - memory["context_bytes"]) / (1 + memory["margin"]))


def describe_memory(memory: MemoryRecord) -> str:
    """``21.96 GiB usable (23.65 GiB total - 0.50 GiB CUDA context, / 1.05 allocator margin)``."""
    from memfit.budget import format_bytes

    return (f"{format_bytes(usable_bytes(memory))} usable on {memory['title']} "
            f"({format_bytes(memory['total_bytes'])} total, less {format_bytes(memory['context_bytes'])} for the CUDA "
            f"context, less a {memory['margin']:.0%} allocator margin)")


@dataclass(frozen=True, slots=True)
class Device:
    name: str  # key, as --target takes it
    title: str  # the product, for messages and for matching torch.cuda.get_device_name
    memory_bytes: int  # the total torch.cuda.mem_get_info() reports (see source)
    tflops: dict[str, float]  # dense, per dtype name: float32 (without TF32), tf32, bfloat16, float16
    bandwidth_gbs: float  # memory bandwidth, GB/s (10^9 bytes)
    source: str  # where memory_bytes, tflops and bandwidth come from
    cuda: bool = True  # allocations are rounded as the CUDA caching allocator rounds them
    context_bytes: int = CONTEXT_BYTES
    margin: float = MARGIN
    launch_s: float = LAUNCH_S  # host time per eager op: the least an op takes
    hook_s: float = HOOK_S  # host time per op under a Python saved-tensor hook
    dispatch_s: float = DISPATCH_S  # host time per op through an op set's Python dispatch modes
    over_model: float = 0.0  # MemoryRecord's: the card's reserved over the allocator model's, less one

    @property
    def memory(self) -> MemoryRecord | None:
        """The memory a step can use, as plans record it; None for the CPU (nothing to hold back)."""
        if not self.cuda:
            return None
        record = MemoryRecord(title=self.title, total_bytes=self.memory_bytes, context_bytes=self.context_bytes,
                              margin=self.margin, source=self.source)
        if self.over_model:
            record["over_model"] = self.over_model
        return record

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.memory) if self.memory else self.memory_bytes

    def flops_per_s(self, dtype: torch.dtype) -> float:
        key = str(dtype).removeprefix("torch.")  # no torch import: the CLI reads this table before loading torch
        return self.tflops.get(key if key in ("bfloat16", "float16") else "float32", self.tflops["float32"]) * 1e12

    def seconds(self, flops: float, nbytes: float, dtype: torch.dtype, hooked: bool = False,
                dispatched: bool = False) -> float:
        """One eager op: its roofline time, or the host's launch time where that is longer (a
        small op is launch-bound), plus the host's saved-tensor hook time when ``hooked`` and
        its Python dispatch modes' time when ``dispatched``."""
        kernel = max(flops / self.flops_per_s(dtype), nbytes / (self.bandwidth_gbs * 1e9)) / EFFICIENCY
        return (max(kernel, self.launch_s) + (self.hook_s if hooked else 0.0)
                + (self.dispatch_s if dispatched else 0.0))


def _gib(n: float) -> int:
    """A total as PyTorch's out-of-memory message prints it ("a total capacity of 79.15 GiB"),
    to the nearest MiB: the message rounds to 10 MiB, well inside the margin."""
    return round(n * 1024) * MiB


def _mib(n: int) -> int:
    """A total in MiB, as nvidia-smi prints it."""
    return n * MiB


def _tf(fp32: float, tf32: float, half: float) -> dict[str, float]:
    return {"float32": fp32, "tf32": tf32, "bfloat16": half, "float16": half}


# Compute and bandwidth: the vendors' datasheets, dense (the sheets' sparse tensor figures halved).
# Totals: what PyTorch itself reported on such a card (torch.cuda.get_device_properties /
# mem_get_info, or the "total capacity" an out-of-memory message prints), quoted in public issues;
# a card reports a little less on newer drivers (docs/devices.md gives every quote).
_V100 = {"float32": 15.7, "tf32": 15.7, "bfloat16": 15.7, "float16": 125}  # no bf16 tensor cores
_A100 = _tf(19.5, 156, 312)
_HOPPER = _tf(67, 494.5, 989.5)
_V100_SHEET = "images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_A100_SHEET = ("nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_H100_SHEET = "resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_A10_SHEET = "nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"

DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("v100-16gb", "Tesla V100-SXM2-16GB", _mib(16160), _V100, 900,
           "total_memory=16160MB (torch; nvidia-smi 16160MiB, github.com/microsoft/Bringing-Old-Photos-Back-to-Life/"
           f"issues/19; OOM '15.78 GiB total capacity', github.com/kchengiva/Shift-GCN/issues/34); {_V100_SHEET}"),
    Device("v100-32gb", "Tesla V100-SXM2-32GB", _gib(31.74), _V100, 900,
           f"OOM '31.74 GiB total capacity' on a V100 32GB, github.com/haotian-liu/LLaVA/issues/812; {_V100_SHEET}"),
    Device("t4", "Tesla T4", _mib(15109), {"float32": 8.1, "tf32": 8.1, "bfloat16": 8.1, "float16": 65}, 320,
           "total_memory=15109MB (torch; OOM '14.75 GiB total capacity', github.com/googlecolab/colabtools/"
           "issues/3439; newer drivers report 14.56 GiB); nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
           "t4-tensor-core-datasheet-951643.pdf"),
    Device("a10", "NVIDIA A10", _gib(23.70), _tf(31.2, 62.5, 125), 600,
           "OOM '23.70 GiB total capacity' on an A10, github.com/tatsu-lab/stanford_alpaca/issues/76 (one quote: with "
           f"ECC on it reports about the A10G's 22.2 GiB); {_A10_SHEET}"),
    Device("a10g", "NVIDIA A10G", _gib(22.20), _tf(31.2, 62.5, 125), 600,
           "OOM '22.20 GiB total capacity' on AWS g5, github.com/XavierXiao/Dreambooth-Stable-Diffusion/issues/18; "
           f"compute: the A10's ({_A10_SHEET}), as NVIDIA publishes no A10G sheet"),
    Device("l4", "NVIDIA L4", _gib(22.03), _tf(30.3, 60, 121), 300,
           "OOM 'a total capacity of 22.03 GiB' on an L4, github.com/ArcInstitute/evo2/issues/190; "
           "nvidia.com/en-us/data-center/l4/"),
    Device("l40s", "NVIDIA L40S", _mib(45589), _tf(91.6, 183, 362), 864,
           "total_memory=45589MB (torch; OOM 'a total capacity of 44.53 GiB' on an L40S, github.com/Wan-Video/Wan2.1/"
           "issues/205); resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    Device("a6000", "NVIDIA RTX A6000", _mib(48676), _tf(38.7, 77.4, 154.8), 768,
           "total_memory=48676MB (torch device properties quoted in a CUDA-mode benchmark README); "
           "nvidia.com/content/dam/en-zz/Solutions/design-visualization/quadro-product-literature/proviz-print-nvidia-rtx-a6000-datasheet-us-"
           "nvidia-1454980-r9-web.pdf"),
    Device("a100-40gb", "NVIDIA A100-SXM4-40GB", _mib(40536), _A100, 1555,
           "total_memory=40536MB (device properties; OOM 'a total capacity of 39.50 GiB' on a 2025 driver, "
           f"github.com/TianheWu/CoSeR/issues/10); {_A100_SHEET}"),
    Device("a100-80gb", "NVIDIA A100-SXM4-80GB", _gib(79.15), _A100, 2039,
           "79.15 GiB (torch's total in github.com/meta-pytorch/tnt/pull/616 and many OOM messages; 79.14 to 79.35 "
           f"GiB by driver); {_A100_SHEET}"),
    Device("h100", "NVIDIA H100 80GB HBM3", _mib(81089), _HOPPER, 3350,
           "SXM: total_memory=81089MB (torch 2.7, CUDA 12.8; vLLM's mem_get_info 79.22 GiB, github.com/vllm-project/"
           f"vllm/pull/10511; nvidia-smi 81559MiB); {_H100_SHEET}"),
    Device("h100-pcie", "NVIDIA H100 PCIe", _mib(81089), _tf(51, 378, 756), 2000,
           "total: no public quote found for the PCIe board: the SXM board's 81089MB (both 80 GB); "
           f"{_H100_SHEET}"),
    Device("h200", "NVIDIA H200", _mib(143156), _HOPPER, 4800,
           "total_memory=143156MB (torch, github.com/ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py; "
           "OOM 'a total capacity of 139.80 GiB' on 8xH200); H100's compute, 4.8 TB/s: "
           "nvidia.com/en-us/data-center/h200/; context: 751 to 775 MiB measured outside the allocator "
           "(benchmarks/gpu_check.py, torch 2.11+cu130, docs/cuda.md)",
           context_bytes=_mib(775)),
    Device("b200", "NVIDIA B200", _mib(182642), _tf(80, 1100, 2250), 8000,
           "total_memory=182642MB (torch, github.com/ai-bot-pro/achatbot as for h200; 'Total Global Memory: "
           "178.35 GB', github.com/pytorch/ao/pull/4002); BF16 2.25 PFLOPS dense, 8 TB/s: resources.nvidia.com/"
           "en-us-blackwell-architecture (FP32 and TF32 not confirmed)"),
    Device("mi250x", "AMD Instinct MI250X", _gib(63.98), _tf(47.9, 47.9, 191.5), 1600,
           "one GCD, as PyTorch sees it: HIP OOM 'a total capacity of 63.98 GiB' (a 64 GB GCD, github.com/RooCodeInc/"
           "Roo-Code/issues/6541; rocminfo 67092480 KB); per GCD: amd.com/en/products/accelerators/instinct/mi200/"
           "mi250x.html"),
    Device("mi300x", "AMD Instinct MI300X", _gib(191.98), _tf(163.4, 653.7, 1307.4), 5300,
           "HIP OOM 'a total capacity of 191.98 GiB' on MI300X (about ten agreeing quotes); amd.com/content/dam/amd/en/"
           "documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"),
    Device("rtx4090", "NVIDIA GeForce RTX 4090", _gib(23.65), _tf(82.6, 82.6, 165.2), 1008,
           "OOM 'a total capacity of 23.65 GiB' (23.64 to 23.68: github.com/zai-org/CogVideo/issues/36, github.com/"
           "kerrj/lerf/issues/73; nvidia-smi 24564MiB); images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-"
           "gpu-architecture.pdf (tensor FLOPS with FP32 accumulate)"),
    Device("rtx3090", "NVIDIA GeForce RTX 3090", _mib(24268), _tf(35.6, 35.6, 71), 936,
           "total_memory=24268MB (torch, quoted in the transformers docs; nvidia-smi 24268MiB, github.com/pytorch/"
           "pytorch/issues/54564); nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"),
    # This machine's kind: memory only (no CUDA rounding or context), to check estimates against the
    # CPU's exact measurements; its times are a rough 2-core figure, not a claim.
    Device("cpu", "CPU", _gib(24), {"float32": 0.1, "bfloat16": 0.05, "float16": 0.05}, 20,
           "not a GPU: the CPU this suite runs on, for checking estimates against exact CPU measurements", cuda=False),
)}


def device_spec(name: str) -> Device:
    key = name.lower().replace(" ", "").replace("_", "-")
    if key not in DEVICES:
        raise MemfitError(f"unknown target {name!r}; known: {', '.join(DEVICES)} (or describe your own with "
                          "--device-spec FILE.toml)")
    return DEVICES[key]


def target_title(target: str, memory: MemoryRecord | None) -> str:
    """The product a plan was estimated for: its memory record's title, else the table's for a
    built-in target (files older than the record), else "" (a spec file's card, unrecorded)."""
    known = DEVICES.get(target)
    return str(memory["title"]) if memory else known.title if known else ""


def by_title(title: str) -> Device | None:
    """The table's device whose product name torch.cuda.get_device_name gives, if any."""
    return next((d for d in DEVICES.values() if d.title.lower() == title.lower()), None)


SPEC_FIELDS = ("name", "title", "base", "memory", "context", "margin", "over_model", "tflops", "bandwidth_gbs",
               "launch_us", "hook_us", "dispatch_us", "source")


def load_device_spec(path: str | Path) -> Device:
    """A device described in a TOML file: ``base`` (a built-in name) gives what is not set; sizes
    are written as memfit's budgets are ("79.15GiB", or bytes)."""
    from memfit.budget import BudgetFormatError, parse_bytes

    path = Path(path)
    if not path.is_file():
        raise MemfitError(f"{path}: no such device spec file (a TOML file: name, memory, context, margin, ...)")
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise MemfitError(f"{path}: not a readable TOML file ({exc})") from None
    unknown = set(data) - set(SPEC_FIELDS)
    if unknown:
        raise MemfitError(f"{path}: unknown field(s) {sorted(unknown)}; known: {', '.join(SPEC_FIELDS)}")

    def size(key: str) -> int | None:
        if key not in data:
            return None
        value = data[key]
        try:
            return value if isinstance(value, int) and not isinstance(value, bool) else parse_bytes(str(value))
        except BudgetFormatError as exc:
            raise MemfitError(f"{path}: field {key!r}: {exc}") from None

    base = device_spec(str(data["base"])) if "base" in data else None
    if base is None and not {"memory", "tflops", "bandwidth_gbs"} <= set(data):
        raise MemfitError(f"{path}: give base = a built-in device ({', '.join(DEVICES)}), or memory, tflops and "
                          "bandwidth_gbs")
    tflops = data.get("tflops", base.tflops if base else {})
    if not isinstance(tflops, dict) or "float32" not in tflops or not all(
            isinstance(v, int | float) and v > 0 for v in tflops.values()):
        raise MemfitError(f"{path}: tflops must be a table of positive numbers with float32, e.g. "
                          "{ float32 = 19.5, bfloat16 = 312 }")
    margin = data.get("margin", base.margin if base else MARGIN)
    if not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise MemfitError(f"{path}: margin is reserved/allocated - 1, a number from 0 to 1, got {margin!r}")
    over_model = data.get("over_model", base.over_model if base else 0.0)
    if not isinstance(over_model, int | float) or isinstance(over_model, bool) or not 0 <= over_model < 1:
        raise MemfitError(f"{path}: over_model is the card's reserved over the allocator model's - 1, a number "
                          f"from 0 to 1, got {over_model!r}")
    bandwidth = data.get("bandwidth_gbs", base.bandwidth_gbs if base else 0)
    if not isinstance(bandwidth, int | float) or bandwidth <= 0:
        raise MemfitError(f"{path}: bandwidth_gbs must be a positive number (GB/s)")
    host: dict[str, float] = {}
    for key, default in (("launch_us", base.launch_s if base else LAUNCH_S),
                         ("hook_us", base.hook_s if base else HOOK_S),
                         ("dispatch_us", base.dispatch_s if base else DISPATCH_S)):
        value = data.get(key, default * 1e6)
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise MemfitError(f"{path}: {key} must be a number of microseconds, 0 or more (the host's time per op)")
        host[key.replace("_us", "_s")] = float(value) * 1e-6
    for key in ("name", "title", "source"):
        if key in data and not isinstance(data[key], str):
            raise MemfitError(f"{path}: field {key!r} must be a string")
    fields: dict[str, Any] = {
        "name": data.get("name", path.stem), "title": data.get("title", base.title if base else path.stem),
        "memory_bytes": size("memory") or (base.memory_bytes if base else 0), "tflops": dict(tflops),
        "bandwidth_gbs": float(bandwidth), "margin": float(margin), "over_model": float(over_model),
        "context_bytes": size("context") if "context" in data else (base.context_bytes if base else CONTEXT_BYTES),
        "source": data.get("source", f"{path.name}" + (f", else {base.name}'s: {base.source}" if base else "")),
        **host,
    }
    spec = replace(base, **fields) if base else Device(**fields)
    if spec.context_bytes >= spec.memory_bytes:
        raise MemfitError(f"{path}: the context ({spec.context_bytes} bytes) is not less than the memory")
    return spec


def spec_toml(*, name: str, title: str, base: str | None, total: int, context: int, margin: float,
              source: str, over_model: float | None = None) -> str:
    """A device spec file's text, as ``load_device_spec`` reads it (``memfit validate
    --save-device-spec`` writes the context and margin a run on the card measured, and, for a plan
    made in estimate mode, how far its reserved peak was over the allocator model's)."""
    from memfit.budget import format_bytes

    lines = [f"# {title}: {format_bytes(total)} total; measured {format_bytes(context)} outside the allocator and a "
             f"{margin:.1%} reserved-over-allocated margin", f"name = {_quoted(name)}", f"title = {_quoted(title)}"]
    if base:
        lines.append(f"base = {_quoted(base)}  # compute and bandwidth from memfit's table")
    else:
        lines += ["# not in memfit's table: give the card's dense TFLOPS and bandwidth for estimates",
                  "tflops = { float32 = 1.0 }", "bandwidth_gbs = 1.0"]
    lines += [f"memory = {total}", f"context = {context}", f"margin = {round(margin, 4)}"]
    if over_model is not None:
        lines.append(f"over_model = {round(over_model, 4)}  # reserved over the allocator model's prediction - 1")
    lines.append(f"source = {_quoted(source)}")
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
