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
autograd keeps anyway (or parameters, buffers, scalars), so nothing is saved that the plain step
would not save. What the compilers' partitioners do for cheap ops, done in eager mode.

``derive:products`` goes one step further, where attention is written out (``q @ k.T``, mask,
softmax, ``@ v``): row-wise softmax and products of two activations whose output is larger than
their inputs may be run again too, so the T x T probabilities are re-derived from the q and k
that the first product keeps for its own backward (Megatron's core-attention recompute, without
a checkpoint region or a selective-checkpoint dispatch mode around the unit). A recomputed tensor
that several nodes saved (the probabilities: the softmax's backward and the product with V) is
made once and held until each of them has used it.

Two pieces of PyTorch's own machinery: a ``TorchDispatchMode`` watches the unit's forward below
autograd (which op made which storage, which ops wrote into one in place), and
``torch.autograd.graph.saved_tensors_hooks`` sees what autograd saves. Random ops and in-place
ops are never re-derived, products only under ``derive:products``; inputs are checked for
in-place changes at unpack.

The unit's forward runs under both for its whole call (forward hooks, ``always_call``), so a
checkpoint region that runs inside the unit (a nested module checkpointed on its own) packs its
own tensors as usual (its hooks are inner). The option steps aside under ``torch.compile`` (the partitioner makes these
choices itself), during memfit's recomputation and inside another saved-tensor context.

Private API: ``torch._C._autograd._top_saved_tensors_default_hooks`` (is another saved-tensor
context active?), which ``torch.utils.checkpoint`` itself uses for the same question;
``torch.utils._python_dispatch.TorchDispatchMode`` and ``torch.utils._pytree``, on which SAC,
``FlopCounterMode`` and the fake tensors are built; ``StorageWeakRef`` (torch.multiprocessing's),
whether the storage an op made is still the live one at its address after its tensors died.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError
from memfit.measure.step import storage_key
from memfit.runtime.regions import PerThread, Weak, recomputing
from memfit.torch_private import (
    StorageWeakRef,
    TorchDispatchMode,
    op_schema,
    saved_tensors_hooks_active,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

_aten = torch.ops.aten
_NORMS = {getattr(_aten, n).default for n in ("native_layer_norm", "native_group_norm", "_fused_rms_norm")
          if hasattr(_aten, n)}
# the deeper level: written-out attention's scores and probabilities from the q, k (and v) that
# autograd keeps for the products anyway (Megatron's core-attention recompute, without a checkpoint)
_ROWWISE = {getattr(_aten, n).default for n in ("_softmax", "_log_softmax", "_safe_softmax") if hasattr(_aten, n)}
_PRODUCTS = {_aten.bmm.default, _aten.baddbmm.default}
# what SDPA's math path builds its causal mask from (ones, tril, where over scalar_tensor)
_MASKS = {_aten.ones.default, _aten.zeros.default, _aten.full.default, _aten.scalar_tensor.default,
          _aten.tril.default, _aten.triu.default}
MAX_DEPTH = 8  # ops one re-derived tensor may chain back through


def cheap(func: Any) -> bool:
    """Ops worth running again rather than keeping their output: deterministic, functional,
    elementwise or a norm."""
    if op_schema(func).is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return torch.Tag.pointwise in func.tags or func in _NORMS


@dataclass(slots=True)
class _Arg:
    """A tensor an op took: a weak reference (the forward must not keep anything alive), its
    storage, the entry of the op that made that storage when it ran (a chain to follow after the
    tensor itself has died), where it sits in that storage, and its version then."""

    ref: weakref.ref[torch.Tensor]
    key: int
    pinned: torch.Tensor | None  # scalars and views of parameters or buffers: held, they cost nothing
    made: _Made | None
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    version: int


@dataclass(slots=True)
class _Made:
    """The op that made a storage, its arguments (tensors as ``_Arg``), and the output it made
    (its liveness says the entry is current for that storage)."""

    func: Any
    args: Any  # (args, kwargs), tensors as _Arg
    index: int  # which output, for ops that return several
    out: StorageWeakRef  # the storage it made, outliving the output's own tensor object
    seq: int  # when it ran, in the forward's count of ops
    key: int
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    recipe: _Recipe | bool | None = None  # resolved once: a recipe, or False where none can be made


@dataclass(slots=True)
class _Recipe:
    """How to make one storage again: the op, strong references to its kept inputs and the
    recipes of the inputs that are re-derived themselves. Views of one storage saved by several
    nodes share the recomputed base: held from its first use until every saved view of it was
    unpacked (so the probabilities, saved by the softmax and by the product with V, are made once)."""

    func: Any
    args: Any  # (args, kwargs): tensors, or _Derived for inputs made again themselves
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    versions: list[tuple[torch.Tensor, int]]  # inputs other than parameters, at their version then
    base: weakref.ref[torch.Tensor] | None = None
    held: torch.Tensor | None = None
    pending: int = 0  # saved views not unpacked yet

    def make(self) -> torch.Tensor:
        base = self.held if self.held is not None else self.base() if self.base is not None else None
        if base is None:
            for t, v in self.versions:
                if t._version != v:
                    raise MemfitError(
                        f"an input of {self.func} that memfit re-derives in the backward was changed in place "
                        "after the forward used it; plan this unit without the derive option")
            args, kwargs = tree_map(_unpack, self.args)
            out = self.func(*args, **kwargs)
            base = out[0] if isinstance(out, (tuple, list)) else out  # first outputs only (see pack)
            if (tuple(base.shape), base.stride()) != self.geometry[:2]:
                raise MemfitError(f"{self.func} re-derived a tensor of another layout; plan without derive")
            self.base = weakref.ref(base)
        if self.pending > 0:
            self.held = base
        return base

    def unpacked(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.held = None


@dataclass(slots=True)
class _Derived:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the start of the op's output
    saved: bool = False  # handed to autograd (an input of another recipe is not)

    def unpack(self) -> torch.Tensor:
        out = self.recipe.make().as_strided(self.size, self.stride, self.offset)
        if self.saved:
            self.recipe.unpacked()
        return out


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), t.stride(), t.storage_offset()


class _Watch(TorchDispatchMode):
    """Records, for the storages that re-derivable ops made during the unit's forward, the op that
    made each, and when an op last wrote into a storage in place. Other ops' outputs are not
    recorded: an entry whose output has died may stand for a storage used again, and is never
    looked up by its storage again (a later op's ``_Arg`` holds it directly)."""

    def __init__(self, products: bool, params: set[int]) -> None:
        super().__init__()
        self.products = products
        self.params = params  # the unit's parameters' and buffers' storages
        self.made: dict[int, _Made] = {}
        self.written: dict[int, int] = {}  # storage -> when an op last wrote into it in place
        self.seq = 0

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.made.clear()  # the recipes hold what they need; the entries' pinned scalars go now

    def clean(self, key: int, since: int) -> bool:
        """Nothing wrote into the storage in place at or after op number ``since``."""
        return self.written.get(key, -1) < since

    def entry(self, key: int) -> _Made | None:
        made = self.made.get(key)
        return made if made is not None and not made.out.expired() else None

    def _arg(self, t: torch.Tensor) -> _Arg:
        key = storage_key(t.untyped_storage())
        pinned = t if t.dim() == 0 or key in self.params else None
        return _Arg(weakref.ref(t), key, pinned, self.entry(key), _geometry(t), t._version)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seq += 1
        ok, writes = _kind(func, self.products)
        for i, name in writes:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                self.written[storage_key(value.untyped_storage())] = self.seq
        if ok and func in _PRODUCTS and not _expands(args, out):
            ok = False
        if ok:
            recorded = None
            for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_key(t.untyped_storage())
                if self.entry(key) is None:  # new, or a dead storage's address used again
                    if recorded is None:
                        recorded = tree_map(lambda x: self._arg(x) if isinstance(x, torch.Tensor) else x,
                                            (args, kwargs))
                    self.made[key] = _Made(func, recorded, i, StorageWeakRef(t.untyped_storage()), self.seq, key,
                                           _geometry(t))
        return out


def _expands(args: Any, out: Any) -> bool:
    """A product pays for running again only where its output is larger than its inputs (q.k^T:
    T x T scores from two T x d inputs), so that what it re-derives is more than what it needs;
    probabilities.v makes less than it takes and is kept."""
    ins = sum(a.numel() for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor))
    return isinstance(out, torch.Tensor) and out.numel() > ins


_KINDS: dict[tuple[Any, bool], tuple[bool, tuple[tuple[int, str], ...]]] = {}


def _kind(func: Any, products: bool) -> tuple[bool, tuple[tuple[int, str], ...]]:
    """(re-derivable at this level, the arguments it writes into), worked out once per op: the
    watch runs on every op."""
    kind = _KINDS.get((func, products))
    if kind is None:
        writes = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments)
                       if a.alias_info is not None and a.alias_info.is_write)
        ok = cheap(func) or (products and (func in _ROWWISE or func in _PRODUCTS or func in _MASKS))
        kind = _KINDS[(func, products)] = (ok, writes)
    return kind


