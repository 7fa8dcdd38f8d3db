"""What the trainer callbacks (hftrainer.py, lightning.py) and the accelerate recipe share: the
training step a trainer runs, read off its optimizer and settings as a ``TrainStep``; the first
batch, taken without moving the trainer's random state; and a step's measured peak.

No trainer library is imported here: each callback reads its own settings and calls these.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch

from memfit.budget import format_bytes
from memfit.errors import MemfitError
from memfit.formats.schedule import Schedule
from memfit.measure.memory import memory_recorder, peak_from
from memfit.measure.step import storage_bytes
from memfit.torch_private import tree_flatten, tree_map
from memfit.trainstep import TrainStep

log = logging.getLogger("memfit")

# A trainer's mixed-precision names (Lightning's, accelerate's, HF's flags) -> memfit's precision
PRECISIONS = {"bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16", "bf16": "amp-bf16", "fp16": "amp-fp16",
              "bf16-true": "bf16", "16-true": "fp16", "32-true": None, "32": None, "no": None, None: None}


def real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a trainer's wrapper (accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``)."""
    for attr in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return real_optimizer(inner)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise MemfitError(f"memfit needs the trainer's torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


def optimizer_of(optimizer: Any) -> str | Any:
    """memfit's name for a trainer's optimizer when it has one (AdamW, Adam, SGD with their
    kernel choice), else a factory that builds the same class with the same settings: either
    way the profile counts the state and step temporaries the trainer's optimizer will have."""
    opt = real_optimizer(optimizer)
    d = opt.defaults
    kernel = "-fused" if d.get("fused") else {True: "-foreach", False: "-single", None: ""}[d.get("foreach")]
    plain = not d.get("amsgrad") and not d.get("capturable") and not d.get("differentiable")
    if type(opt) in (torch.optim.AdamW, torch.optim.Adam) and plain:
        return ("adamw" if type(opt) is torch.optim.AdamW else "adam") + kernel
    if type(opt) is torch.optim.SGD and kernel in ("", "-foreach") and not d.get("nesterov"):
        if not d.get("momentum"):
            return "sgd" if not kernel else _factory(opt)
        return "sgd-momentum" + kernel
    return _factory(opt)


def _factory(opt: torch.optim.Optimizer) -> Any:
    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}  # AdamW's keeps decoupled_weight_decay

    def build(params: list[Any]) -> torch.optim.Optimizer:
        return cls(params, **defaults)

    # the step's record (and fit's cache key) says custom:<class>(<its flags that are on>), e.g.
    # custom:AdamW(amsgrad): settings that change the state or temporaries, not numbers such as lr
    flags = [k for k, v in sorted(defaults.items()) if v is True]
    build.__qualname__ = f"{cls.__name__}({', '.join(flags)})" if flags else cls.__name__
    return build


def train_step(optimizer: Any, *, precision: str | None, accumulate: int, clip: float | None,
               autocast_cache: bool = True) -> TrainStep:
    """The step a trainer runs; ``precision`` in the trainer's own words (PRECISIONS);
    ``autocast_cache``: whether its autocast keeps its weight casts (False: Lightning's)."""
    if precision not in PRECISIONS:
        raise MemfitError(f"memfit does not know the precision {precision!r}; use one of "
                          f"{', '.join(str(p) for p in PRECISIONS if p)}")
    return TrainStep(optimizer=optimizer_of(optimizer), accumulate=int(accumulate), precision=PRECISIONS[precision],
                     clip_grad_norm=float(clip) if clip else None,
                     autocast_cache=autocast_cache or PRECISIONS[precision] not in ("amp-bf16", "amp-fp16"))


def first_batch(loader: Iterable[Any], device: torch.device | str | None = None) -> Any:
    """The loader's first batch (on ``device``), taken with the random state put back after, so
    that the trainer's shuffling and dropout are those of a run without memfit."""
    with torch.random.fork_rng(devices=_cuda_devices()):
        batch = next(iter(loader))
    if device is None:
        return batch
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor)]


def bytes_of(batch: Any) -> int:
    """The bytes of a batch's tensors."""
    return storage_bytes(_tensors(batch))


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


