"""Schedule: which units to checkpoint, and what the plan predicts, as versioned JSON."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from memfit.errors import FileFormatError
from memfit.jsonio import Fields, read_json, write_json_atomic
from memfit.policy import KINDS_HELP, read

if TYPE_CHECKING:
    from torch import nn  # only the fingerprint's argument: the optimizer and the CLI's checks run without torch

SCHEDULE_FORMAT = "memfit.schedule/1"


@dataclass(slots=True)
class Schedule:
    policies: dict[str, str]  # unit -> its policy, as memfit/policy.py spells it; in order
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
    # baseline name -> {"applies", "fits"[, "peak_bytes", "recompute_s", "overhead"]}
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer: str | None = "adamw"  # the optimizer whose state the plan counted
    device: str = "cpu"  # where the profile was measured
    source: dict[str, Any] = field(default_factory=dict)  # how the CLI built the model (see scenarios.py)
    # predicted (phase, live bytes at its start, its peak) for "plan" and "none", for timelines
    levels: dict[str, list[list[Any]]] = field(default_factory=dict)
    # tighter plans for memfit.tighten: budget_bytes, policies, predicted_peak_bytes, _recompute_s, _overhead
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    # planned for a step under torch.compile: {"backend", "peak_bytes" (its compiled step, measured)}
    compile: dict[str, Any] = field(default_factory=dict)
    target: str = ""  # the device the profile was estimated for (devices.py); "" when measured
    parallel: dict[str, Any] = field(default_factory=dict)  # {"kind": fsdp|ddp, "world_size"}: a plan per rank
    # loaded from a file whose policies were changed after planning: its predictions are another plan's
    edited: bool = False

    @property
    def checkpointed(self) -> list[str]:
        return [name for name, policy in self.policies.items() if policy != "none"]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically. The solve time is left out, so that the same profile and budget
        always give a byte-identical file."""
        data = asdict(self)
        del data["solve_s"], data["edited"]
        data["policies_sha256"] = policies_digest(self.policies)  # an edit by hand shows on load
        write_json_atomic(path, {"format": SCHEDULE_FORMAT, **data})


def policies_digest(policies: dict[str, str]) -> str:
    """What the predictions were made for; ``load_schedule`` compares it with the file's policies."""
    return hashlib.sha256(json.dumps(list(policies.items())).encode()).hexdigest()


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read a schedule written by ``Schedule.save`` / ``memfit plan -o``, checking every field."""
    f = Fields(read_json(path, SCHEDULE_FORMAT), str(path))
    policies = _policies(f.obj("policies"))
    baselines = f.obj("baselines").data if "baselines" in f.data else {}
    for name, figures in baselines.items():
        if not isinstance(figures, dict) or not all(
                isinstance(v, (bool, int, float)) for v in figures.values()):
            raise FileFormatError(f"{path}: field 'baselines' gives {name!r} {str(figures)[:60]}; "
                                  "expected an object of numbers")
    source = f.obj("source").data if "source" in f.data else {}
    for key, kinds in (("scenario", str), ("model", str), ("dtype", str), ("units", (str, list)),
                       ("input_shape", list)):
        if source.get(key) is not None and not isinstance(source[key], kinds):
            raise FileFormatError(f"{path}: field 'source.{key}' has an invalid value {source[key]!r}")
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
        baselines=dict(baselines),
        optimizer=f.opt_str("optimizer") if "optimizer" in f.data else "adamw",
        device=str(f.data.get("device", "cpu")),
        source=source,
        levels=_levels(f, str(path)),
        fallbacks=[_fallback(g, list(policies)) for g in (f.items("fallbacks") if "fallbacks" in f.data else [])],
        compile=_compile(f.obj("compile")) if f.data.get("compile") else {},
        target=str(f.data.get("target", "")),
        parallel=dict(f.obj("parallel").data) if f.data.get("parallel") else {},
        edited="policies_sha256" in f.data and f.data["policies_sha256"] != policies_digest(policies),
    )


def _compile(f: Fields) -> dict[str, Any]:
    return {"backend": f.str("backend"), "peak_bytes": f.int("peak_bytes", minimum=1)}


def _policies(f: Fields) -> dict[str, str]:
    for unit, policy in f.data.items():
        if read(policy) is None:
            raise FileFormatError(f"{f.where}: unit {unit!r} has the policy {policy!r}; expected {KINDS_HELP}")
    return dict(f.data)


def _fallback(f: Fields, units: list[str]) -> dict[str, Any]:
    policies = _policies(f.obj("policies"))
    if list(policies) != units:
        raise FileFormatError(f"{f.where}: its units differ from the schedule's")
    return {"budget_bytes": f.int("budget_bytes", minimum=1), "policies": policies,
            "predicted_peak_bytes": f.int("predicted_peak_bytes", minimum=0),
            "predicted_recompute_s": f.float("predicted_recompute_s", minimum=0.0),
            "predicted_overhead": f.float("predicted_overhead", minimum=0.0)}


def _levels(f: Fields, path: str) -> dict[str, list[list[Any]]]:
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
