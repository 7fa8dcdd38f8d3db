"""A training step of the user's own: ``step_fn(model, inputs)`` runs the forward(s), the
backward and the optimizer as their loop does (two forwards before one backward, say, as a
contrastive step does). memfit marks the units by hooks as in its own step; what lives across
the function's calls (its optimizers' state, a GradScaler's) is found where the function refers
to it, counted in the baseline, and put back after profiling."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError, MemfitWarning
from memfit.measure.inputs import Inputs, iter_tensors
from memfit.measure.step import LossFn, resolve_precision
from memfit.torch_private import grad_scaler_tensors, is_fake
from memfit.trainstep import CUSTOM, StepRecord, TrainStep

StepFn = Callable[[nn.Module, Any], Any]


class UserStepState:
    """``StepState``'s counterpart for a step function: it zeroes its own gradients and runs its
    own optimizer; units may run more than once per step."""

    units_once = False

    def __init__(self, fn: StepFn, model: nn.Module) -> None:
        if not callable(fn):
            raise MemfitError(f"step_fn must be a function (model, inputs) -> loss, got {type(fn).__name__}")
        self.fn = fn
        self.model = model
        self.step = resolve_precision(TrainStep(None), model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.held = held_state(fn)
        if not any(isinstance(h, torch.optim.Optimizer) for h in self.held):
            warnings.warn(f"memfit found no optimizer that {_name(fn)} refers to (closure, bound object, "
                          "functools.partial, globals it names): an optimizer's state would not be counted in the "
                          "step's baseline", MemfitWarning, stacklevel=3)

    @property
    def optimizer_name(self) -> str:
        found = [type(h).__name__ for h in self.held if isinstance(h, torch.optim.Optimizer)]
        return CUSTOM + ("+".join(found) or "unknown")

    def record(self) -> StepRecord:
        return StepRecord(**self.step.record(), function=_name(self.fn))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the function enters its own

    def zero_grad(self) -> None:
        """Nothing: the function zeroes its gradients itself."""

    def state_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for h in self.held:
            if isinstance(h, torch.optim.Optimizer):
                out += [v for state in h.state.values() for v in iter_tensors(dict(state))]
            else:
                out += grad_scaler_tensors(h)
        return out

    def tensors(self) -> list[torch.Tensor]:
        return self.state_tensors() + [p.grad for p in self.params if p.grad is not None]

    def run(self, runner: Any, inputs: Inputs, loss_fn: LossFn, mark: Callable[[str], None],
            micro_batches: int | None) -> float:
        """One call of the function, between the ``forward`` and ``done`` marks; its return value,
        when a number or a one-element tensor, is the loss."""
        mark("forward")
        out = self.fn(runner, inputs.given)
        mark("done")
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            return float("nan") if is_fake(out) else float(out.detach())
        return float(out) if isinstance(out, (int, float)) else float("nan")

    def snapshot(self) -> Callable[[], None]:
        """Put the held optimizers' and scalers' state back as it is now."""
        saved = [(h, copy.deepcopy(h.state_dict())) for h in self.held]

        def restore() -> None:
            for h, state in saved:
                h.load_state_dict(copy.deepcopy(state))

        return restore


def held_state(fn: Any) -> list[Any]:
    """The optimizers and GradScalers ``fn`` refers to: in its closure, the object of a bound
    method (or a callable object's attributes), a ``functools.partial``'s arguments, or the
    globals its code names; three references deep at most."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 3 or isinstance(obj, (nn.Module, torch.Tensor, type, types.ModuleType)):
            return
        seen.add(id(obj))
        if isinstance(obj, (torch.optim.Optimizer, torch.amp.GradScaler)):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            for v in (obj.func, *obj.args, *obj.keywords.values()):
                visit(v, depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, depth + 1)
            for name in obj.__code__.co_names:
                if name in obj.__globals__:
                    visit(obj.__globals__[name], depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # slots: no __dict__
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name), depth + 1)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                visit(v, depth + 1)

    visit(fn, 0)
    return found


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__