class Derive(PerThread):
    """Re-derive cheap saved tensors of ``unit`` (module hooks; ``remove()`` undoes them); with
    ``products``, also through products of two activations and softmax (written-out attention's
    probabilities from the q and k its first product keeps). The contexts a forward opens are
    this thread's; copies and pickles take the hooks, not them."""

    def __init__(self, unit: nn.Module, products: bool = False) -> None:
        super().__init__()
        self._unit = Weak(unit)
        self.products = products
        self.derived_bytes = 0  # storages the last forward re-derives instead of keeping
        self.handles: list[RemovableHandle] = [
            unit.register_forward_pre_hook(self._enter),
            unit.register_forward_hook(self._exit, always_call=True),
        ]

    @property
    def _open(self) -> list[Any]:
        if not hasattr(self._tls, "open"):
            self._tls.open = []
        return self._tls.open

    def remove(self) -> None:
        self._exit()
        for h in self.handles:
            h.remove()

    def _enter(self, *_: Any) -> None:
        self._exit()
        unit = self._unit()
        if (unit is None or recomputing() or torch.compiler.is_compiling() or not torch.is_grad_enabled()
                or saved_tensors_hooks_active()):
            return
        self.derived_bytes = 0
        params = {storage_key(t.untyped_storage()) for t in (*unit.parameters(), *unit.buffers())}
        watch = _Watch(self.products, params)
        kept = set(params)
        derived: set[int] = set()

        def pack(t: torch.Tensor) -> Any:
            key = storage_key(t.untyped_storage())
            made = watch.entry(key)
            # an op's first output only: a norm's statistics are small, and its backward would run it again
            if made is not None and key not in kept and watch.clean(key, made.seq + 1):
                recipe = _resolve(made, watch, kept, 0)
                if recipe is not None:
                    if key not in derived:
                        derived.add(key)
                        self.derived_bytes += t.untyped_storage().nbytes()
                    recipe.pending += 1
                    return _Derived(recipe, tuple(t.shape), t.stride(), t.storage_offset() - made.geometry[2], True)
            kept.add(key)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
        hooks.__enter__()
        self._open.append(hooks)
        watch.__enter__()
        self._open.append(watch)

    def _exit(self, *_: Any) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)


