"""The training step memfit plans for, and the byte counts of what lives across it.

The step is the steady state of a training loop as a TrainStep (memfit/trainstep.py) describes
it: ``zero_grad``, each micro-batch's forward, loss and backward (under autocast for amp), clipping,
``optimizer.step()``. Profiling, validation and the example all run this one; a user's own step
function runs in its place where one is given (measure/userstep.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.measure.inputs import Inputs, described, iter_tensors
from memfit.torch_private import amp_unscale_, amp_update_scale_, grad_scaler_tensors, is_fake
from memfit.trainstep import AMP, OPTIMIZERS, OptimizerFactory, StepRecord, TrainStep

LossFn = Callable[[Any], torch.Tensor]
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def packed(t: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook keeps when it keeps the tensor itself: ``t.detach()`` (same
    storage and version counter). Returning ``t`` makes an output that its own backward node saves
    (relu, softmax, log_softmax) hold that node: a reference cycle through C++ that Python's GC
    cannot see, so the forward's whole graph outlives a forward whose backward never runs (one that
    raised, an evaluation with grad on, the profiler's forward-only passes)."""
    return t.detach()


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` when the model computes one (Hugging Face), else the mean square of the
    first tensor in the output."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    for t in iter_tensors(output):
        if t.is_floating_point():
            return t.float().pow(2).mean()
    raise MemfitError("the model's output has no floating-point tensor to take a loss of: return one (or an "
                      "object with a .loss, as Hugging Face models do), or in Python pass loss_fn=")


def make_optimizer(optimizer: str | OptimizerFactory | None, params: Iterable[nn.Parameter], *,
                   foreach_default: bool | None = None) -> torch.optim.Optimizer | None:
    """The optimizer whose state and step memfit counts. A named one has learning rate 0, so that
    profiling never changes the weights (the state and temporaries are those of any learning
    rate); a callable is the user's own. ``foreach_default``: the kernels of a plain name (None:
    PyTorch's choice for the parameters' device; estimate mode passes True for CUDA targets,
    where PyTorch picks foreach, whose temporaries the step's peak includes)."""
    params = [p for p in params if p.requires_grad]
    if optimizer is not None and not isinstance(optimizer, str):
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise MemfitError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    base = "none" if optimizer is None else optimizer.lower()
    kernels: dict[str, Any] = {"foreach": foreach_default}
    named = False  # the kernels the name asks for, which run as asked
    for suffix, forced in (("-foreach", {"foreach": True}), ("-fused", {"fused": True}),
                           ("-single", {"foreach": False})):
        if base.endswith(suffix):
            base, kernels, named = base.removesuffix(suffix), forced, True
    if not named and len({hasattr(p, "device_mesh") for p in params}) > 1:
        # tensor parallelism over the layers only: PyTorch's foreach kernels (its default on CUDA)
        # refuse a mix of DTensor and plain parameters, so the step is the single-tensor one
        kernels = {"foreach": False}
    if base == "adamw":
        return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, **kernels)
    if base == "adam":
        return torch.optim.Adam(params, lr=0.0, **kernels)
    if base == "sgd":
        return torch.optim.SGD(params, lr=0.0, **kernels)
    if base == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.0, momentum=0.9, **kernels)
    if base == "adafactor":
        if any(is_fake(p) for p in params):
            raise MemfitError("Adafactor's step reads tensor values (.item()), which estimate mode's fake tensors "
                              "do not hold: measure it on a device, or estimate with adamw")
        return torch.optim.Adafactor(params, lr=0.0, **kernels)
    if base == "none":
        return None
    raise MemfitError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")


def resolve_precision(step: TrainStep, model: nn.Module) -> TrainStep:
    """``step`` with its precision named: the model's own dtype when not given; a mismatch
    between the two is refused (a pure dtype is the model's; amp keeps fp32 weights)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    own = DTYPE_NAMES.get(next(iter(dtypes)), "") if len(dtypes) == 1 else ""
    want = step.precision or own or "fp32"
    if want in AMP:
        if own != "fp32":
            raise MemfitError(f"precision {want!r} is autocast over float32 weights, but this model's parameters "
                              f"are {_dtype_words(dtypes)}: build it in float32, or give its own precision "
                              f"({own or 'mixed'})")
    elif own and want != own:
        raise MemfitError(f"precision {want!r} means a model in that dtype, but this model's parameters are "
                          f"{_dtype_words(dtypes)}: convert the model (model.to(...)), or use precision {own!r} "
                          "(amp-bf16 / amp-fp16 for autocast over float32 weights)")
    return dataclasses.replace(step, precision=want)


def _dtype_words(dtypes: set[torch.dtype]) -> str:
    return " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


class StepState:
    """What lives across the steps of one TrainStep on one model: its optimizer (whose state
    counts), the GradScaler of amp-fp16, and the parameters clipping reads. It runs the step
    (``run``); measure/userstep.py has its counterpart for a step function of the user's own."""

    units_once = True  # each unit runs once per micro-batch's forward

    def __init__(self, step: TrainStep, model: nn.Module, *, foreach_default: bool | None = None) -> None:
        self.step = resolve_precision(step, model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(step.optimizer, self.params, foreach_default=foreach_default)
        self.device_type = device_of(model).type
        fake = any(is_fake(p) for p in self.params)
        self.output: Any = None  # the last forward's output, held by a loop that keeps it (keep_output)
        self.scaler: Any = None
        if self.step.precision == "amp-fp16":
            self.scaler = ValuelessScaler(device_of(model)) if fake else torch.amp.GradScaler(self.device_type)

    @property
    def optimizer_name(self) -> str | None:
        return self.step.optimizer_name

    def record(self) -> StepRecord:
        return self.step.record()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's autocast: none for a pure dtype."""
        if not self.step.amp:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.step.precision == "amp-bf16" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype, cache_enabled=self.step.autocast_cache)

    def zero_grad(self) -> None:
        """As the loop does between steps: gradients set to None, or to zeros (kept allocated)."""
        to_none = self.step.zero_grad == "none"
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=to_none)
        else:
            self.model.zero_grad(set_to_none=to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state and the scaler's."""
        states = self.optimizer.state.values() if self.optimizer is not None else []
        out = [v for state in states for v in iter_tensors(dict(state))]
        if isinstance(self.scaler, ValuelessScaler):
            return out + self.scaler.tensors()
        return out + (grad_scaler_tensors(self.scaler) if self.scaler is not None else [])

    def tensors(self) -> list[torch.Tensor]:
        """What lives across steps besides the model and the inputs: the state, gradients kept
        as zeros (none after ``zero_grad`` to None), and the output a loop keeps."""
        return self.state_tensors() + [p.grad for p in self.params if p.grad is not None] + list(
            iter_tensors(self.output))

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def finish(self, mark: Callable[[str], None]) -> None:
        """Clipping and the optimizer's step, after the last micro-batch's backward."""
        if self.step.clip_grad_norm is not None:
            mark("clip")
            if self.scaler is not None and self.optimizer is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.step.clip_grad_norm)
        mark("step")
        if self.optimizer is not None:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()

    def run(self, runner: Any, inputs: Inputs, loss_fn: LossFn, mark: Callable[[str], None],
            micro_batches: int | None) -> float:
        """One optimizer step of ``self.step`` on ``runner`` (the model, or it compiled): each
        micro-batch's forward and loss under the step's autocast, the loss divided by the number of
        micro-batches, its backward; then clipping and the optimizer. ``micro_batches`` runs fewer
        (the profiler measures two: every later one repeats the second). ``mark`` hears
        ``forward``, ``release`` (amp: autocast's weight casts freed), ``backward`` (``forward@2``,
        ``backward@2``, ... for later micro-batches), ``clip``, ``step`` and ``done`` as each
        begins. The output is not kept past the loss, as in ``loss = loss_fn(model(x))``, unless
        the step keeps it; the mean of the micro-batches' losses is returned."""
        k = self.step.accumulate
        runs = k if micro_batches is None else min(k, micro_batches)
        losses = []
        for m in range(runs):
            suffix = f"@{m + 1}" if m else ""
            mark("forward" + suffix)
            with self.autocast():
                out = runner(*inputs.args, **inputs.kwargs)
                if self.step.keep_output:  # the loop's variable: the previous output goes only now
                    self.output = out
                loss = loss_fn(out)
                del out
                if self.step.amp:  # leaving autocast frees its cache of weight casts: a stretch of its own
                    mark("release" + suffix)
            _check_loss(loss)
            mark("backward" + suffix)
            losses.append(loss.detach())
            self.backward(loss / k if k > 1 else loss)
            del loss
        self.finish(mark)
        mark("done")
        if is_fake(losses[0]):
            return float("nan")  # fake tensors (estimate mode) hold no values
        return sum(float(v) for v in losses) / len(losses)


class ValuelessScaler:
    """GradScaler's tensors and in-place kernels for fake tensors (estimate mode), which hold no
    values: ``GradScaler.step`` reads ``found_inf`` with ``.item()``. The same ops on the same
    tensors (torch_private.amp_unscale_ and amp_update_scale_), never skipping the step."""

    def __init__(self, device: torch.device) -> None:
        self._scale = torch.full((), 2.0**16, dtype=torch.float32, device=device)
        self._growth = torch.full((), 0, dtype=torch.int32, device=device)
        self._found = torch.full((), 0.0, dtype=torch.float32, device=device)
        self._unscaled = False

    def tensors(self) -> list[torch.Tensor]:
        return [self._scale, self._growth]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        amp_unscale_(grads, self._found, self._scale.double().reciprocal().float())
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._unscaled:
            self.unscale_(optimizer)
        optimizer.step()

    def update(self) -> None:
        amp_update_scale_(self._scale, self._growth, self._found, 2.0, 0.5, 2000)
        self._unscaled = False


def training_step(
    runner: Any,
    inputs: Inputs,
    loss_fn: LossFn,
    state: Any,
    on_mark: Callable[[str], None] | None = None,
    micro_batches: int | None = None,
) -> float:
    """One training step as ``state`` runs it (a StepState, or a user step function's state):
    ``state.run``."""
    return state.run(runner, inputs, loss_fn, on_mark or (lambda _label: None), micro_batches)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise MemfitError(f"the loss must be a one-element tensor, got {', '.join(described(loss, ''))}; "
                          "pass loss_fn=")
    if not loss.requires_grad:
        raise MemfitError(
            "the loss does not depend on any trainable parameter, so there is no backward pass to plan for: "
            "check that the model has parameters with requires_grad=True and that the loss uses its output"
        )


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters (or buffers) live; the CPU for a model with neither."""
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return torch.device("cpu")


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: a DTensor's local shard (FSDP2's parameters, gradients and
    optimizer state; its own ``untyped_storage()`` reports the whole tensor), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_key(st: torch.UntypedStorage) -> int:
    """One key per live storage, fake ones (estimate mode, no data pointer) included: the address
    of its StorageImpl (``_cdata``, private but the identity PyTorch's own weak maps use)."""
    return int(st._cdata)


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: set[int] = set(exclude or ())
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        st = local(t).untyped_storage()
        key = storage_key(st)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def static_tensors(model: nn.Module, state: StepState, inputs: Inputs) -> list[torch.Tensor]:
    """What lives across steps: parameters, buffers, optimizer state, the inputs, and gradients
    kept as zeros (the level at the start of a step, after the loop's ``zero_grad``)."""
    return [*model.parameters(), *model.buffers(), *state.tensors(), *inputs.tensors()]


def static_bytes(model: nn.Module, state: StepState, inputs: Inputs) -> int:
    """The bytes of ``static_tensors``: the level a step starts from."""
    return storage_bytes(static_tensors(model, state, inputs))
