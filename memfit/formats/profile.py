"""Profile: what the profiler measured about one model, input and optimizer, as versioned JSON.

The memory part is a timeline of phases. Each phase moves the live-bytes level by ``end_bytes``
and reaches ``peak_bytes`` above the level it started at. Unit phases carry one such pair per
option (memfit/policy.py: ``none``, ``full``, and finer ones), remainder phases (embedding,
head, loss, optimizer step) one pair.
Walking the timeline from ``baseline_bytes`` gives the step's peak for any choice of options.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from memfit.devices import MemoryRecord
from memfit.errors import FileFormatError
from memfit.formats.layout import ParallelLayout
from memfit.formats.records import choice_field, positive_field, raise_field, read_memory, read_parallel, read_step
from memfit.jsonio import Fields, read_json, write_json_atomic
from memfit.policy import COARSE, FULL, KEEP, Option, Segment, read
from memfit.trainstep import CUSTOM, OPTIMIZERS, StepRecord, TrainStep

if TYPE_CHECKING:
    import pandas as pd

PROFILE_FORMAT = "memfit.profile/1"
PROFILES_FORMAT = "memfit.profiles/1"  # one model's profiles at several input shapes
@dataclass(slots=True)
class OptionCost:
    """What one way of running a unit costs, measured in a step where every unit ran that way."""

    fwd_peak_bytes: int  # highest level during the unit's forward, above the level it began at
    stored_bytes: int  # level change over the forward: what the unit keeps until its backward
    bwd_peak_bytes: int  # highest level during the unit's backward, above the level it began at
    bwd_end_bytes: int  # level change over the backward (frees what was kept, adds gradients)
    recompute_s: float  # extra time this option costs per step
    # the backward of a later run in the step (a later micro-batch, or a user step's second
    # forward), whose gradients exist already and accumulate in place; None: no later run
    later_bwd_peak_bytes: int | None = None
    later_bwd_end_bytes: int | None = None
    # amp: parameter casts that autocast's cache alone holds at the forward's end, freed when
    # the step leaves autocast (a ``releases`` phase), beyond what the unit kept frees there
    release_bytes: int = 0
    # how far ``recompute_s`` is sure: the uncertainty of the step's measured overhead
    # (measure/timing.ratio_uncertainty), split as the cost is (profiler/costs.py); 0: not measured
    # (estimates, repeat < 3)
    recompute_uncertainty_s: float = 0.0
    # what the remainder after each forward of the unit frees beyond what it frees when the unit
    # is ``none``: an output the unit kept for its backward, dropped by the model's own code once
    # checkpointed (``x = x + block(x)`` with a closing ReLU); freed at that remainder's end.
    # Negative where the option keeps more there: a checkpoint keeps its input, which the plain
    # step frees once the next unit has cast it (BERT's fp32 hidden state under autocast)
    freed_after_bytes: int = 0
    # the same, freed one unit later: at the end of the remainder after the *next* unit's forward
    # (an output the model's loop holds until the next block returns, as GPT-Neo's and BLOOM's
    # attention probabilities are; autograd would have kept it)
    freed_later_bytes: int = 0
    # how much higher the remainder right after each forward of the unit peaks than when the unit
    # is ``none`` (negative: lower); the last unit's ``derive`` re-derives the final norm's output,
    # which the head keeps otherwise (runtime/derive.py's tail), so the loss runs beside less
    after_peak_bytes: int = 0
    # the unit keeps tensors made outside the units (a mask, position ids, the rotary tables that
    # the model makes once and hands every block) past the forward, as a checkpoint region that
    # takes them does: with it in a plan, the remainders end and peak as in the all-checkpointed
    # step (``Phase.ckpt_end_bytes``, ``ckpt_peak_bytes``). Measured for a finer option (its step
    # ends and peaks no remainder higher than the plain one: ``derive``, a child region that takes
    # no such tensor); ``full`` and segments always keep them, ``none`` never
    holds_outside: bool = True

    def backward(self, later: bool) -> tuple[int, int]:
        """(peak, end) of the backward: the first run's, or a later run's."""
        if later and self.later_bwd_peak_bytes is not None and self.later_bwd_end_bytes is not None:
            return self.later_bwd_peak_bytes, self.later_bwd_end_bytes
        return self.bwd_peak_bytes, self.bwd_end_bytes


@dataclass(slots=True)
class UnitProfile:
    name: str
    fwd_s: float
    bwd_s: float
    input_bytes: int  # bytes of the unit's tensor inputs (what a checkpoint keeps)
    saved_bytes: int  # saved for backward, deduplicated by storage, parameters excluded, by producer
    param_bytes: int
    options: dict[Option, OptionCost]  # the measured options' costs, none and full first
    output_bytes: int = 0  # bytes of the unit's tensor output (freed inside a checkpointed segment)
    # recompute time as a segment member before the last, whose forward runs again at the last
    # member's backward and whose own backward then finds its tensors out of the cache: measured
    # in a step of units checkpointed two by two (profiler/costs.add_members); None: not measured
    # (older profiles, units that are no chain), priced as ``full``
    member_s: float | None = None
    member_uncertainty_s: float = 0.0

    @property
    def fwd_transient_bytes(self) -> int:
        o = self.options[KEEP]
        return max(0, o.fwd_peak_bytes - o.stored_bytes)

    @property
    def bwd_transient_bytes(self) -> int:
        o = self.options[KEEP]
        return max(0, o.bwd_peak_bytes)


@dataclass(slots=True)
class Phase:
    """One stretch of the step between two marks; ``unit`` is None for the remainder.

    A remainder phase can end and peak higher when some unit is checkpointed: tensors made
    outside the units (position ids, masks) that a checkpoint keeps for its recompute are not
    freed with the forward. ``ckpt_end_bytes`` is the end level change then, ``ckpt_peak_bytes``
    the peak (None: ``peak_bytes``; the two runs' larger); ``peak_with`` reads them.
    """

    label: str
    unit: int | None = None
    kind: str = "remainder"  # "remainder", "forward" or "backward"
    peak_bytes: int = 0
    end_bytes: int = 0
    ckpt_end_bytes: int = 0
    later: bool = False  # a unit's backward after its first in the step: OptionCost.backward(later=True)
    releases: bool = False  # leaving autocast: the level also falls by each unit's option's release_bytes
    ckpt_peak_bytes: int | None = None

    def peak_with(self, checkpointed: bool) -> int:
        """The remainder's peak above its start: with some unit that holds outside tensors
        (``OptionCost.holds_outside``) or without."""
        if checkpointed and self.ckpt_peak_bytes is not None:
            return max(self.peak_bytes, self.ckpt_peak_bytes)
        return self.peak_bytes


def after_forwards(phases: list[Phase]) -> dict[int, int]:
    """Each remainder phase that directly follows a unit's forward, mapped to that unit: the
    phase at whose end the unit's option's ``freed_after_bytes`` leave the level."""
    return {t + 1: prev.unit for t, (prev, p) in enumerate(itertools.pairwise(phases))
            if prev.kind == "forward" and prev.unit is not None and p.unit is None and not p.releases}


@dataclass(slots=True)
class Profile:
    model_class: str
    device: str
    optimizer: str | None
    input_shapes: str
    baseline_bytes: int  # live at step start: parameters, buffers, optimizer state, inputs
    param_bytes: int
    grad_bytes: int
    buffer_bytes: int
    optimizer_state_bytes: int
    input_bytes: int
    step_s: float  # one un-checkpointed training step
    units: list[UnitProfile]
    phases: list[Phase]
    fingerprint: dict[str, Any]
    measured_peak_bytes: dict[Option, int] = field(default_factory=dict)  # per all-units option
    # estimated for a CUDA target: what the caching allocator's model (measure/allocator.py)
    # reserves at the peak of each all-units option's step, beside its allocated peak; {} otherwise
    reserved_peak_bytes: dict[Option, int] = field(default_factory=dict)
    chain: bool = False  # each unit's output is the next one's only input: segments are possible
    recompute_factor: float = 1.0  # measured recompute time / first forward time, all units
    rng_state_bytes: int = 0  # device bytes of the RNG state a checkpoint keeps (CPU: 5056, CUDA: 0)
    torch_version: str = ""
    source: dict[str, Any] = field(default_factory=dict)  # how the CLI built the model (see scenarios.py)
    mode: str = "measured"  # or "estimated": from shapes on fake tensors, for ``target``
    target: str = ""  # the device estimated for (devices.py); "" when measured
    parallel: ParallelLayout | None = None  # one rank's; None for one process
    step: StepRecord | None = None  # the training step (trainstep.py); None: the plain one of older files
    # what the GPU leaves to a step (devices.py): the target's, or the CUDA device's measured; None: the CPU
    memory: MemoryRecord | None = None

    @property
    def train_step(self) -> TrainStep:
        """The step this profile was measured in (trainstep.TrainStep.of_record)."""
        return TrainStep.of_record(self.optimizer, self.step)

    @property
    def fine(self) -> bool:
        """Some unit has an option finer than none / full (profiled with granularity="fine")."""
        return any(len(u.options) > len(COARSE) for u in self.units)

    @property
    def segmentable(self) -> bool:
        """Segments can be planned: the units form a chain, and the step leaves no autocast (a
        segment's recompute under autocast holds weight casts its composed costs do not count)."""
        return self.chain and not any(p.releases for p in self.phases)

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    def to_frame(self) -> pd.DataFrame:
        """One row a unit: times in seconds, memory in bytes."""
        import pandas as pd

        rows = []
        for u in self.units:
            none, full = u.options[KEEP], u.options[FULL]
            rows.append(
                {
                    "unit": u.name,
                    "fwd_s": u.fwd_s,
                    "bwd_s": u.bwd_s,
                    "input_bytes": u.input_bytes,
                    "saved_bytes": u.saved_bytes,
                    "param_bytes": u.param_bytes,
                    "stored_none_bytes": none.stored_bytes,
                    "stored_full_bytes": full.stored_bytes,
                    "fwd_transient_bytes": u.fwd_transient_bytes,
                    "bwd_peak_none_bytes": none.bwd_peak_bytes,
                    "bwd_peak_full_bytes": full.bwd_peak_bytes,
                    "recompute_s": full.recompute_s,
                }
            )
        return pd.DataFrame(rows).set_index("unit")

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them; a step without later runs as before they existed."""
        data = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        for u in data["units"]:
            for o in u["options"].values():
                for key, unset in (("later_bwd_peak_bytes", None), ("later_bwd_end_bytes", None), ("release_bytes", 0),
                                   ("recompute_uncertainty_s", 0.0), ("freed_after_bytes", 0),
                                   ("freed_later_bytes", 0), ("after_peak_bytes", 0), ("holds_outside", True)):
                    if o[key] == unset:
                        del o[key]
        for p in data["phases"]:
            for key in ("later", "releases", "ckpt_peak_bytes"):
                if not p[key]:
                    del p[key]
        for key in ("step", "memory", "reserved_peak_bytes"):
            if not data[key]:
                del data[key]
        data["parallel"] = data["parallel"] or {}  # the file's spelling of one process
        return data

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, {"format": PROFILE_FORMAT, **self.to_dict()})

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Profile:
        return profile_from_dict(read_json(path, PROFILE_FORMAT), str(path))


def _plain(value: Any) -> Any:
    """``value`` as JSON takes it: ``asdict``, with options (policy values) as keys spelt."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, UnitProfile):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    return asdict(value) if is_dataclass(value) else value


def save_profiles(profiles: list[Profile], path: str | os.PathLike[str]) -> None:
    """One profile as ``Profile.save`` writes it; several (one model at several input shapes) in
    one file of format ``memfit.profiles/1``, atomically."""
    if len(profiles) == 1:
        profiles[0].save(path)
    else:
        write_json_atomic(path, {"format": PROFILES_FORMAT, "profiles": [p.to_dict() for p in profiles]})


def load_profiles(path: str | os.PathLike[str]) -> list[Profile]:
    """The profiles in a file ``save_profiles`` wrote: one, or one per input shape."""
    data = read_json(path, None)
    if data["format"] == PROFILE_FORMAT:
        return [profile_from_dict(data, str(path))]
    if data["format"] != PROFILES_FORMAT:
        raise FileFormatError(f"{path}: field 'format' is {data['format']!r}; expected {PROFILE_FORMAT} or "
                              f"{PROFILES_FORMAT}")
    items = Fields(data, str(path)).items("profiles")
    if not items:
        raise FileFormatError(f"{path}: field 'profiles' is empty")
    return [profile_from_dict(f.data, f.where) for f in items]


def profile_from_dict(data: dict[str, Any], where: str = "profile") -> Profile:
    f = Fields(data, where)
    units = [_unit(u) for u in f.items("units")]
    phases = [_phase(p, len(units)) for p in f.items("phases")]
    _check_timeline(f, units, phases)
    optimizer = f.opt_str("optimizer")
    if optimizer not in (None, *(o for o in OPTIMIZERS if o != "none")) and not (optimizer or "").startswith(CUSTOM):
        raise_field(where, "optimizer", optimizer)  # None: no optimizer
    for key, kind in (("chain", bool), ("recompute_factor", (int, float)), ("source", dict)):
        if key in data and not isinstance(data[key], kind):
            raise_field(where, key, data[key])
    if not float(data.get("recompute_factor", 1.0)) > 0:
        raise_field(where, "recompute_factor", data.get("recompute_factor"))
    measured = f.obj("measured_peak_bytes")
    reserved = f.obj("reserved_peak_bytes") if "reserved_peak_bytes" in data else None
    return Profile(
        model_class=f.str("model_class"),
        device=f.str("device"),
        optimizer=optimizer,
        input_shapes=f.str("input_shapes"),
        baseline_bytes=f.int("baseline_bytes"),
        param_bytes=f.int("param_bytes"),
        grad_bytes=f.int("grad_bytes"),
        buffer_bytes=f.int("buffer_bytes"),
        optimizer_state_bytes=f.int("optimizer_state_bytes"),
        input_bytes=f.int("input_bytes"),
        step_s=positive_field(f, "step_s"),
        units=units,
        phases=phases,
        fingerprint=f.obj("fingerprint").data,
        measured_peak_bytes={_option(measured, k): measured.int(k) for k in measured.data},
        reserved_peak_bytes=({_option(reserved, k): reserved.int(k) for k in reserved.data}
                             if reserved is not None else {}),
        torch_version=str(data.get("torch_version", "")),
        chain=bool(data.get("chain", False)),
        rng_state_bytes=int(data.get("rng_state_bytes", 0)),
        recompute_factor=float(data.get("recompute_factor", 1.0)),
        source=f.obj("source").data if "source" in data else {},
        mode=choice_field(f, "mode", ("measured", "estimated"), "measured"),
        target=str(data.get("target", "")),
        parallel=read_parallel(f),
        step=read_step(f),
        memory=read_memory(f),
    )


def _unit(u: Fields) -> UnitProfile:
    opts = u.obj("options")
    options = {}
    coarse = [str(o) for o in COARSE]
    for name in [*coarse, *(k for k in opts.data if k not in coarse)]:
        o = opts.obj(name)
        options[_option(opts, name)] = OptionCost(
            o.int("fwd_peak_bytes"), o.int("stored_bytes"), o.int("bwd_peak_bytes"),
            o.int("bwd_end_bytes"), o.float("recompute_s", minimum=0.0),
            *(o.int(k) if o.data.get(k) is not None else None for k in ("later_bwd_peak_bytes", "later_bwd_end_bytes")),
            o.int("release_bytes", minimum=0) if "release_bytes" in o.data else 0,
            o.float("recompute_uncertainty_s", minimum=0.0) if "recompute_uncertainty_s" in o.data else 0.0,
            o.int("freed_after_bytes") if "freed_after_bytes" in o.data else 0,
            o.int("freed_later_bytes", minimum=0) if "freed_later_bytes" in o.data else 0,
            o.int("after_peak_bytes") if "after_peak_bytes" in o.data else 0,
            o.bool("holds_outside") if "holds_outside" in o.data else True,
        )
    return UnitProfile(
        u.str("name"), u.float("fwd_s", minimum=0.0), u.float("bwd_s", minimum=0.0),
        u.int("input_bytes", minimum=0), u.int("saved_bytes", minimum=0), u.int("param_bytes", minimum=0),
        options, u.int("output_bytes", minimum=0),
        u.float("member_s", minimum=0.0) if u.data.get("member_s") is not None else None,
        u.float("member_uncertainty_s", minimum=0.0) if "member_uncertainty_s" in u.data else 0.0,
    )


def _option(f: Fields, name: str) -> Option:
    """The option a profile's key spells (every policy but a segment is one)."""
    option = read(name)
    if option is None or isinstance(option, Segment):
        raise_field(f.where, "options", f"unknown option {name!r}")
    return option  # type: ignore[return-value]


def _phase(p: Fields, n_units: int) -> Phase:
    unit = p.data.get("unit")
    if unit is not None and (not isinstance(unit, int) or not 0 <= unit < n_units):
        raise_field(p.where, "unit", unit)
    kind = p.str("kind")
    if kind not in ("remainder", "forward", "backward"):
        raise_field(p.where, "kind", kind)
    later, releases = p.data.get("later", False), p.data.get("releases", False)
    if not isinstance(later, bool) or (later and kind != "backward"):
        raise_field(p.where, "later", later)
    if not isinstance(releases, bool) or (releases and unit is not None):
        raise_field(p.where, "releases", releases)
    ckpt_peak = p.int("ckpt_peak_bytes") if p.data.get("ckpt_peak_bytes") is not None else None
    return Phase(p.str("label"), unit, kind, p.int("peak_bytes"), p.int("end_bytes"), p.int("ckpt_end_bytes"), later,
                 releases, ckpt_peak)


def _check_timeline(f: Fields, units: list[UnitProfile], phases: list[Phase]) -> None:
    """Unique unit names; each unit runs forward and backward as often, its first backward not
    a later one; later backwards need every option's later figures."""
    names = [u.name for u in units]
    if not units or len(set(names)) != len(names):
        raise_field(f.where, "units", "none" if not units else f"names repeat: {names}")
    for i, u in enumerate(units):
        fwd = sum(p.kind == "forward" for p in phases if p.unit == i)
        bwd = [p.later for p in phases if p.unit == i and p.kind == "backward"]
        if fwd < 1 or fwd != len(bwd) or bwd[0] or not all(bwd[1:]):
            counts = f"{fwd} forward and {len(bwd)} backward" if fwd or bwd else "no"
            raise_field(f.where, "phases", f"unit {u.name!r} has {counts} phases, not a forward and a backward "
                                           "for each run (the first backward first, later ones after)")
        if len(bwd) > 1 and any(o.later_bwd_peak_bytes is None or o.later_bwd_end_bytes is None
                                for o in u.options.values()):
            raise_field(f.where, "units", f"unit {u.name!r} runs more than once but lacks later_bwd_* figures")
