"""What a scheduled model watches in its own forwards: inputs larger than planned, another
device than planned on, and Hugging Face's checkpointing turned on over the plan.

Only training forwards are watched (gradients recorded): ``no_grad`` evaluation and
``generate()`` keep no activations for a backward, so their shapes do not touch the plan. Inputs
are compared by what changes memory, each tensor's shape and dtype, nested in lists, tuples,
dicts and dataclasses; scalars (``num_items_in_batch``, a 0-d tensor the Trainer adds;
``use_cache``) are not. A warning is given when a forward has a tensor larger than planned (a
dimension longer, a wider dtype, or a tensor the plan did not have) and than every input warned
about before: once per new largest input, so a run with dynamic padding warns a few times, not
once per batch length. Smaller inputs fit the plan and are quiet.

A schedule planned for several input shapes (``plan([profile, ...])``) holds a plan per shape:
each training forward runs the plan of its inputs' shape, or of the smallest planned shape that
covers them (every tensor as large or larger, dtype as wide), and the largest one's, with the
warning above, when none covers them. The choice is made once per input signature (a dict
lookup afterwards) and switched to at the forward's start, before anything of it is saved.

A model compiled with ``torch.compile`` whose schedule was planned for the eager step is warned
about once: the compiled step keeps what AOTAutograd's partitioner chooses, not what the plan
counted (issue 21 reported a GPT-style model 7% over its budget so).
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.budget import format_bytes
from memfit.errors import EagerPlanCompiledWarning, MemfitWarning, PlanDriftWarning
from memfit.formats.schedule import Schedule
from memfit.measure.inputs import Inputs, iter_tensors
from memfit.policy import Segment
from memfit.runtime.threads import Weak
from memfit.torch_private import allow_in_compiled_graph

_ENTRY = re.compile(r"^(?:(?P<path>[^=\[]+)=)?(?P<dtype>[a-z0-9_]+)\[(?P<dims>[0-9,]*)\]$")
Signature = dict[str, tuple[str, tuple[int, ...]]]


def signature(described: str) -> Signature:
    """Path -> (dtype, shape) of each tensor in an ``Inputs.describe()`` text; a positional
    tensor's path is ``#<position>``."""
    out: Signature = {}
    for i, entry in enumerate(e for e in described.split(", ") if e):
        m = _ENTRY.match(entry)
        if m is not None and m["dims"]:  # a 0-d tensor is a scalar, not activation memory
            out[m["path"] or f"#{i}"] = (m["dtype"], tuple(int(d) for d in m["dims"].split(",")))
    return out


