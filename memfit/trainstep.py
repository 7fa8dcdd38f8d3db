"""The training step a plan is made for, as a record: optimizer, micro-batches, precision, clipping.

A plan's peak is the peak of one optimizer step as the user's loop runs it, so the profile is
measured in that step and the schedule records it: ``validate`` runs it again, and ``apply``
leaves the user's loop alone. This module holds the record and its JSON form (no torch); the
step itself runs in measure/step.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from memfit.errors import MemfitError

# Optimizers by name. The plain name is PyTorch's default kernel choice for the parameters'
# device (foreach on CUDA, one tensor at a time on the CPU); -foreach, -fused and -single (one
# tensor at a time, as Hugging Face's own AdamW stepped) force one.
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw-fused", "adamw-single", "adam", "adam-foreach", "adam-fused", "sgd",
              "sgd-momentum", "sgd-momentum-foreach", "adafactor", "none")
# Pure dtypes (weights, gradients and optimizer state all in it) or autocast over fp32 weights.
PRECISIONS = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")
AMP = ("amp-bf16", "amp-fp16")
ZERO_GRADS = ("none", "zeros")  # optimizer.zero_grad(set_to_none=True), or gradients kept as zeros
CUSTOM = "custom:"  # prefix of a callable optimizer's recorded name
STEP_HELP = ("the training step: --optimizer NAME, --accumulate N micro-batches, --precision "
             f"{'|'.join(PRECISIONS)}, --clip-grad-norm MAX, --zero-grad {'|'.join(ZERO_GRADS)}")

OptimizerFactory = Callable[[list[Any]], Any]  # params -> torch.optim.Optimizer


class StepRecord(TypedDict, total=False):
    """A step as profiles and schedules store it (beside their ``optimizer`` name)."""

    accumulate: int
    precision: str
    clip_grad_norm: float | None
    zero_grad: str
    keep_output: bool
    autocast_cache: bool  # only when False: autocast(cache_enabled=False), as Lightning's mixed precision runs
    function: str  # a step function of the user's own (its qualified name): profile(step_fn=...)


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One optimizer step of a training loop.

    ``optimizer``: a name in OPTIMIZERS (``None`` or ``"none"``: no optimizer) or a callable
    ``params -> torch.optim.Optimizer``; ``accumulate``: micro-batches per optimizer step, each
    with the loss divided by it (the gradients live from the first micro-batch's backward on);
    ``precision``: a pure dtype, ``amp-bf16`` or ``amp-fp16`` (fp32 weights and state, autocast
    over forward and loss, a ``GradScaler`` for fp16), or None for the model's own dtype;
    ``clip_grad_norm``: ``clip_grad_norm_`` to this norm before the step; ``zero_grad``:
    ``"none"`` (set to None) or ``"zeros"`` (gradients stay allocated across steps);
    ``keep_output``: the loop holds the model's output in a variable until the next forward
    returns, through the backward, the optimizer's step and into the next step, as nanoGPT's
    ``logits, loss = model(X, Y)`` and Hugging Face's ``outputs = model(**batch)`` do (by default
    it is dropped once the loss is made, as in ``loss = loss_fn(model(x))``); ``autocast_cache``:
    amp's autocast keeps its cache of weight casts to the forward's end (PyTorch's default), or
    not (False: ``cache_enabled=False``, as Lightning's ``*-mixed`` precisions run, where each op
    casts the weights it uses afresh)."""

    optimizer: str | OptimizerFactory | None = "adamw"
    accumulate: int = 1
    precision: str | None = None
    clip_grad_norm: float | None = None
    zero_grad: str = "none"
    keep_output: bool = False
    autocast_cache: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, str) and self.optimizer.lower() not in OPTIMIZERS:
            raise MemfitError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}, or pass "
                              "a callable params -> torch.optim.Optimizer in Python")
        if not (self.optimizer is None or isinstance(self.optimizer, str) or callable(self.optimizer)):
            raise MemfitError(f"optimizer must be a name or a callable, got {type(self.optimizer).__name__}")
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) or self.accumulate < 1:
            raise MemfitError(f"accumulate must be a whole number of micro-batches >= 1, got {self.accumulate!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise MemfitError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        clip = self.clip_grad_norm
        if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
            raise MemfitError(f"clip_grad_norm must be a positive number (the largest gradient norm), got {clip!r}")
        if not isinstance(self.keep_output, bool):
            raise MemfitError(f"keep_output must be True or False, got {self.keep_output!r}")
        if not isinstance(self.autocast_cache, bool):
            raise MemfitError(f"autocast_cache must be True or False, got {self.autocast_cache!r}")
        if not self.autocast_cache and not self.amp:
            raise MemfitError("autocast_cache=False is a setting of autocast: give it with precision amp-bf16 or "
                              "amp-fp16")
        if self.zero_grad not in ZERO_GRADS:
            raise MemfitError(f"zero_grad must be one of {', '.join(ZERO_GRADS)}, got {self.zero_grad!r}")

    @property
    def optimizer_name(self) -> str | None:
        """The name profiles and schedules record: None for no optimizer, ``custom:<name>`` for a callable."""
        if self.optimizer is None:
            return None
        if isinstance(self.optimizer, str):
            return None if self.optimizer.lower() == "none" else self.optimizer.lower()
        return CUSTOM + getattr(self.optimizer, "__qualname__", type(self.optimizer).__name__)

    @property
    def amp(self) -> bool:
        return self.precision in AMP

    @property
    def plain(self) -> bool:
        """One micro-batch, no autocast, no clipping, gradients set to None, the output dropped."""
        return (self.accumulate == 1 and not self.amp and self.clip_grad_norm is None and self.zero_grad == "none"
                and not self.keep_output)  # autocast_cache is only set with amp

    def record(self) -> StepRecord:
        """The JSON form; ``keep_output`` and ``autocast_cache`` only when not the default, so
        that older files read the same."""
        record = StepRecord(accumulate=self.accumulate, precision=self.precision or "",
                            clip_grad_norm=None if self.clip_grad_norm is None else float(self.clip_grad_norm),
                            zero_grad=self.zero_grad)
        if self.keep_output:
            record["keep_output"] = True
        if not self.autocast_cache:
            record["autocast_cache"] = False
        return record

    @staticmethod
    def from_fields(record: Mapping[str, Any], optimizer: str | OptimizerFactory | None = None) -> TrainStep:
        """The step fields of a record (a profile's or schedule's ``step``, a scenario file),
        checked as any TrainStep is, with ``optimizer``."""
        return TrainStep(optimizer, record.get("accumulate", 1), record.get("precision") or None,
                         record.get("clip_grad_norm"), record.get("zero_grad", "none"),
                         record.get("keep_output", False), record.get("autocast_cache", True))

    @staticmethod
    def of_record(optimizer: str | None, record: StepRecord | None) -> TrainStep:
        """The step a profile or a schedule was made for. A callable optimizer cannot be rebuilt
        from its name: such a step is refused here, and Python callers pass it again."""
        record = record or StepRecord()
        if record.get("function"):
            raise MemfitError(f"this plan was made for a step function of your own ({record['function']}), which "
                              "memfit cannot rebuild from a file: in Python pass step_fn= again")
        if optimizer is not None and optimizer.startswith(CUSTOM):
            raise MemfitError(f"this plan was made with the optimizer {optimizer}, a callable memfit cannot rebuild "
                              "from a file: in Python pass step=TrainStep(optimizer=your_factory, ...) again")
        return TrainStep.from_fields(record, optimizer)

    def describe(self) -> str:
        """``adamw, amp-bf16, 3 micro-batches, clip 1.0`` (the defaults left out)."""
        parts = [self.optimizer_name or "no optimizer"]
        parts += [self.precision] if self.precision else []
        parts += [f"{self.accumulate} micro-batches"] if self.accumulate > 1 else []
        parts += [f"clip {self.clip_grad_norm:g}"] if self.clip_grad_norm is not None else []
        parts += ["gradients zeroed, not freed"] if self.zero_grad == "zeros" else []
        parts += ["output kept through the backward"] if self.keep_output else []
        parts += ["autocast without its weight-cast cache"] if not self.autocast_cache else []
        return ", ".join(parts)


def step_difference(optimizer: str | None, record: StepRecord | None, given: TrainStep) -> str | None:
    """What differs between the step a plan was made for (its optimizer's name and step record)
    and ``given``, in words; None when the plan holds for it. A precision not given is the
    model's own, which the fingerprint checks."""
    planned = TrainStep.from_fields(record or {})
    mine = {**given.record(), "precision": given.precision or planned.precision or ""}
    if given.optimizer_name == optimizer and mine == planned.record():
        return None
    return f"planned for {describe_record(optimizer, record)}, not {given.describe()}"


def describe_record(optimizer: str | None, record: StepRecord | None) -> str:
    """``adamw, amp-bf16, 2 micro-batches`` for a recorded step, its optimizer by the recorded
    name (a callable's ``custom:<name>`` too, which no TrainStep can hold)."""
    return TrainStep.from_fields(record or {}).describe().replace("no optimizer", optimizer or "no optimizer", 1)


def step_of(step: TrainStep | None, optimizer: str | OptimizerFactory | None = "adamw") -> TrainStep:
    """``step``, or the plain step with ``optimizer``: ``optimizer=`` is the short spelling every
    entry point keeps for a step that differs only in its optimizer."""
    if step is None:
        return TrainStep(optimizer=optimizer)
    if not isinstance(step, TrainStep):
        raise MemfitError(f"step must be a memfit.TrainStep, got {type(step).__name__}")
    if optimizer != "adamw" and optimizer != step.optimizer:
        raise MemfitError("give the optimizer once: inside step=TrainStep(optimizer=...), not also as optimizer=")
    return step
