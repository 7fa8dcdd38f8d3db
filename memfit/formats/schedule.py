"""Schedule: which units to checkpoint, and what the plan predicts, as versioned JSON."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from memfit.devices import MemoryRecord
from memfit.errors import FileFormatError
from memfit.formats.layout import ParallelLayout
from memfit.formats.records import read_memory, read_parallel, read_step
from memfit.jsonio import Fields, read_json, write_json_atomic
from memfit.policy import KEEP, KINDS_HELP, Policy, read, spelt
from memfit.trainstep import StepRecord, TrainStep

if TYPE_CHECKING:
    from torch import nn  # only the fingerprint's argument: the optimizer and the CLI's checks run without torch

SCHEDULE_FORMAT = "memfit.schedule/1"


class BaselineFigures(TypedDict, total=False):
    """How a baseline strategy did at the schedule's budget: its own plan's figures where it fits,
    its tightest schedule's where it does not; none where it has no schedule (``applies``)."""

    applies: bool
    fits: bool
    peak_bytes: int
    recompute_s: float
    overhead: float
    uncertainty_s: float  # how sure recompute_s is (planning/peak.Prediction.uncertainty_s)


class Fallback(TypedDict):
    """A tighter plan for ``memfit.tighten``, for the same units."""

    budget_bytes: int
    policies: dict[str, Policy]
    predicted_peak_bytes: int
    predicted_recompute_s: float
    predicted_overhead: float


class _Compiled(TypedDict):
    backend: str
    peak_bytes: int


class CompiledPeak(_Compiled, total=False):
    """A plan for the step under ``torch.compile``: its backend and the compiled step's measured
    peak; and, where the plan is compiled under the partitioner's own activation memory budget
    (0 to 1; steps/compiled_budget.py), that budget: the backend is then
    ``memfit.compile_backend(schedule)``, not the name alone."""

    memory_budget: float


class PipelineRank(TypedDict):
    """A plan for one rank of a pipeline (memfit plan --pp): the schedule by torch's name, the
    ranks and stages, the micro-batches a step, and this rank."""

    schedule: str
    ranks: int
    stages: int
    microbatches: int
    rank: int


class Source(TypedDict, total=False):
    """How the CLI built the model (scenarios.py), so that ``validate`` can build it again."""

    scenario: str | None
    model: str | None
    dtype: str | None
    units: str | list[str] | None
    input_shape: list[int] | None
    seq_lens: list[int] | None  # the lengths planned for (scenarios.Scenario.seq_lens), and this plan's
    seq_len: int | None


_AT_LEAST_0 = {"peak_bytes": 0, "recompute_s": 0.0, "overhead": 0.0, "uncertainty_s": 0.0}
Levels = dict[str, list[list[Any]]]  # "plan" / "none" -> [phase, live bytes at its start, its peak] each


