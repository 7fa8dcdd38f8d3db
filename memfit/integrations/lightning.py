"""``memfit.integrations.lightning.MemfitCallback``: a Lightning ``Callback`` that plans on the first
training batch with the Trainer's own step and applies the plan before the first step.

    trainer = L.Trainer(callbacks=[MemfitCallback(budget="20GB")], ...)

The step is read off the Trainer: its optimizer, ``accumulate_grad_batches``, ``precision``
(``bf16-mixed``, ``16-mixed``, ``bf16-true``, ...; its autocast runs without the weight-cast
cache, ``TrainStep.autocast_cache=False``) and ``gradient_clip_val`` (by norm). The
profile runs the module's own ``training_step`` on the batch (its loss, whatever it computes),
with ``self.log`` silenced while it does. Lightning 2 (``lightning.pytorch``, else
``pytorch_lightning``); importing memfit alone never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from memfit.errors import MemfitError
from memfit.fitting import fit
from memfit.integrations.trainers import PlanAndMeasure, first_batch, train_step
from memfit.runtime.apply import apply, remove

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError("memfit.integrations.lightning needs Lightning: pip install lightning") from None


class MemfitCallback(Callback, PlanAndMeasure):  # type: ignore[misc]
    """Plan and apply activation checkpointing for the Trainer's step at ``budget`` (a size such
    as ``"20GB"``, or ``"auto"`` on CUDA). ``measure_steps``: the first optimizer steps whose
    peak is measured, logged beside the prediction and sent to the Trainer's loggers
    (``memfit/measured_peak_mib``, ``memfit/predicted_peak_mib``). ``fit_options`` go to
    ``memfit.fit`` (``cache_dir``, ``units``, ``granularity``, …)."""

    def __init__(self, budget: str | int, *, measure_steps: int = 2, **fit_options: Any) -> None:
        PlanAndMeasure.__init__(self, budget, measure_steps=measure_steps, **fit_options)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.schedule is not None:
            return
        algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)  # an enum
        if trainer.gradient_clip_val and algorithm not in (None, "norm"):
            raise MemfitError("memfit plans clipping by norm (gradient_clip_algorithm='norm'), not by value")
        if len(trainer.optimizers) != 1 or not pl_module.automatic_optimization:
            raise MemfitError("memfit's Lightning callback plans a module with one optimizer and automatic "
                              "optimization; for others use "
                              "memfit.fit(model, batch, budget, step=memfit.TrainStep(...))")
        step = train_step(trainer.optimizers[0], precision=str(trainer.precision),
                          accumulate=trainer.accumulate_grad_batches, clip=trainer.gradient_clip_val,
                          autocast_cache=False)  # its MixedPrecision plugin: torch.autocast(..., cache_enabled=False)
        batch = first_batch(trainer.train_dataloader, pl_module.device)
        with _forward_is_training_step(pl_module):
            schedule = fit(pl_module, (batch,), self.budget, step=step, loss_fn=_loss, **self.fit_options)
        # The plan was made for the batch training_step takes, not for what its forward is later
        # called with: applied again without input shapes, so that no drift warning compares them.
        remove(pl_module)
        apply(pl_module, dataclasses.replace(schedule, input_shapes=""))
        self.schedule = schedule

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        steps = trainer.accumulate_grad_batches
        if batch_idx % steps == 0 and self.measuring(batch_idx // steps + 1):
            self._peak.start(pl_module, trainer.optimizers[0], batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        steps = trainer.accumulate_grad_batches
        step = (batch_idx + 1) // steps  # the optimizer step this batch ends, if it ends one
        if (batch_idx + 1) % steps or not self.measuring(step):
            return
        if self.step_measured(step):  # the last measured step: its figures to the Trainer's loggers
            figures = {"memfit/predicted_peak_mib": self.schedule.predicted_peak_bytes / 2**20,  # type: ignore[union-attr]
                       "memfit/measured_peak_mib": self.measured_peak_bytes / 2**20}  # type: ignore[operator]
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=trainer.global_step)


def _loss(output: Any) -> torch.Tensor:
    """training_step's loss: a tensor, or a dict with ``loss``, as Lightning takes it."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise MemfitError("training_step must return the loss (a tensor, or a dict with 'loss') for memfit to plan it")
    return loss


@contextlib.contextmanager
def _forward_is_training_step(pl_module: Any) -> Iterator[None]:
    """While profiling, the module's forward is its training_step on the batch (an instance
    attribute, which the fingerprint ignores; its own ``self(x)`` inside reaches the class's
    forward) and ``self.log`` does nothing."""
    inside = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        if inside:
            return type(pl_module).forward(pl_module, *args, **kwargs)
        inside.append(True)
        try:
            return pl_module.training_step(*args, 0)
        finally:
            inside.clear()

    pl_module.forward = forward
    pl_module.log = pl_module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        for name in ("forward", "log", "log_dict"):
            pl_module.__dict__.pop(name, None)
