"""One forward of a unit under ``derive`` (runtime/derive.py): ``Learn``, under the watch, which
decides what to re-derive and writes the plan; ``Replay``, which follows a learned plan with the
saved-tensor hooks alone. Both bind the plan's positions to the forward's own tensors
(runtime/derive_plan.py), so the learning step and the later ones run alike."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from memfit.measure.host import timed
from memfit.measure.step import packed, storage_key
from memfit.runtime.derive_plan import Bind, Derived, Leaf, Plan, Step, SubRef, Template, history, template_of
from memfit.runtime.derive_rng import Fill, RngAt, rng_state
from memfit.runtime.derive_watch import OpWatch, resolve
from memfit.runtime.threads import Weak
from memfit.torch_private import StorageWeakRef


class Forward:
    derived_bytes: int
    bind: Bind
    aside = False  # packs nothing of its own (runtime/derive.py's head, when something opened inside it)

    def pack(self, t: torch.Tensor) -> Any:
        raise NotImplementedError

    def packer(self, t: torch.Tensor) -> Any:
        """The pack hook: ``pack``'s answer, a tensor it keeps as ``packed`` keeps it; the option's
        own work, which the profiler prices it from (measure/host.Work)."""
        return timed(self._packed, t)

    def _packed(self, t: torch.Tensor) -> Any:
        out = t if self.aside else self.pack(t)
        return packed(out) if isinstance(out, torch.Tensor) else out

    def close(self) -> None:
        self.bind = Bind([])


class Learn(Forward):
    """A forward under the watch: decides what to re-derive as it goes (``resolve``) and, when
    ``record``, writes the plan that later forwards follow. Its own re-derived tensors go through
    the plan's templates too, so the learning step and the later ones run alike."""

    def __init__(self, level: int, tensors: list[tuple[torch.Tensor, Weak, str, str]], record: bool) -> None:
        params = [t for t, *_ in tensors]
        self.where = [w for _, *w in tensors]
        self.param_of = {storage_key(t.untyped_storage()): (i, t) for i, t in enumerate(params)}
        self.watch = OpWatch(level, set(self.param_of))
        self.derived: set[int] = set()
        self.derived_bytes = 0
        self.record = record
        self.steps: list[Step] = []
        self.slot_of: dict[int, tuple[int, torch.Tensor]] = {}
        self.templates: dict[int, Template] = {}
        self.bind = Bind(params, rng=self.watch.rng)
        self.head = False  # opened with the root's forward: nothing is re-derived before the unit begins
        self.entered: int | None = None  # a head's: the watch's count of ops when the unit began
        # each re-derived storage: when it was made, whether it lives, its bytes, the steps that save it
        self.derived_at: dict[int, tuple[int, StorageWeakRef, int, list[int]]] = {}

    def close(self) -> None:
        super().close()
        self.slot_of.clear()
        self.param_of.clear()

    def kept(self, key: int) -> torch.Tensor | None:
        """A tensor of the storage where autograd keeps it (a parameter or buffer, or a tensor
        packed as it is), else None."""
        found = self.param_of.get(key) or self.slot_of.get(key)
        return None if found is None else found[1]

    def plan(self) -> Plan:
        leaves = [leaf for step in self.steps if step.derive for leaf in _leaves(step.derive[0])]
        bound = {leaf.index for leaf in leaves if not leaf.param}
        steps = [replace(s, bind=i in bound) for i, s in enumerate(self.steps)]
        params = {leaf.index: tuple(self.where[leaf.index]) for leaf in leaves if leaf.param}
        rng_at = {a.packs: t.func.device for step in self.steps if step.derive for t in _templates(step.derive[0])
                  if isinstance(t.func, Fill) for a in t.args if isinstance(a, RngAt)}
        return Plan(steps, self.derived_bytes, len(self.where), params, rng_at)

    def pack(self, t: torch.Tensor) -> Any:
        out = self._pack(t)
        self.watch.packed(len(self.steps))
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t.untyped_storage())
        made = self.watch.entry(key)
        layout = (tuple(t.shape), t.stride())
        # a norm's statistics too: the run that re-derives its output makes them (derive_watch.resolve);
        # a head's own saved tensors are kept: re-made in its backward, after the unit's, they would
        # move the step's remainders, which the unit's option is not measured by
        if (made is not None and self.kept(key) is None and self.watch.clean(key, made.seq + 1)
                and (not self.head or self.entered is not None)):
            recipe = resolve(made, self.watch, self.kept, 0)
            template = recipe and template_of(recipe, self.templates, self.slot_of, self.param_of, _key)
            made_again = template and self.bind.packed_recipe(template)
            if made_again is not None:
                if key not in self.derived:
                    self.derived.add(key)
                    self.derived_bytes += t.untyped_storage().nbytes()
                    self.derived_at[key] = (made.seq, StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes(),
                                            [])
                self.derived_at[key][3].append(len(self.steps))
                view = (*layout, t.storage_offset() - made.geometry[2])
                assert template is not None
                past = history(t, self.bind.leaves(template), template.depth)
                self.steps.append(Step(layout, t.dtype, derive=(template, view, past, made.index)))
                made_again.hold(made.index)
                return Derived(made_again, view, made.index)
        if key not in self.param_of and key not in self.slot_of:
            self.slot_of[key] = (len(self.steps), t)
            self.bind.slots[len(self.steps)] = t
        self.steps.append(Step(layout, t.dtype))
        return t


def _leaves(template: Template) -> list[Leaf]:
    return [a for t in _templates(template) for a in t.args if isinstance(a, Leaf)]


def _templates(template: Template) -> list[Template]:
    """The template and those its inputs come from, however deep."""
    return [template, *(t for a in template.args if isinstance(a, SubRef) for t in _templates(a.template))]


def _key(t: torch.Tensor) -> int:
    return storage_key(t.untyped_storage())


class Replay(Forward):
    """A forward following its plan with saved-tensor hooks alone."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        params: list[Any] = [None] * plan.n_params
        for i, (module, kind, name) in plan.params.items():
            params[i] = module().__dict__[kind][name]
        self.bind = Bind(params)
        self.n = 0
        self.missed = False
        self.derived_bytes = plan.derived_bytes
        self._take_state()

    def _take_state(self) -> None:
        """The generator's state after ``n`` packed tensors, where the plan has a fill draw next."""
        device = self.plan.rng_at.get(self.n)
        if device is not None:
            self.bind.rng[self.n] = rng_state(device)

    def pack(self, t: torch.Tensor) -> Any:
        i = self.n
        self.n = i + 1
        if self.plan.rng_at:
            self._take_state()  # nothing here draws: the state is the one after this tensor's op
        steps = self.plan.steps
        if self.missed or i >= len(steps):
            self.missed = True
            return t
        step = steps[i]
        if step.dtype != t.dtype or step.layout != (tuple(t.shape), t.stride()):
            self.missed = True
            return t
        if step.derive is None:
            if step.bind:
                self.bind.slots[i] = t
            return t
        template, view, past, index = step.derive
        recipe = self.bind.packed_recipe(template)
        if recipe is None or history(t, self.bind.leaves(template), template.depth) != past:
            self.missed = True
            if recipe is not None:
                self.bind.release(template)
            return t
        recipe.hold(index)
        return Derived(recipe, view, index)