@dataclass(slots=True)
class Schedule:
    policies: dict[str, Policy]  # unit -> its policy (memfit/policy.py); in order
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_recompute_s: float
    predicted_overhead: float  # recompute time / un-checkpointed step time
    strategy: str  # "ilp" or a baseline's name
    solver: str
    solver_status: str
    solve_s: float | None  # not saved (it would make identical plans differ): None once loaded
    fingerprint: dict[str, Any]
    input_shapes: str = ""
    baselines: dict[str, BaselineFigures] = field(default_factory=dict)  # by baseline name
    optimizer: str | None = "adamw"  # the optimizer whose state the plan counted
    device: str = "cpu"  # where the profile was measured
    source: Source = field(default_factory=lambda: Source())
    levels: Levels = field(default_factory=dict)  # predicted, for timelines
    fallbacks: list[Fallback] = field(default_factory=list)  # tighter each
    compile: CompiledPeak | None = None  # None for the eager step
    target: str = ""  # the device the profile was estimated for (devices.py); "" when measured
    parallel: ParallelLayout | None = None  # a plan per rank; None for one process
    step: StepRecord | None = None  # the training step planned for; None: the plain one of older files
    memory: MemoryRecord | None = None  # the profile's device memory; None: none (the CPU)
    # the budget asked for, where it was more than the device's usable memory and the plan was made
    # for that instead (budget_bytes); None when budget_bytes is the budget asked for
    asked_budget_bytes: int | None = None
    # how sure predicted_recompute_s is: the measured uncertainty of its options' costs (0: not measured)
    predicted_uncertainty_s: float = 0.0
    # loaded from a file whose policies were changed after planning: its predictions are another plan's
    edited: bool = False
    # planned for several input shapes (plan([profile, ...])): one plan per shape, smallest first,
    # each a Schedule of its own; the fields above are then the largest shape's (the worst case)
    shapes: list[Schedule] = field(default_factory=list)
    share: float | None = None  # a shape's fraction of the steps, from a length histogram; None: not given
    pipeline: PipelineRank | None = None  # one rank's plan of a pipeline; None: no pipeline
    # estimate mode: what the caching allocator's model has this plan reserve over its allocated peak
    # (planning/peak.allocator_ratio); validate on the card learns the device's margin above it
    reserved_ratio: float | None = None

    @property
    def train_step(self) -> TrainStep:
        """The step the plan was made for (trainstep.TrainStep.of_record)."""
        return TrainStep.of_record(self.optimizer, self.step)

    @property
    def checkpointed(self) -> list[str]:
        return [name for name, policy in self.policies.items() if policy != KEEP]

    @property
    def plans(self) -> list[Schedule]:
        """One schedule per planned input shape, smallest first: ``shapes``, or this one alone."""
        return self.shapes or [self]

    @property
    def expected_overhead(self) -> float:
        """The slowdown a run sees on average: each shape's weighted by its share of the steps
        (equal shares where none were given)."""
        plans = self.plans
        shares = [p.share if p.share is not None else 1.0 for p in plans]
        return sum(s * p.predicted_overhead for s, p in zip(shares, plans, strict=True)) / (sum(shares) or 1.0)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them (``--json``); a plain step's empty record left out, so
        that a profile older than the step record plans to the file it planned to then."""
        data = asdict(self)
        data["policies"] = spelt(self.policies)  # asdict would write each policy's fields, not its spelling
        for fallback, mine in zip(data["fallbacks"], self.fallbacks, strict=True):
            fallback["policies"] = spelt(mine["policies"])
        for key in ("step", "memory", "asked_budget_bytes", "predicted_uncertainty_s", "shapes", "pipeline"):
            if not data[key]:
                del data[key]
        for key in ("compile", "parallel"):  # the file's spelling of the eager step and of one process
            data[key] = data[key] or {}
        for key in ("share", "reserved_ratio"):
            if data.get(key) is None:
                del data[key]
        if self.shapes:  # each shape keeps only what is its own; a reader merges it with the rest
            data["shapes"] = [{k: v for k, v in shape.to_dict().items() if k in PER_SHAPE} for shape in self.shapes]
        return data

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically. The solve time is left out, so that the same profile and budget
        always give a byte-identical file."""
        data = self.to_dict()
        del data["solve_s"], data["edited"]
        data["policies_sha256"] = policies_digest(data["policies"])  # an edit by hand shows on load
        for shape in data.get("shapes", []):
            shape["policies_sha256"] = policies_digest(shape["policies"])
        write_json_atomic(path, {"format": SCHEDULE_FORMAT, **data})


# what differs between the plans of one schedule's input shapes
PER_SHAPE = ("policies", "predicted_peak_bytes", "predicted_recompute_s", "predicted_overhead", "strategy", "solver",
             "solver_status", "input_shapes", "baselines", "source", "levels", "fallbacks", "predicted_uncertainty_s",
             "share", "policies_sha256")