def by_name(sig: Signature, forward: object) -> Signature:
    """The same signature with positional paths (``#0``, ``0.1``) named after ``forward``'s
    parameters, so that a tensor passed by position or by keyword is the same tensor."""
    try:
        names = [p.name for p in inspect.signature(forward).parameters.values()  # type: ignore[arg-type]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return sig
    out: Signature = {}
    for path, value in sig.items():
        head, dot, rest = path.removeprefix("#").partition(".")
        named = head.isdigit() and int(head) < len(names) and (path.startswith("#") or dot)
        out[f"{names[int(head)]}{dot}{rest}" if named else path] = value
    return out


def larger(now: Signature, planned: Signature) -> list[str]:
    """The tensors of ``now`` that are larger than planned, each said in words."""
    grown = []
    for path, (dtype, shape) in now.items():
        if path not in planned:
            grown.append(f"{path} (not in the plan)")
            continue
        p_dtype, p_shape = planned[path]
        wider = _itemsize(dtype) > _itemsize(p_dtype)
        longer = (len(shape) != len(p_shape) and _numel(shape) > _numel(p_shape)) or (
            len(shape) == len(p_shape) and any(a > b for a, b in zip(shape, p_shape, strict=True)))
        if wider or longer:
            grown.append(f"{path} {_text(dtype, shape)} (planned {_text(p_dtype, p_shape)})")
    return grown


def ceiling(a: Signature, b: Signature) -> Signature:
    """Each tensor at the larger of its two shapes (dimension by dimension) and the wider dtype."""
    out = dict(a)
    for path, (dtype, shape) in b.items():
        if path not in out:
            out[path] = (dtype, shape)
            continue
        a_dtype, a_shape = out[path]
        wide = dtype if _itemsize(dtype) > _itemsize(a_dtype) else a_dtype
        if len(shape) == len(a_shape):
            out[path] = (wide, tuple(max(x, y) for x, y in zip(shape, a_shape, strict=True)))
        else:
            out[path] = (wide, shape if _numel(shape) > _numel(a_shape) else a_shape)
    return out


_SAID: set[str] = set()


@torch.compiler.disable
def _pick_outside_graph(watch: Watch, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A compiled model's forward picks its shape's plan here, outside the graph (Dynamo breaks
    the graph at a disabled function and runs it as Python), with the inputs' real shapes; the
    units' forwards it changes are guarded on, so each plan compiles once and is reused."""
    watch.pick(model, args, kwargs)


def compiled_unplanned(message: str) -> None:
    """Warn ``message`` once per process; called from a compiled forward, after its graph
    (``torch_private.allow_in_compiled_graph``)."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(EagerPlanCompiledWarning(message), stacklevel=2)


def _text(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _itemsize(dtype: str) -> int:
    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Watch:
    """The forward pre-hook ``apply`` puts on the model (with kwargs)."""

    def __init__(self, model: nn.Module, schedule: Schedule,
                 use_shape: Callable[[nn.Module, int], None] | None = None) -> None:
        self.schedule = schedule
        self.shapes = [by_name(signature(p.input_shapes), model.forward) for p in schedule.plans]
        self.planned = self.shapes[-1]  # the largest
        self.warned = self.planned  # the plan, grown by every input warned about
        self.chosen = {p.input_shapes: k for k, p in enumerate(schedule.plans)}  # inputs described -> their plan
        self.use_shape = use_shape  # runs plan k (runtime/apply.use_shape); called with the model
        self.device_checked = False
        # Hugging Face modules that can turn on their own checkpointing (gradient_checkpointing_enable)
        self.hf_layers = [Weak(m) for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.hf_warned = False
        self.eager_only = "" if schedule.compile else (
            f"memfit: this {type(model).__name__} runs under torch.compile, and its schedule was planned for the "
            "eager step: the compiled step saves what the compiler's partitioner chooses"
            + (" and runs each segment member as its own checkpoint"
               if any(isinstance(p, Segment) for p in schedule.policies.values()) else "")
            + ", so its peak may exceed the planned "
            f"{format_bytes(schedule.predicted_peak_bytes)}; plan the compiled step (memfit plan --compile inductor), "
            "or check this one (memfit validate --compile inductor)")
        if self.eager_only:  # here, not at import: torch._dynamo takes seconds to import (an optimizer step does)
            allow_in_compiled_graph(compiled_unplanned)

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            if self.eager_only and torch.is_grad_enabled():
                compiled_unplanned(self.eager_only)
            if len(self.shapes) > 1 and torch.is_grad_enabled():
                _pick_outside_graph(self, model, args, kwargs)
            return  # Dynamo guards on shapes itself; describing symbolic shapes would break the graph
        if not torch.is_grad_enabled():
            return
        inputs = Inputs(args, kwargs)
        if not self.device_checked:
            self.device_checked = True
            self._check_device(model, inputs)
        if model.training and not self.hf_warned and any(
                getattr(ref(), "gradient_checkpointing", False) for ref in self.hf_layers):
            self.hf_warned = True
            warnings.warn(MemfitWarning(
                "memfit: Hugging Face gradient checkpointing is on (gradient_checkpointing_enable(), or "
                "TrainingArguments(gradient_checkpointing=True)): it recomputes every layer, over memfit's plan, "
                "so the step is slower than planned; turn it off (model.gradient_checkpointing_disable(), "
                "gradient_checkpointing=False) to run memfit's plan"), stacklevel=3)
        self.pick(model, args, kwargs)

    def pick(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the plan for these inputs (``use_shape``), choosing it on first sight."""
        now = Inputs(args, kwargs).describe()
        k = self.chosen.get(now)
        if k is None:
            k = self.chosen[now] = self._choose(model, now)
        if self.use_shape is not None:
            self.use_shape(model, k)

    def _choose(self, model: nn.Module, now: str) -> int:
        """The plan for inputs ``now``: the smallest planned shape covering them, else the largest
        (warning once per new largest input)."""
        sig = by_name(signature(now), model.forward)
        covering = next((k for k, planned in enumerate(self.shapes) if planned and not larger(sig, planned)), None)
        if covering is not None:
            return covering
        if self.planned and not set(sig) & set(self.planned):
            return len(self.shapes) - 1  # planned for a step function's data, which no forward sees (a pipeline
            # stage's buffers): nothing of this forward's to compare
        grown = larger(sig, self.planned)
        if grown and self.planned and larger(sig, self.warned):
            self.warned = ceiling(self.warned, sig)
            s = self.schedule
            warnings.warn(PlanDriftWarning(
                f"memfit: this model's schedule was planned for inputs {s.input_shapes}"
                + (f" (the largest of its {len(self.shapes)} input shapes)" if len(self.shapes) > 1 else "")
                + ", and this forward's are "
                f"larger: {'; '.join(grown)}; its peak may exceed the planned {format_bytes(s.predicted_peak_bytes)} "
                f"(budget {format_bytes(s.budget_bytes)}); {self._redo({p: self.warned[p] for p in sig})}"
            ), stacklevel=4)
        return len(self.shapes) - 1

    def _redo(self, largest: Signature) -> str:
        """How to plan again for inputs as large as ``largest``: a command to run, last."""
        s = self.schedule
        budget = format_bytes(s.budget_bytes).replace(" ", "")
        source = next((f"--{k} {s.source[k]}" for k in ("scenario", "model") if s.source.get(k)), "")
        shapes = [shape for _, shape in largest.values()]
        lengths = s.source.get("seq_lens")
        if source and lengths and shapes and len(shapes[0]) >= 2:  # planned for sequence lengths: add this one
            more = ",".join(map(str, sorted({*lengths, shapes[0][1]})))
            return f"plan for this length too: memfit plan {source} --seq-lens {more} --budget {budget}"
        if source and s.source.get("input_shape") and len(shapes) == 1:  # the factory takes --input-shape
            return f"plan again for them: memfit plan {source} --input-shape {'x'.join(map(str, shapes[0]))} " \
                   f"--budget {budget}"
        if source:
            where = "the scenario's [args]" if s.source.get("scenario") else "what the factory returns"
            return f"make the inputs in {where} this large, and plan again: memfit plan {source} --budget {budget}"
        if len(self.shapes) > 1:
            return ("profile it at these inputs too and plan all its shapes again: memfit.plan([memfit.profile(model, "
                    f"x) for x in batches], budget=\"{budget}\")")
        return (f"plan this {s.fingerprint.get('model_class', 'model')} again with inputs this large: "
                f"memfit.plan(memfit.profile(model, inputs), budget=\"{budget}\")")

    def _check_device(self, model: nn.Module, inputs: Inputs) -> None:
        """A plan holds for the device kind it was measured or estimated for; say so on another."""
        first = next(iter_tensors((inputs.args, inputs.kwargs)), None)
        if first is None:
            first = next(model.parameters(), None)
        here = first.device if first is not None else torch.device("cpu")
        name = torch.cuda.get_device_name(here) if here.type == "cuda" else "the CPU"
        s = self.schedule
        if s.target:
            from memfit.devices import DEVICES, target_title

            title = target_title(s.target, s.memory) or s.target
            known = DEVICES.get(s.target)  # a device spec file's target is known by its memory record only
            cuda = bool(s.memory) or (known.cuda if known else True)
            if (here.type == "cuda") != cuda or (here.type == "cuda" and title.lower() not in name.lower()):
                warnings.warn(PlanDriftWarning(
                    f"memfit: this schedule was estimated for {title} ({s.target}), not measured, and the model "
                    f"runs on {name}: its peak may differ; plan on this device (memfit plan without --target) or "
                    "check it with memfit validate"), stacklevel=4)
        elif torch.device(s.device).type != here.type:
            warnings.warn(PlanDriftWarning(
                f"memfit: this schedule was measured on {s.device} and the model runs on {name}: memory is "
                "allocated differently there (the CUDA allocator rounds, kernels keep other tensors), so its peak "
                "may differ; plan on this device or check it with memfit validate"), stacklevel=4)
