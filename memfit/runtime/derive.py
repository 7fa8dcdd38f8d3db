"""Re-deriving cheap saved tensors in the backward instead of keeping them (the ``derive``
option): op-level recomputation without a checkpoint.

Autograd keeps many tensors that cheap ops make from other tensors it keeps anyway: the
dropped attention probabilities (``softmax * mask``, saved for the product with V, while the
softmax output and the mask are saved for their own backward), an activation's output (saved by
the next product, while its input is saved by the activation), a norm's output (its input and
weights are kept). A unit under ``derive`` keeps the recipe instead, the op and references to
those inputs, and runs the op again when the backward asks for the tensor. A recipe's input may
itself be re-derived, through a chain of such ops back to tensors autograd keeps (a tanh GELU's
seven elementwise ops). What autograd keeps is the reference: a recipe holds only tensors that
autograd keeps anyway (or parameters and buffers), so nothing is saved that the plain step
would not save. What the compilers' partitioners do for cheap ops, done in eager mode.

``derive:products`` goes one step further, where attention is written out (``q @ k.T``, mask,
softmax, ``@ v``): row-wise softmax and products of two activations whose output is larger than
each of their inputs (or, beneath a softmax, any: the scores where heads are no shorter than the
sequence) may be run again too, so the T x T probabilities are re-derived from the q and k
that the first product keeps for its own backward (Megatron's core-attention recompute, without
a checkpoint region or a selective-checkpoint dispatch mode around the unit). A recomputed tensor
that several nodes saved (the probabilities: the softmax's backward and the product with V) is
made once and held until each of them has used it.

PyTorch's own machinery: a ``TorchDispatchMode`` watches the unit's forward below autograd
(which op made which storage, which ops wrote into one in place), and
``torch.autograd.graph.saved_tensors_hooks`` sees what autograd saves. In-place ops are never
re-derived, random ones only as dropout's draws at level 1 and deeper (derive_rng.Fill: the noise
made again under the generator's state the pack hook took before the draw, checked against the
state when the noise was packed, the generator set back after); inputs are checked for in-place
changes at unpack. The watch runs once: the
unit's first training forward for each input signature learns a plan (runtime/derive_plan.py),
and later forwards follow it with the hooks alone, checking each re-derived tensor's autograd
history against the learned one: a few microseconds per saved tensor, not tens per op
(benchmarks/launch_bound.py), which is what a GPU, where kernels take microseconds, feels.

The hooks cover the unit's whole call (forward hooks, ``always_call``), so a checkpoint region
inside the unit packs its own tensors as usual (its hooks are inner). The hooks step aside
under ``torch.compile``, where the unit runs inside a checkpoint whose selective policy tells the
partitioner what the level re-derives (``op_sets.derive_policy``), during memfit's
recomputation and inside another saved-tensor context (``torch_private``, with the private API
it takes for that; the watch's own are named in runtime/derive_watch.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitWarning
from memfit.runtime.derive_forward import Forward, Learn, Replay
from memfit.runtime.derive_plan import Plan, unpack_hook
from memfit.runtime.op_sets import derive_policy
from memfit.runtime.threads import PerThread, Weak, raising, recomputing
from memfit.runtime.unit_forward import install, uninstall
from memfit.torch_private import on_top, saved_tensors_hooks_active


class Derive(PerThread):
    """Re-derive cheap saved tensors of ``unit`` (module hooks; ``remove()`` undoes them); with
    ``level`` 1 (policy.Derive's levels), also through products of two activations and softmax
    (written-out attention's probabilities from the q and k its first product keeps); 2, also
    through attention's projections (q, k and v from a re-derived norm output); 3, through every
    product with a weight.

    The unit's first training forward for each input signature runs under the watch and learns a
    plan (runtime/derive_plan.py); later forwards follow it with saved-tensor hooks alone, at a
    cost per saved tensor, not per op. A forward that does not match its plan keeps what it cannot
    vouch for and the unit learns again; one whose forwards keep changing (``MAX_MISSES``) is
    watched on every forward, as correct and slower. The contexts a forward opens are this
    thread's; copies and pickles take the hooks, not them, nor the plans.

    With ``root`` (the model), given for its last unit (``tail``), the unit's hooks stay open over
    the rest of the root's forward, the *tail* (final norm, head, a loss computed there), so that
    what the head keeps is re-derived too: the final norm's output, which the head's product
    saves, from the unit's output, which the norm keeps. Given for its first unit (``head``), they
    open with the root's forward, so that the unit's input, which its first norm keeps, is
    re-derived from the embeddings' gathers and sum. Outside the unit only cheap ops are re-run (the
    head's products and the loss's softmax make the largest tensors of the step, which re-made in
    the backward would raise its peak), and its plans are per input signature of the root too."""

    def __init__(self, unit: nn.Module, level: int = 0, root: nn.Module | None = None, *, head: bool = False,
                 tail: bool = False) -> None:
        super().__init__()
        self._unit = Weak(unit)
        self._root = None if root is None else Weak(root)
        self.head, self.tail = root is not None and head, root is not None and tail
        self.level = int(level)  # policy.Derive's level; True (as tests pass it) is derive:products
        self.derived_bytes = 0  # storages the last forward re-derives instead of keeping
        self.plans: dict[Any, Plan | None] = {}  # None: watched on every forward
        self.misses: dict[Any, int] = {}
        install(unit)  # under torch.compile, the unit runs under derive_policy (runtime/unit_forward.py)
        self.handles: list[RemovableHandle] = [
            unit.register_forward_pre_hook(self._enter, with_kwargs=True),
            unit.register_forward_hook(self._unit_done, always_call=True),
        ]
        if root is not None and (self.head or self.tail):  # and where a block like the unit runs (_sibling)
            self.handles += [root.register_forward_pre_hook(self._root_enter, with_kwargs=True),
                             root.register_forward_hook(self._root_done, always_call=True),
                             *(m.register_forward_pre_hook(self._sibling) for m in root.modules()
                               if type(m) is type(unit) and m is not unit)]

    def __getstate__(self) -> dict[str, Any]:
        state = PerThread.__getstate__(self)
        state["plans"], state["misses"] = {}, {}  # ops do not pickle; a copy learns on its own
        return state

    @property
    def _open(self) -> list[Any]:
        if not hasattr(self._tls, "open"):
            self._tls.open = []
        return self._tls.open

    def remove(self) -> None:
        self._exit()
        self._root = None  # a pre-hook of the root's that PyTorch's list still holds opens nothing now
        for h in self.handles:
            h.remove()
        if (unit := self._unit()) is not None:
            uninstall(unit)

    def compiled_context(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
        """The unit's compiled checkpoint keeps what this level keeps eagerly (``derive_policy``;
        the head and the tail are the compiler's, as they are without a schedule)."""
        width = _width(args, kwargs)
        return functools.partial(create_selective_checkpoint_contexts, functools.partial(
            derive_policy, self.level, width if isinstance(width, int) else None))

    def _root_enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
        # no kwargs: removed by a switch of plans in an earlier pre-hook, PyTorch calls it all the
        # same, from the list it took, as a hook without them
        self.root_entered(module, _signature(module, args, kwargs or {}))

    def root_entered(self, root: nn.Module, signature: Any = "switched") -> None:
        """The model's forward begins (from its pre-hook, or from a switch of plans inside the
        model's pre-hooks, which PyTorch took the list of before this object's was made: the plan
        switched to learns anew anyway)."""
        if self._root is None or self._root() is not root:
            return
        self._tls.root, self._tls.head = signature, False
        if self.head and self._open_forward(("head", signature), head=True):
            self._tls.head = True

    def _root_done(self, module: nn.Module, args: Any, output: Any) -> None:
        self._tls.root, self._tls.head = None, False
        tail, self._tls.tail = getattr(self._tls, "tail", None), None
        self._exit(tail, None, output)  # learns nothing where the root raised, or a head whose unit never ran
        self._keep_held(every=True)

    def _sibling(self, module: nn.Module, args: Any) -> None:
        self._keep_held()
        tail, self._tls.tail = getattr(self._tls, "tail", None), None
        if tail is not None:
            self._exit(tail, None, True)

    def _keep_held(self, every: bool = False) -> None:
        """After a head's learning forward, once the next block begins (or the root's forward
        ends: ``every``): a tensor the head made and the plan re-derives that is still alive is
        held by the model's own code (Hugging Face's ``inputs_embeds``, to the end of its forward),
        so re-deriving it frees nothing where the unit's option is measured: later forwards keep it."""
        pending, self._tls.check = getattr(self._tls, "check", None), None
        if pending is None:
            return
        key, fwd = pending
        plan = self.plans.get(key)
        held = [(n, at) for seq, ref, n, at in fwd.derived_at.values()
                if fwd.entered is not None and seq < fwd.entered and (every or not ref.expired())]
        if isinstance(plan, Plan) and held:
            steps = list(plan.steps)
            for _, at in held:
                for i in at:
                    steps[i] = replace(steps[i], derive=None)
            self.plans[key] = replace(plan, steps=steps, derived_bytes=plan.derived_bytes - sum(n for n, _ in held))

    def _unit_done(self, module: nn.Module, args: Any, output: Any) -> None:
        """The unit's forward returned: its hooks close, or with a tail they stay open until the
        root's forward returns (``_root_done``), re-deriving by cheap ops alone."""
        opened = getattr(self._tls, "fwd", None)
        if opened is not None and opened[1].aside:
            return  # closed with the root's forward, under what was opened inside it
        if self.tail and opened is not None and getattr(self._tls, "root", None) is not None and not raising(output):
            self._tls.tail = module
            if isinstance(opened[1], Learn):
                opened[1].watch.level = 0
            return
        self._exit(module, args, output)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if getattr(self._tls, "head", False):  # the head's forward goes on into the unit
            self._tls.head = False
            fwd = self._tls.fwd[1]
            if on_top(fwd.packer, fwd.watch if isinstance(fwd, Learn) else None):
                if isinstance(fwd, Learn):
                    fwd.watch.level, fwd.watch.width, fwd.entered = self.level, _width(args, kwargs), fwd.watch.seq
                return
            fwd.aside = True  # something opened inside the head's hooks: they close with the root's forward
            return
        tail, self._tls.tail = getattr(self._tls, "tail", None), None
        self._exit(tail, None, True)  # a tail still open ends where the unit runs again
        root = getattr(self._tls, "root", None) if self.tail else None
        if self._open_forward((_signature(module, args, kwargs), root)):
            fwd = self._tls.fwd[1]
            if isinstance(fwd, Learn):  # a replayed forward follows its plan: no width to read
                fwd.watch.width = _width(args, kwargs)

    def _open_forward(self, key: Any, head: bool = False) -> bool:
        """Open a forward of the unit's (its hooks, and the watch while it learns) for ``key``'s
        plan, from the root's forward pre-hook for a ``head``; one that runs in the root's forward
        too (a head, a tail) takes the root's parameters."""
        unit, root = self._unit(), self._root() if self._root is not None else None
        if (unit is None or recomputing() or torch.compiler.is_compiling() or not torch.is_grad_enabled()
                or saved_tensors_hooks_active()):
            return False
        plan = self.plans.get(key, _LEARN)
        owner = root if root is not None and (self.head or self.tail) else unit
        fwd: Forward = Replay(plan) if isinstance(plan, Plan) else Learn(self.level, _tensors(owner), plan is _LEARN)
        self.derived_bytes = fwd.derived_bytes
        self._tls.fwd = (key, fwd)
        hooks = torch.autograd.graph.saved_tensors_hooks(fwd.packer, unpack_hook)
        hooks.__enter__()
        self._open.append(hooks)
        if isinstance(fwd, Learn):
            fwd.head = head
            fwd.watch.level = 0 if head else self.level
            fwd.watch.__enter__()
            self._open.append(fwd.watch)
        return True

    def _exit(self, module: nn.Module | None = None, args: Any = None, output: Any = None) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
        key, fwd = getattr(self._tls, "fwd", None) or (None, None)
        self._tls.fwd = None
        if fwd is None:
            return
        fwd.close()  # autograd holds the pack hook with the graph: it must not hold tensors
        self.derived_bytes = fwd.derived_bytes
        if module is None or raising(output):
            return  # left early: learn nothing, blame nothing
        if isinstance(fwd, Learn):
            if fwd.record:
                self.plans[key] = fwd.plan()
                self._tls.check = (key, fwd) if fwd.entered is not None else None
        elif fwd.missed or fwd.n != len(fwd.plan.steps):
            self.misses[key] = misses = self.misses.get(key, 0) + 1
            if misses >= MAX_MISSES:
                self.plans[key] = None
                warnings.warn(f"memfit: the forward of a unit under derive ({type(module).__name__}) differs from "
                              "step to step; it is watched on every forward from now on (slower, as correct)",
                              MemfitWarning, stacklevel=2)
            else:
                del self.plans[key]


MAX_MISSES = 2  # forwards that did not follow their plan before a unit is watched on every forward
_LEARN = object()


def _tensors(unit: nn.Module) -> list[tuple[torch.Tensor, Weak, str, str]]:
    """The unit's parameters and buffers as this call sees them (``functional_call`` puts its
    own in the modules' dicts), each once, with where to find it again."""
    seen: set[int] = set()
    out = []
    for m in unit.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in m.__dict__[kind].items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((t, Weak(m), kind, name))
    return out


def _width(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The unit's width: its first tensor input's last dimension (a block's hidden size), where
    that input has two dimensions or more."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return first.shape[-1] if first is not None and first.dim() >= 2 else None


def _signature(unit: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a plan is for: the inputs' shapes, dtypes and grad flags (those at the top level and
    in lists there), training mode, autocast."""
    tensors = tuple((tuple(t.shape), t.dtype, t.requires_grad, t.device.type)
                    for a in (*args, *kwargs.values())
                    for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor))
    device = tensors[0][3] if tensors else "cpu"
    amp = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
    return tensors, unit.training, amp