def _resolve(made: _Made, watch: _Watch, kept: set[int], depth: int) -> _Recipe | None:
    """The recipe for ``made``'s storage, or None: every tensor input is kept by autograd (or a
    parameter, a buffer, a scalar) and unchanged since, or is re-derivable itself (its storage
    made by a recorded op, never written in place, at most ``MAX_DEPTH`` ops back)."""
    if made.recipe is not None:
        return made.recipe or None
    if made.index != 0 or depth > MAX_DEPTH:
        return None
    made.recipe = False  # no cycles while this one resolves
    versions: list[tuple[torch.Tensor, int]] = []
    leaves, spec = tree_flatten(made.args)
    args = []
    for a in leaves:
        if isinstance(a, _Arg):
            x = _input(a, made, watch, kept, depth)
            if x is None:
                return None
            if isinstance(x, torch.Tensor) and a.key not in watch.params:
                versions.append((x, a.version))  # as the op found it
            a = x
        args.append(a)
    made.recipe = _Recipe(made.func, tree_unflatten(args, spec), made.geometry, versions)
    return made.recipe


def _input(a: _Arg, made: _Made, watch: _Watch, kept: set[int], depth: int) -> torch.Tensor | _Derived | None:
    """An input of ``made``'s op as a recipe takes it: the tensor where autograd keeps it (or it
    is a parameter, a buffer, a scalar) and nothing wrote into it since; else its own recipe."""
    t = a.pinned if a.pinned is not None else a.ref()
    if t is not None and (a.key in kept or t.dim() == 0) and watch.clean(a.key, made.seq):
        return t
    sub = a.made
    if sub is None or sub.seq >= made.seq or not watch.clean(sub.key, sub.seq + 1):
        return None
    recipe = _resolve(sub, watch, kept, depth + 1)
    if recipe is None:
        return None
    size, stride, offset = a.geometry
    return _Derived(recipe, size, stride, offset - sub.geometry[2])


def _unpack(obj: Any) -> Any:
    return obj.unpack() if isinstance(obj, _Derived) else obj
