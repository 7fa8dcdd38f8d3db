"""Scenarios: a model factory, its inputs and settings, from a TOML file or a ``module:factory``."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.errors import MemfitError
from memfit.factories import load_factory
from memfit.trainstep import OPTIMIZERS, TrainStep

if TYPE_CHECKING:  # torch is imported where a model is built: checking a schedule's source needs none
    import torch
    from torch import nn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

def _builtin_dir() -> Path:
    """The built-in scenario files: scenarios/ at the top of a checkout (one copy each, as the
    design names it), or inside the installed package, where the wheel carries them."""
    here = Path(__file__).parent
    installed = here / "builtin_scenarios"
    return installed if installed.is_dir() else here.parent / "scenarios"


BUILTIN_DIR = _builtin_dir()
DEFAULT = "gpt-750m"  # amp-bf16; does not fit 24 GB unplanned; estimated for an RTX 4090 where there is no GPU
DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name


@dataclass(slots=True)
class Scenario:
    name: str
    model: str  # "package.module:factory"; the factory returns (model, inputs) or a model
    description: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] | None = None  # random normal input, when the factory returns only a model
    optimizer: str = "adamw"
    units: str | list[str] = "auto"
    dtype: str = "float32"
    origin: str | None = None  # a built-in scenario's name or a TOML file's absolute path; None for --model
    target: str | None = None  # the device to estimate for when no GPU is at hand: a devices.py name or a spec file
    requires: str | None = None  # a package the factory imports (transformers), not a dependency of memfit's
    # the training step (trainstep.TrainStep): micro-batches, precision (None: dtype's own), clipping
    accumulate: int = 1
    precision: str | None = None
    clip_grad_norm: float | None = None
    zero_grad: str = "none"
    keep_output: bool = False
    autocast_cache: bool = True  # amp's autocast keeps its weight casts (False: Lightning's cache_enabled=False)
    parallel: str | None = None  # planned per rank: fsdp, fsdp-bf16, ddp or tp (formats.layout.PARALLEL)
    world_size: int | None = None  # ranks for parallel (default 2)
    # ranks per tensor-parallel group of a 2-D mesh beside FSDP2 (torchtitan's tensor_parallel_degree;
    # its data_parallel_shard_degree is world_size / tp), and whether the residual stream between
    # the products is sharded along the sequence between them
    tp: int | None = None
    sequence_parallel: bool = False
    # pipeline stages, torchtitan's pipeline_parallel_degree (with parallel: the ranks of each stage
    # are world_size), its schedule and micro-batches (defaults: 1F1B, 2 a stage)
    pp: int | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    # sequence lengths to plan for (one schedule, a plan each): the factory is called with its
    # ``seq`` argument at the longest, and each length's inputs are its inputs cut to that length
    seq_lens: list[int] | None = None
    seq_len: int | None = None  # the one length this scenario's inputs are cut to (one of seq_lens)

    @property
    def missing(self) -> str | None:
        """The package this scenario needs and this environment lacks; None when it has it."""
        import importlib.util

        return self.requires if self.requires and importlib.util.find_spec(self.requires) is None else None

    @property
    def step_optimizer(self) -> str | None:
        """The optimizer as ``profile``, ``make_optimizer`` and schedules take it: None for "none"."""
        return None if self.optimizer == "none" else self.optimizer

    @property
    def train_step(self) -> TrainStep:
        """The training step this scenario is trained with."""
        return TrainStep(self.step_optimizer, self.accumulate, self.precision, self.clip_grad_norm, self.zero_grad,
                         self.keep_output, self.autocast_cache)

    def target_device(self) -> Any:
        """The ``devices.Device`` of ``target``: a built-in name, or a device spec file beside the scenario."""
        from memfit.devices import device_spec, load_device_spec

        if self.target is None:
            raise MemfitError(f"scenario {self.name!r} names no target device")
        if not self.target.endswith(".toml"):
            return device_spec(self.target)
        here = Path(self.origin).parent if self.origin and self.origin.endswith(".toml") else Path.cwd()
        return load_device_spec(here / self.target)

    def build(self, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
        """Call the factory; move to the dtype and device; make inputs if the factory gave none."""
        import torch
        from torch import nn

        here = Path(self.origin).parent if self.origin and self.origin.endswith(".toml") else None
        factory = load_factory(self.model, here)
        if not callable(factory):
            raise MemfitError(f"{self.model} is not a function or class that builds a model")
        dtype = getattr(torch, self.dtype)
        args = dict(self.args)
        if self.seq_lens and "seq" in args:  # position tables and masks for the longest
            args["seq"] = max(self.seq_lens)
        try:
            # Built in the dtype, not cast after: half the memory while building, and fake
            # parameters (estimate mode) cannot be cast.
            with _default_dtype(dtype):
                made = factory(**args)
        except TypeError as exc:
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                raise  # raised inside the factory: the user's own error, reported with its place
            where = f"scenario {self.name!r}: " if self.origin else ""
            raise MemfitError(f"{where}calling {self.model} failed: {exc}") from None
        except SystemExit as exc:
            raise MemfitError(f"{self.model} called sys.exit({exc.code}) instead of returning a model") from None
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
            if self.input_shape:
                raise MemfitError(
                    f"{self.model} returns its own inputs, so an input shape (--input-shape or input_shape) "
                    "would be ignored: leave it out, or return only the model"
                )
            model, inputs = made
        elif isinstance(made, nn.Module):
            if not self.input_shape:
                raise MemfitError(
                    f"{self.model} returned only a model: give the input shape (--input-shape 8x3x224x224 "
                    "or input_shape = [...] in the scenario), or return (model, inputs)"
                )
            model, inputs = made, (torch.randn(*self.input_shape),)
        else:
            raise MemfitError(f"{self.model} must return an nn.Module or (module, inputs)")
        if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
            model = model.to(dtype)
        if dtype != torch.float32:
            inputs = _cast(inputs, dtype)
        if self.seq_len is not None:
            from memfit.lengths import cut_to_length

            inputs = cut_to_length(inputs, self.seq_len, self.name)
        device = torch.device(device)
        if device.type != "cpu":
            model = model.to(device)
            inputs = _cast(inputs, None, device)
        return model, inputs

    def parameter_count(self) -> int:
        """The model's parameters, built on the meta device: nothing allocated, a 7B model in
        a fraction of a second."""
        import torch

        with torch.device("meta"):
            model, _ = self.build("cpu")
        return sum(p.numel() for p in model.parameters())

    def source(self) -> dict[str, Any]:
        """What rebuilds this model and its inputs, as a schedule records it."""
        made_by: dict[str, Any] = {"scenario": self.origin} if self.origin else {"model": self.model}
        lengths = {"seq_lens": self.seq_lens, "seq_len": self.seq_len} if self.seq_len is not None else {}
        return {**made_by, "input_shape": self.input_shape, "units": self.units, "dtype": self.dtype, **lengths}

    def shapes(self) -> list[Scenario]:
        """This scenario once per sequence length it plans for (``seq_lens``), or itself."""
        if not self.seq_lens:
            return [self]
        return [dataclasses.replace(self, seq_len=n) for n in sorted(self.seq_lens)]


def scenario_from_source(source: dict[str, Any], *, trusted: bool) -> Scenario:
    """The scenario a schedule's or profile's ``source`` names (see ``Scenario.source``).

    Rebuilding a model imports and calls what the source names, and files travel between people:
    a file alone decides nothing that runs. Only a built-in scenario is rebuilt from it, unless
    ``trusted`` (the user named the same model on the command line, or gave --trust-source)."""
    builtin = bool(source.get("scenario")) and str(source["scenario"]) in builtin_names()
    if not builtin and not trusted and (source.get("scenario") or source.get("model")):
        raise MemfitError(
            f"the file says its model is built by {cli_flag(source)}; memfit would import and run that code to "
            "rebuild it, and a file must not decide what code runs: give those flags on the command line, as when "
            "it was planned, or add --trust-source to run what the file names")
    if source.get("scenario"):
        sc = load_scenario(str(source["scenario"]))
    elif source.get("model"):
        sc = Scenario(name=str(source["model"]), model=str(source["model"]))
    else:
        raise MemfitError("the schedule does not say which model it was made for; give --scenario or --model")
    sc.input_shape = source.get("input_shape") or sc.input_shape
    if source.get("seq_len") is not None:
        sc.seq_lens, sc.seq_len = list(source.get("seq_lens") or [source["seq_len"]]), int(source["seq_len"])
    sc.units = source.get("units", sc.units)
    sc.dtype = str(source.get("dtype", sc.dtype))
    if sc.dtype not in DTYPES:
        raise MemfitError(f"the schedule's source names dtype {sc.dtype!r}; known: {', '.join(DTYPES)}")
    return sc


def cli_flag(source: dict[str, Any]) -> str:
    """The command-line flags that rebuild ``source``'s model, for messages."""
    if source.get("scenario"):
        return f"--scenario {source['scenario']}"
    flags = f"--model {source.get('model')}"
    if source.get("input_shape"):
        flags += " --input-shape " + "x".join(str(d) for d in source["input_shape"])
    return flags