def policies_digest(policies: dict[str, str]) -> str:
    """What the predictions were made for, from the policies as the file spells them;
    ``load_schedule`` compares it with the file's policies."""
    return hashlib.sha256(json.dumps(list(policies.items())).encode()).hexdigest()


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule written by ``Schedule.save`` / ``memfit plan -o``, checking every field."""
    data = read_json(path, SCHEDULE_FORMAT)
    f = Fields(data, str(path))
    shapes = []
    for k, entry in enumerate(f.items("shapes") if "shapes" in data else []):
        unknown = set(entry.data) - set(PER_SHAPE)
        if unknown:
            raise FileFormatError(f"{path}: shapes[{k}] has fields a shape's plan does not: {sorted(unknown)}")
        merged = {key: v for key, v in data.items() if key not in PER_SHAPE and key != "shapes"} | entry.data
        shapes.append(_schedule(Fields(merged, f"{path}: shapes[{k}]"), f"{path}: shapes[{k}]"))
    if shapes and list(shapes[-1].policies) != list(_policies(f.obj("policies"))):
        raise FileFormatError(f"{path}: the units of its shapes' plans differ from its own")
    schedule = _schedule(f, str(path))
    schedule.shapes = shapes
    return schedule


def _schedule(f: Fields, path: str) -> Schedule:
    policies = _policies(f.obj("policies"))
    baselines = f.obj("baselines") if "baselines" in f.data else Fields({}, str(path))
    for name, figures in baselines.data.items():
        if not isinstance(figures, dict):
            raise FileFormatError(f"{path}: field 'baselines' gives {name!r} {str(figures)[:60]}; "
                                  "expected an object of numbers")
    fingerprint = f.obj("fingerprint")
    for key in ("model_class", "units", "params_sha256"):
        if key not in fingerprint.data:
            raise FileFormatError(f"{path}: field 'fingerprint' lacks {key!r}")
    return Schedule(
        policies=policies,
        budget_bytes=f.int("budget_bytes", minimum=1),
        predicted_peak_bytes=f.int("predicted_peak_bytes", minimum=0),
        predicted_recompute_s=f.float("predicted_recompute_s", minimum=0.0),
        predicted_overhead=f.float("predicted_overhead", minimum=0.0),
        strategy=f.str("strategy"),
        solver=f.str("solver"),
        solver_status=f.str("solver_status"),
        solve_s=None,
        fingerprint=fingerprint.data,
        input_shapes=str(f.data.get("input_shapes", "")),
        baselines={name: baselines.obj(name).record(BaselineFigures, _AT_LEAST_0) for name in baselines.data},
        optimizer=f.opt_str("optimizer") if "optimizer" in f.data else "adamw",
        device=str(f.data.get("device", "cpu")),
        source=Source(**Fields(f.obj("source").data, str(path), "source.").record(Source))
        if "source" in f.data else Source(),
        levels=_levels(f, str(path)),
        fallbacks=[_fallback(g, list(policies)) for g in (f.items("fallbacks") if "fallbacks" in f.data else [])],
        compile=(f.obj("compile").record(CompiledPeak, {"peak_bytes": 1, "memory_budget": 0.0})
                 if f.data.get("compile") else None),
        target=str(f.data.get("target", "")),
        parallel=read_parallel(f),
        step=read_step(f),
        memory=read_memory(f),
        asked_budget_bytes=f.int("asked_budget_bytes", minimum=1) if "asked_budget_bytes" in f.data else None,
        predicted_uncertainty_s=(f.float("predicted_uncertainty_s", minimum=0.0)
                                 if "predicted_uncertainty_s" in f.data else 0.0),
        edited="policies_sha256" in f.data and f.data["policies_sha256"] != policies_digest(f.obj("policies").data),
        share=f.float("share", minimum=0.0) if f.data.get("share") is not None else None,
        pipeline=f.obj("pipeline").record(PipelineRank, {"ranks": 2, "stages": 2, "microbatches": 1, "rank": 0})
        if f.data.get("pipeline") else None,
        reserved_ratio=f.float("reserved_ratio", minimum=1.0) if f.data.get("reserved_ratio") is not None else None,
    )


def _policies(f: Fields) -> dict[str, Policy]:
    policies = {}
    for unit, text in f.data.items():
        if (policy := read(text)) is None:
            raise FileFormatError(f"{f.where}: unit {unit!r} has the policy {text!r}; expected {KINDS_HELP}")
        policies[unit] = policy
    return policies


def _fallback(f: Fields, units: list[str]) -> Fallback:
    policies = _policies(f.obj("policies"))
    if list(policies) != units:
        raise FileFormatError(f"{f.where}: its units differ from the schedule's")
    fallback = f.record(Fallback, {"budget_bytes": 1, "predicted_peak_bytes": 0, "predicted_recompute_s": 0.0,
                                   "predicted_overhead": 0.0})
    return Fallback(**{**fallback, "policies": policies})


def _levels(f: Fields, path: str) -> Levels:
    levels = f.obj("levels").data if "levels" in f.data else {}
    for key, series in levels.items():
        if not isinstance(series, list) or not all(
                isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in e[1:]) for e in series):
            raise FileFormatError(f"{path}: field 'levels.{key}' must be a list of [phase, level, peak]")
    return levels


def model_fingerprint(model: nn.Module, unit_names: list[str]) -> dict[str, Any]:
    """Class, unit names, a hash of parameter names, shapes and dtypes, and one of the units'
    settings: enough to tell that a schedule was made for this architecture, without depending on
    the weights' values. The settings are what changes a unit's activations for the same
    parameters: the plain attributes of the modules inside the units (a GPT-2 attention's
    ``num_heads``, dropout's ``p``, ReLU's ``inplace``, a norm's ``eps``) and a Hugging Face
    config's attention implementation; not the model's own (a step counter there is no setting)."""
    digest = hashlib.sha256()
    count = 0
    dtypes: dict[str, int] = {}
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
        count += p.numel()
        key = str(p.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + p.numel()
    settings = hashlib.sha256()
    modules = dict(model.named_modules())
    for unit in unit_names:
        for name, module in modules[unit].named_modules(prefix=unit) if unit in modules else ():
            settings.update(f"{name}:{_settings(module)}\n".encode())
    base = type(model)
    # FSDP2's fully_shard swaps in a subclass (FSDP<Name>): the model is still its own class
    base = next((c for c in base.__mro__ if not c.__name__.startswith("FSDP")), base)
    return {
        "model_class": f"{base.__module__}.{base.__qualname__}",
        "units": list(unit_names),
        "params_sha256": digest.hexdigest(),
        "hparams_sha256": settings.hexdigest(),
        "param_count": count,
        "param_dtypes": dict(sorted(dtypes.items())),  # elements per dtype, to say what differs
    }


def fingerprint_difference(expected: dict[str, Any], actual: dict[str, Any]) -> str:
    """What differs between two fingerprints whose parameter hashes differ, in words."""
    said = []
    if expected.get("param_dtypes") and set(expected["param_dtypes"]) != set(actual.get("param_dtypes", {})):
        said.append(f"parameter dtypes {_dtypes(expected['param_dtypes'])} in the schedule, "
                    f"{_dtypes(actual['param_dtypes'])} in the model")
    if "param_count" in expected and expected["param_count"] != actual["param_count"]:
        said.append(f"{expected['param_count']:,} parameters in the schedule, {actual['param_count']:,} in the model")
    return "; ".join(said) or "the same number and dtypes of parameters under other names or shapes"


def _dtypes(counts: dict[str, int]) -> str:
    return " and ".join(counts) if len(counts) > 1 else next(iter(counts), "none")


_SIMPLE = (bool, int, float, str, type(None))
# attributes that change while a model trains or is planned, not what it is
_VOLATILE = {"training", "gradient_checkpointing", "forward"}


def _settings(module: nn.Module) -> str:
    values = {k: v for k, v in vars(module).items() if not k.startswith("_") and k not in _VOLATILE and (
        isinstance(v, _SIMPLE) or (isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v)))}
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if attn is not None:
        values["config._attn_implementation"] = attn
    return repr(sorted(values.items()))