class StepPeak:
    """The peak of the steps between ``start`` and ``stop``: on CUDA the allocator's allocated
    peak; on the CPU what lives at the start (parameters, buffers, gradients, optimizer state,
    the batch) plus the highest rise the exact CPU meter sees. The meter slows a CPU step, so
    callbacks measure the first steps only."""

    def __init__(self) -> None:
        self._recorder: Any = None
        self._start = 0
        self.peak_bytes = 0  # the highest of the steps measured so far

    def start(self, model: torch.nn.Module, optimizer: Any, batch: Any = None, batch_bytes: int = 0) -> None:
        """Start measuring a step of ``model``; ``batch``: the step's batch, made before it started
        (or ``batch_bytes``, its size, where a callback does not see it: the HF Trainer's)."""
        device = next(model.parameters()).device
        if device.type == "cuda":
            gc.collect()  # tensors in earlier steps' reference cycles: freed now, not inside the step
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._recorder = device
            return
        opt = real_optimizer(optimizer) if optimizer is not None else None
        state = [v for s in (opt.state.values() if opt else ()) for v in s.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        static = [*model.parameters(), *model.buffers(), *grads, *state, *_tensors(batch)]
        self._start = batch_bytes + storage_bytes(static)
        self._recorder = memory_recorder(device, static)  # the gradients' frees at zero_grad count
        self._recorder.__enter__()
        self._recorder.on_mark("start")

    def stop(self) -> int:
        """End the measurement; returns this step's peak in bytes."""
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return 0
        if isinstance(recorder, torch.device):
            torch.cuda.synchronize(recorder)
            peak = torch.cuda.max_memory_allocated(recorder)
        else:
            recorder.on_mark("end")
            with contextlib.suppress(Exception):
                recorder.__exit__(None, None, None)
            peak = peak_from(recorder.marks(), self._start)
        self.peak_bytes = max(self.peak_bytes, peak)
        return peak


class PlanAndMeasure:
    """What both trainer callbacks hold: the budget and ``memfit.fit``'s options, the schedule
    once planned, and the measurement of the first ``measure_steps`` optimizer steps."""

    def __init__(self, budget: str | int, *, measure_steps: int = 2, **fit_options: Any) -> None:
        self.budget = budget
        self.measure_steps = measure_steps
        self.fit_options = fit_options
        self.schedule: Schedule | None = None
        self.measured_peak_bytes: int | None = None
        self._peak = StepPeak()

    def measuring(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 1) is measured."""
        return self.schedule is not None and step <= self.measure_steps

    def step_measured(self, step: int) -> bool:
        """End the measurement of step ``step``; after the last one, keep its peak, log it beside
        the prediction and return True."""
        self._peak.stop()
        if step != self.measure_steps or self.schedule is None:  # (measuring() said there is one)
            return False
        self.measured_peak_bytes = self._peak.peak_bytes
        log.info("%s", report(self.schedule.predicted_peak_bytes, self.measured_peak_bytes, self.schedule.budget_bytes))
        return True


def report(predicted: int, measured: int, budget: int) -> str:
    """``memfit: measured peak 5.61 MiB, predicted 5.60 MiB (+0.2%), budget 6.00 MiB: within``."""
    error = (measured - predicted) / predicted if predicted else 0.0
    verdict = "within the budget" if measured <= budget else "OVER the budget: plan again with a lower one"
    return (f"memfit: measured peak {format_bytes(measured)}, predicted {format_bytes(predicted)} "
            f"({100 * error:+.1f}%), budget {format_bytes(budget)}: {verdict}")


def accelerate_step(accelerator: Any, optimizer: Any, clip_grad_norm: float | None = None) -> TrainStep:
    """The step of a Hugging Face accelerate loop: its ``mixed_precision`` and
    ``gradient_accumulation_steps`` and its optimizer (``clip_grad_norm``: what the loop passes
    to ``accelerator.clip_grad_norm_``, which accelerate does not record)::

        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        memfit.fit(accelerator.unwrap_model(model), next(iter(loader)), "20GB",
                   step=memfit.integrations.trainers.accelerate_step(accelerator, optimizer, clip_grad_norm=1.0))
    """
    return train_step(optimizer, precision=str(accelerator.mixed_precision),
                      accumulate=accelerator.gradient_accumulation_steps, clip=clip_grad_norm)
