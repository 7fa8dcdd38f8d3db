"""Re-deriving cheap saved tensors in the backward instead of keeping them (the ``derive``
option): op-level recomputation without a checkpoint.

Autograd keeps many tensors that one cheap op makes from other tensors it keeps anyway: the
dropped attention probabilities (``softmax * mask``, saved for the product with V, while the
softmax output and the mask are saved for their own backward), an activation's output (saved by
the next product, while its input is saved by the activation), a norm's output (its input and
weights are kept). A unit under ``derive`` keeps the recipe instead, the op and references to
those inputs, and runs the op again when the backward asks for the tensor. What autograd keeps
is the reference: nothing is saved that the plain step would not save, and a recipe is used
only when every input is already kept by autograd or is a parameter, a buffer or a scalar, so
the references hold nothing longer than it does. What the compilers' partitioners do for cheap ops,
done in eager mode.

Two pieces of PyTorch's own machinery: a ``TorchDispatchMode`` watches the unit's forward below
autograd (which op made which storage, which ops wrote into one in place), and
``torch.autograd.graph.saved_tensors_hooks`` sees what autograd saves. Random ops, in-place
ops and products are never re-derived; inputs are checked for in-place changes at unpack.

The unit's forward runs under both for its whole call (forward hooks, ``always_call``), so a
checkpoint region that runs inside the unit (a nested module checkpointed on its own) packs its
own tensors as usual (its hooks are inner). The option steps aside under ``torch.compile`` (the partitioner makes these
choices itself), during memfit's recomputation and inside another saved-tensor context.

Private API: ``torch._C._autograd._top_saved_tensors_default_hooks`` (is another saved-tensor
context active?), which ``torch.utils.checkpoint`` itself uses for the same question;
``torch.utils._python_dispatch.TorchDispatchMode`` and ``torch.utils._pytree``, on which SAC,
``FlopCounterMode`` and the fake tensors are built.
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
from memfit.torch_private import TorchDispatchMode, op_schema, saved_tensors_hooks_active, tree_flatten, tree_map

_aten = torch.ops.aten
_NORMS = {getattr(_aten, n).default for n in ("native_layer_norm", "native_group_norm", "_fused_rms_norm")
          if hasattr(_aten, n)}


def cheap(func: Any) -> bool:
    """Ops worth running again rather than keeping their output: deterministic, functional,
    elementwise or a norm."""
    if op_schema(func).is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return torch.Tag.pointwise in func.tags or func in _NORMS


@dataclass(slots=True)
class _Made:
    """The op that made a storage, with weak references to its inputs (the forward must not
    keep anything alive), and the output it made (its liveness says the entry is current)."""

    func: Any
    args: Any  # args and kwargs, tensors as weak references
    index: int  # which output, for ops that return several
    out: weakref.ref[torch.Tensor]
    seq: int  # when it ran, in the forward's count of ops
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    recipe: _Recipe | None = None  # once autograd saved the output and it is worth re-deriving


@dataclass(slots=True)
class _Recipe:
    """How to make one storage again: the op and strong references to its (kept) inputs. Views
    of one storage saved by several nodes share it and the recomputed base while it lives."""

    func: Any
    args: Any  # (args, kwargs)
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    versions: list[tuple[torch.Tensor, int]]  # inputs other than parameters, at their version then
    base: weakref.ref[torch.Tensor] | None = None

    def make(self) -> torch.Tensor:
        base = self.base() if self.base is not None else None
        if base is None:
            for t, v in self.versions:
                if t._version != v:
                    raise MemfitError(
                        f"an input of {self.func} that memfit re-derives in the backward was changed in place "
                        "after the forward used it; plan this unit without the derive option")
            args, kwargs = self.args
            out = self.func(*args, **kwargs)
            base = out[0] if isinstance(out, (tuple, list)) else out  # first outputs only (see pack)
            if (tuple(base.shape), base.stride()) != self.geometry[:2]:
                raise MemfitError(f"{self.func} re-derived a tensor of another layout; plan without derive")
            self.base = weakref.ref(base)
        return base


@dataclass(slots=True)
class _Derived:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the start of the op's output

    def unpack(self) -> torch.Tensor:
        return self.recipe.make().as_strided(self.size, self.stride, self.offset)


class _Watch(TorchDispatchMode):
    """Records, for the storages that cheap ops made during the unit's forward, the op that made
    each, and when an op last wrote into a storage in place. Other ops' outputs are not recorded:
    an entry whose output has died may stand for a storage used again, and is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, _Made] = {}
        self.written: dict[int, int] = {}  # storage -> when an op last wrote into it in place
        self.seq = 0

    def clean(self, key: int, since: int) -> bool:
        """Nothing wrote into the storage in place at or after op number ``since``."""
        return self.written.get(key, -1) < since

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seq += 1
        ok, writes = _kind(func)
        for i, name in writes:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                self.written[storage_key(value.untyped_storage())] = self.seq
        if ok:
            for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_key(t.untyped_storage())
                old = self.made.get(key)
                if old is None or old.out() is None:  # new, or a dead storage's address used again
                    self.made[key] = _Made(func, _weak((args, kwargs)), i, weakref.ref(t), self.seq,
                                           (tuple(t.shape), t.stride(), t.storage_offset()))
        return out


