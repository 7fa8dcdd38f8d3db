"""``memfit.hf.MemfitCallback``: a Hugging Face ``TrainerCallback`` that plans on the first
training batch with the Trainer's own step and applies the plan before the first step.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[memfit.hf.MemfitCallback(budget="20GB")])

The step is read off the Trainer: its optimizer (the real one, after accelerate's wrapping),
``gradient_accumulation_steps``, ``bf16``/``fp16`` autocast and ``max_grad_norm``. With
``gradient_checkpointing=True`` as well, the callback turns Hugging Face's checkpointing off,
with a warning: it checkpoints every layer, which memfit's plan replaces (memfit chooses every
layer itself when the budget needs it); both at once would recompute inside recomputes and the
profile would measure a checkpointed model. Evaluation and ``generate()`` run under no_grad,
where memfit's checkpointing does nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

from memfit.errors import MemfitError, MemfitWarning
from memfit.fitting import fit
from memfit.integrations.trainers import PlanAndMeasure, bytes_of, first_batch, train_step


class MemfitCallback(TrainerCallback, PlanAndMeasure):
    """Plan and apply activation checkpointing for the Trainer's step at ``budget`` (a size such
    as ``"20GB"``, or ``"auto"`` on CUDA). ``measure_steps``: the first steps whose peak is
    measured and logged beside the prediction (a log line, and ``memfit/measured_peak_mib`` and
    ``memfit/predicted_peak_mib`` in the Trainer's next logs and ``state.log_history``; reporters
    registered before this callback, such as wandb's, run before it and miss them). ``fit_options`` go to ``memfit.fit``
    (``cache_dir``, ``units``, ``granularity``, …)."""

    def __init__(self, budget: str | int, *, measure_steps: int = 2, **fit_options: Any) -> None:
        PlanAndMeasure.__init__(self, budget, measure_steps=measure_steps, **fit_options)
        self._batch_bytes = 0
        self._logged = False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if self.schedule is not None:  # train() again, or resumed: the plan is applied already
            return
        if model is None or optimizer is None or train_dataloader is None:
            raise MemfitError("MemfitCallback needs the Trainer's model, optimizer and training data loader: pass it "
                              "to Trainer(callbacks=[...]) and call trainer.train()")
        if getattr(model, "is_gradient_checkpointing", False) or args.gradient_checkpointing:
            model.gradient_checkpointing_disable()
            warnings.warn(MemfitWarning(
                "memfit: turned Hugging Face's gradient checkpointing off (gradient_checkpointing=True): it "
                "checkpoints every layer, and memfit's plan replaces it, checkpointing only what the budget needs; "
                "drop gradient_checkpointing=True to silence this"), stacklevel=2)
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else None
        step = train_step(optimizer, precision=precision, accumulate=args.gradient_accumulation_steps,
                          clip=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None)
        batch = first_batch(train_dataloader, args.device)
        self._batch_bytes = bytes_of(batch)  # not the batch itself: held for the whole run, it would cost its memory
        self.schedule = fit(model, batch, self.budget, step=step, **self.fit_options)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        if self.measuring(state.global_step + 1):
            self._peak.start(model, optimizer, batch_bytes=self._batch_bytes)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.measuring(state.global_step):  # counted already: the step just ended
            self.step_measured(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if logs is None or self.schedule is None or self._logged:
            return
        if self.measured_peak_bytes is None:
            return
        figures = {"memfit/predicted_peak_mib": round(self.schedule.predicted_peak_bytes / 2**20, 2),
                   "memfit/measured_peak_mib": round(self.measured_peak_bytes / 2**20, 2)}
        logs.update(figures)  # what the Trainer prints next
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)  # the Trainer stored its copy before the callbacks ran
        self._logged = True