def _cast(obj: Any, dtype: torch.dtype | None, device: torch.device | None = None) -> Any:
    """Floating-point tensors to ``dtype``, every tensor to ``device``, through dicts and tuples."""
    import torch

    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            obj = obj.to(dtype)
        return obj if device is None else obj.to(device)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype, device) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_cast(v, dtype, device) for v in obj)
    return obj


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise MemfitError(f"{path}: is a directory, not a scenario file")
    if not path.is_file():
        raise MemfitError(f"{path}: no such scenario file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise MemfitError(f"{path}: not valid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MemfitError(f"{path}: cannot read ({exc})") from None


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name, or a TOML file by path; every field is checked."""
    path = Path(name_or_path)
    builtin = path.suffix != ".toml"
    if builtin:
        path = BUILTIN_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise MemfitError(
                f"no scenario named {name_or_path!r}; built-in scenarios: {', '.join(builtin_names())} "
                "(or give a path to a .toml file)"
            )
    data = _read_toml(path)
    known = {"description", "model", "args", "input_shape", "optimizer", "units", "dtype", "requires", "target",
             "accumulate", "precision", "clip_grad_norm", "zero_grad", "keep_output", "parallel", "world_size",
             "tp", "sequence_parallel", "seq_lens", "autocast_cache", "pp", "pp_schedule", "pp_microbatches"}
    unknown = set(data) - known
    if unknown:
        raise MemfitError(f"{path}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    if "model" not in data:
        raise MemfitError(f"{path}: missing field 'model' (module:factory)")

    def bad(key: str, what: str) -> MemfitError:
        return MemfitError(f"{path}: field {key!r} must be {what}, got {data[key]!r}")

    for key in ("model", "description", "requires", "target"):
        if key in data and not isinstance(data[key], str):
            raise bad(key, "a string")
    if not isinstance(data.get("args", {}), dict):
        raise bad("args", "a table of the factory's keyword arguments ([args] with name = value lines)")
    shape = data.get("input_shape")
    if shape is not None and not (
        isinstance(shape, list) and shape and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                  for d in shape)
    ):
        raise bad("input_shape", "a list of positive integers, e.g. [8, 3, 224, 224]")
    optimizer = data.get("optimizer", "adamw")
    if optimizer not in OPTIMIZERS:
        raise bad("optimizer", f"one of {', '.join(OPTIMIZERS)}")
    units = data.get("units", "auto")
    if not (isinstance(units, str) or (isinstance(units, list) and units and all(isinstance(u, str) for u in units))):
        raise bad("units", '"auto" or a list of module names or globs, e.g. ["layers.*"]')
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise bad("dtype", f"one of {', '.join(DTYPES)}")
    if "target" in data and not data["target"].endswith(".toml"):
        from memfit.devices import DEVICES

        if data["target"] not in DEVICES:
            raise bad("target", f"one of {', '.join(DEVICES)}, or a device spec file (.toml) beside the scenario")
    if "parallel" in data:
        from memfit.formats.layout import PARALLEL

        if data["parallel"] not in PARALLEL:
            raise bad("parallel", f"one of {', '.join(PARALLEL)}")
    world_size = data.get("world_size")
    if world_size is not None and not (isinstance(world_size, int) and not isinstance(world_size, bool)
                                       and world_size >= 2):
        raise bad("world_size", "an integer of at least 2")
    seq_lens = data.get("seq_lens")
    if seq_lens is not None:
        from memfit.lengths import parse_lengths

        try:
            seq_lens = parse_lengths(seq_lens)
        except MemfitError:
            raise bad("seq_lens", "a list of distinct positive integers, e.g. [512, 1024, 2048]") from None
    if world_size is not None and "parallel" not in data:
        raise MemfitError(f"{path}: world_size is the number of ranks for parallel: give parallel too")
    tp = data.get("tp")
    if tp is not None and not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 2):
        raise bad("tp", "an integer of at least 2 (ranks per tensor-parallel group)")
    if not isinstance(data.get("sequence_parallel", False), bool):
        raise bad("sequence_parallel", "true or false")
    if (tp is not None or data.get("sequence_parallel")) and "parallel" not in data:
        raise MemfitError(f"{path}: tp and sequence_parallel shape the ranks of parallel: give parallel too")
    if "parallel" in data:
        from memfit.formats.layout import layout_of

        try:
            layout_of(data["parallel"], world_size or 2, tp or 1, bool(data.get("sequence_parallel")))
        except MemfitError as exc:
            raise MemfitError(f"{path}: parallel, world_size, tp and sequence_parallel (as flags): {exc}") from None
    for key, least in (("pp", 2), ("pp_microbatches", 1)):
        if key in data and not (isinstance(data[key], int) and not isinstance(data[key], bool) and data[key] >= least):
            raise bad(key, f"an integer of at least {least}")
    if "pp_schedule" in data and not isinstance(data["pp_schedule"], str):
        raise bad("pp_schedule", 'a schedule\'s name, e.g. "1F1B"')
    if ("pp_schedule" in data or "pp_microbatches" in data) and "pp" not in data:
        raise MemfitError(f"{path}: pp_schedule and pp_microbatches describe the pipeline of pp: give pp too")
    try:
        step = TrainStep.from_fields(data)
    except MemfitError as exc:
        raise MemfitError(f"{path}: {exc}") from None
    return Scenario(
        name=path.stem,
        model=data["model"],
        description=data.get("description", ""),
        args=dict(data.get("args", {})),
        input_shape=shape,
        optimizer=optimizer,
        units=units,
        dtype=dtype,
        origin=name_or_path if builtin else str(path.resolve()),
        target=data.get("target"),
        requires=data.get("requires"),
        accumulate=step.accumulate,
        precision=step.precision,
        clip_grad_norm=step.clip_grad_norm,
        zero_grad=step.zero_grad,
        keep_output=step.keep_output,
        autocast_cache=step.autocast_cache,
        parallel=data.get("parallel"),
        world_size=world_size,
        tp=tp,
        sequence_parallel=bool(data.get("sequence_parallel", False)),
        seq_lens=seq_lens,
        pp=data.get("pp"),
        pp_schedule=data.get("pp_schedule"),
        pp_microbatches=data.get("pp_microbatches"),
    )