_KINDS: dict[Any, tuple[bool, tuple[tuple[int, str], ...]]] = {}


def _kind(func: Any) -> tuple[bool, tuple[tuple[int, str], ...]]:
    """(cheap, the arguments it writes into), worked out once per op: the watch runs on every op."""
    kind = _KINDS.get(func)
    if kind is None:
        writes = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments)
                       if a.alias_info is not None and a.alias_info.is_write)
        kind = _KINDS[func] = (cheap(func), writes)
    return kind


def _weak(tree: Any) -> Any:
    return tree_map(lambda x: weakref.ref(x) if isinstance(x, torch.Tensor) else x, tree)


def _strong(tree: Any) -> Any:
    return tree_map(lambda x: x() if isinstance(x, weakref.ref) else x, tree)


class Derive(PerThread):
    """Re-derive cheap saved tensors of ``unit`` (module hooks; ``remove()`` undoes them). The
    contexts a forward opens are this thread's; copies and pickles take the hooks, not them."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self._unit = Weak(unit)
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
        watch = _Watch()
        self.derived_bytes = 0
        kept = {storage_key(t.untyped_storage()) for t in (*unit.parameters(), *unit.buffers())}
        params = set(kept)

        def pack(t: torch.Tensor) -> Any:
            key = storage_key(t.untyped_storage())
            made = watch.made.get(key)
            # an op's first output only: a norm's statistics are small, and its backward would run it again
            if (made is not None and made.index == 0 and made.out() is not None and watch.clean(key, made.seq + 1)
                    and key not in kept):
                recipe = made.recipe
                if recipe is None:
                    refs = [a for a in tree_flatten(made.args)[0] if isinstance(a, weakref.ref)]
                    tensors = [a for r in refs if (a := r()) is not None]
                    keys = [storage_key(a.untyped_storage()) for a in tensors]
                    usable = [(k in kept or a.dim() == 0) and watch.clean(k, made.seq)
                              for a, k in zip(tensors, keys, strict=True)]
                    if len(tensors) == len(refs) and all(usable):
                        self.derived_bytes += t.untyped_storage().nbytes()
                        args = _strong(made.args)
                        versions = [(a, a._version) for a, k in zip(tensors, keys, strict=True) if k not in params]
                        recipe = made.recipe = _Recipe(made.func, args, made.geometry, versions)
                if recipe is not None:
                    return _Derived(recipe, tuple(t.shape), t.stride(), t.storage_offset() - made.geometry[2])
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


def _unpack(obj: Any) -> torch.Tensor:
    return obj.unpack() if isinstance(obj, _Derived) else obj
