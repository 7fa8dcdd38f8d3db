"""The watch behind ``derive`` (runtime/derive.py): which op made which storage during a unit's
forward, which ops wrote into one in place, and from those, the recipe that makes a saved tensor
again from tensors autograd keeps anyway. It runs in a unit's learning forward only.

Private API: ``torch.utils._python_dispatch.TorchDispatchMode`` and ``torch.utils._pytree``, on
which SAC, ``FlopCounterMode`` and the fake tensors are built; ``StorageWeakRef``
(torch.multiprocessing's), whether the storage an op made is still the live one at its address
after its tensors died.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from memfit.measure.step import storage_key
from memfit.runtime.derive_rng import CPU_STATE_BYTES, Fill, RngAt, rng_state
from memfit.torch_private import StorageWeakRef, TorchDispatchMode, op_schema, tree_flatten, tree_map, tree_unflatten

_aten = torch.ops.aten
_NORMS = {getattr(_aten, n).default for n in ("native_layer_norm", "native_group_norm", "_fused_rms_norm")
          if hasattr(_aten, n)}
# the deeper level: written-out attention's scores and probabilities from the q, k (and v) that
# autograd keeps for the products anyway (Megatron's core-attention recompute, without a checkpoint)
ROWWISE = {getattr(_aten, n).default for n in ("_softmax", "_log_softmax", "_safe_softmax") if hasattr(_aten, n)}
ACTIVATION_PRODUCTS = frozenset({_aten.bmm.default, _aten.baddbmm.default})  # q.k^T and probabilities.v
# levels 2 and 3: products with a weight (a projection from a norm's output that is itself
# re-derived), what the compiler's partitioner recomputes at small budgets (q, k, v in a ViT block)
_WEIGHT_PRODUCTS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ADDS_PRODUCT = {_aten.addmm.default, _aten.baddbmm.default}  # (bias, left, right)
# what SDPA's math path builds its causal mask from (ones, tril, where over scalar_tensor)
MASKS = {_aten.ones.default, _aten.zeros.default, _aten.full.default, _aten.scalar_tensor.default,
          _aten.tril.default, _aten.triu.default}
_COPIES = {_aten.cat.default, _aten.embedding.default}
# a dropout's noise (the CPU's composite: empty_like, bernoulli_, div_) or mask (a GPU's fused
# native_dropout), re-made from the generator's state (derive_rng.Fill) at level 1 and deeper
_EMPTY = {_aten.empty_like.default, _aten.empty.memory_format, _aten.empty_strided.default}
_SCALES = {_aten.div_.Scalar, _aten.mul_.Scalar}
_DRAWS = {_aten.bernoulli_.float, _aten.native_dropout.default}
MAX_DEPTH = 8  # ops one re-derived tensor may chain back through


def cheap(func: Any) -> bool:
    """Ops worth running again rather than keeping their output: deterministic, functional,
    elementwise, a norm, a ``cat`` (a copy: RoPE's rotate-half between Llama's projections and
    the q and k that SDPA keeps) or an embedding's gather (the first block's input, from the
    token ids and positions the embeddings' backward keeps)."""
    if op_schema(func).is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return torch.Tag.pointwise in func.tags or func in _NORMS or func in _COPIES


@dataclass(slots=True)
class _Arg:
    """A tensor an op took: a weak reference (the forward must not keep anything alive), its
    storage, the entry of the op that made that storage when it ran (a chain to follow after the
    tensor itself has died), where it sits in that storage, and its version then."""

    ref: weakref.ref[torch.Tensor]
    key: int
    pinned: torch.Tensor | None  # views of parameters or buffers: held, they cost nothing
    made: _Made | None
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    version: int
    storage: StorageWeakRef  # alive: the key is still this storage's
    dtype: torch.dtype


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
    first: _Made | None = None  # a later output's: the entry of the call's first output
    bounded: bool = False  # a product no larger than its inputs: re-run only beneath a row-wise op
    blocked: bool = False  # its recipe was refused for a bounded product outside a row-wise op


@dataclass(slots=True, eq=False)
class _Recipe:
    """While learning: how to make one storage again, the op and its inputs as this forward has
    them (tensors autograd keeps, parameters, or ``_Derived`` for inputs made again themselves);
    derive_plan.template_of names them by position."""

    func: Any
    args: Any  # (args, kwargs)
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(slots=True)
class _Derived:
    recipe: _Recipe
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the start of the op's output


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), t.stride(), t.storage_offset()


class OpWatch(TorchDispatchMode):
    """Records, for the storages that re-derivable ops made during the unit's forward, the op that
    made each, and when an op last wrote into a storage in place. Other ops' outputs are not
    recorded: an entry whose output has died may stand for a storage used again, and is never
    looked up by its storage again (a later op's ``_Arg`` holds it directly)."""

    def __init__(self, level: int, params: set[int]) -> None:
        super().__init__()
        self.level = level  # policy.Derive's: 1 products, 2 attention's projections, 3 every product with a weight
        self.width: int | None = None  # the unit's input's last dimension, where it has one (``_projects``)
        self.params = params  # the unit's parameters' and buffers' storages
        self.made: dict[int, _Made] = {}
        self.written: dict[int, int] = {}  # storage -> when an op last wrote into it in place
        self.seq = 0
        # the fills: storages an empty op made (when, which), the generator's states they take
        # (RngAt.packs -> state), tensors packed so far, whether a seeded op ran since the last
        self.fresh: dict[int, tuple[int, StorageWeakRef]] = {}
        self.rng: dict[int, torch.Tensor] = {}
        self.packs = 0
        self.seeded = False

    def packed(self, packs: int) -> None:
        """The forward's pack hook packed its ``packs``-th tensor: the generator's state now is
        the one the next fill draws from, if no seeded op runs before it."""
        self.packs, self.seeded = packs, False

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.made.clear()  # the recipes hold what they need; the entries' pinned scalars go now
        self.fresh.clear()

    def clean(self, key: int, since: int) -> bool:
        """Nothing wrote into the storage in place at or after op number ``since``."""
        return self.written.get(key, -1) < since

    def entry(self, key: int) -> _Made | None:
        made = self.made.get(key)
        return made if made is not None and not made.out.expired() else None

    def _arg(self, t: torch.Tensor) -> _Arg:
        key = storage_key(t.untyped_storage())
        pinned = t if key in self.params else None
        return _Arg(weakref.ref(t), key, pinned, self.entry(key), _geometry(t), t._version,
                    StorageWeakRef(t.untyped_storage()), t.dtype)

    def _projects(self, func: Any, args: Any, out: Any) -> bool:
        """A product with a weight (a parameter or a buffer, or a view of one): at level 3 any, at
        level 2 one whose output is no larger than its activation operand and whose sum runs over
        no more than the unit's width: q, k and v (grouped or not) and attention's output
        projection, not an MLP's up-projection, whose output (four times its input) the compiler's
        partitioner keeps while it recomputes the projections (HF ViT at activation budget 0.3; at
        0.1 it recomputes that one too), nor its down-projection, which costs four times as much a
        byte made again (a pre-norm block's output, which the final norm keeps: HF ViT's 1.2 MiB
        for 3.3 ms a step, against 0.8 ms a MiB for the rest of this level)."""
        tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        weights = [a for a in tensors if storage_key(a.untyped_storage()) in self.params]
        acts = [a for a in tensors if a.dim() >= 2 and all(a is not w for w in weights)]
        if not (weights and len(acts) == 1 and isinstance(out, torch.Tensor)):
            return False
        if self.level >= 3:
            return True
        first = args[1] if func in _ADDS_PRODUCT else args[0]  # the left operand: (b)mm's sum runs over its last dim
        return (out.numel() <= acts[0].numel()
                and (self.width is None or not isinstance(first, torch.Tensor) or first.shape[-1] <= self.width))

    def _fillable(self, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
        """A dropout's draw whose noise can be made again: ``bernoulli_`` into a whole storage
        that an empty op made and nothing wrote into yet, or a fused ``native_dropout`` in
        training (on CPU or CUDA: another device's generator is not taken), with the default
        generator, and no seeded op since the last packed tensor (whose hook then took the state
        this draw starts from). On the CPU the state is held where the noise would be: a noise no
        larger is kept."""
        if (func not in _DRAWS or self.level < 1 or self.seeded or kwargs.get("generator") is not None
                or args[0].device.type not in ("cpu", "cuda")):
            return False
        t = args[0]
        fused = func is _aten.native_dropout.default
        noise = t.numel() * (1 if fused else t.element_size())  # the fused mask: one byte each
        if t.device.type == "cpu" and noise <= CPU_STATE_BYTES:
            return False
        if fused:  # (input, p, train): the schema has no defaults, so the dispatcher passes all three
            return bool(args[2]) and 0 < args[1] < 1
        key = storage_key(t.untyped_storage())
        fresh = self.fresh.get(key)
        return (fresh is not None and not fresh[1].expired() and self.written.get(key, -1) < fresh[0]
                and t.storage_offset() == 0 and t.untyped_storage().nbytes() == noise)

    def _draw(self, func: Any, args: Any, out: Any, state: torch.Tensor) -> None:
        """Record a fill's draw, ``state`` the generator's before it: the noise's storage is now
        made by the fill."""
        t = args[0]
        self.rng[self.packs] = state
        if func is _aten.native_dropout.default:
            fill = Fill(tuple(t.shape), t.stride(), t.dtype, t.device, fused=args[1], offset=t.storage_offset())
            t = out[1]
        else:
            fill = Fill(tuple(t.shape), t.stride(), t.dtype, t.device, ((func, tuple(args[1:])),))
        key = storage_key(t.untyped_storage())
        self.made[key] = _Made(fill, ((RngAt(self.packs),), {}), 0, StorageWeakRef(t.untyped_storage()),
                               self.seq, key, _geometry(t))

    def _scale(self, func: Any, args: Any) -> None:
        """An in-place scaling (dropout's ``div_``) of a fill just drawn, before ``written`` takes
        this op: the fill takes it too."""
        key = storage_key(args[0].untyped_storage())
        made = self.entry(key)
        if (made is not None and isinstance(made.func, Fill) and made.func.fused is None
                and self.written.get(key) == made.seq and len(args) == 2 and isinstance(args[1], (int, float))):
            made.func = replace(made.func, ops=(*made.func.ops, (func, (args[1],))))
            made.seq = self.seq

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        state = rng_state(args[0].device) if self._fillable(func, args, kwargs) else None  # before the draw
        out = func(*args, **kwargs)
        self.seq += 1
        if state is not None:
            self._draw(func, args, out, state)
        elif self.level >= 1 and func in _SCALES:
            self._scale(func, args)
        if self.level >= 1 and func in _EMPTY and isinstance(out, torch.Tensor):
            self.fresh[storage_key(out.untyped_storage())] = (self.seq, StorageWeakRef(out.untyped_storage()))
        ok, writes, seeded = _kind(func, self.level >= 1)
        self.seeded = self.seeded or seeded
        for i, name in writes:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                self.written[storage_key(value.untyped_storage())] = self.seq
        # a product of two activations that makes no more than it takes is re-run only on the way
        # to a row-wise op's output (the scores of heads no shorter than the sequence), never for
        # its own output (P.v)
        bounded = ok and func in ACTIVATION_PRODUCTS and not _expands(args, out)
        if not ok and self.level >= 2 and func in _WEIGHT_PRODUCTS and self._projects(func, args, out):
            ok = True
        if bounded and self.level >= 2 and self._projects(func, args, out):
            bounded = False
        if ok:
            recorded, first = None, None
            for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_key(t.untyped_storage())
                if self.entry(key) is None:  # new, or a dead storage's address used again
                    if recorded is None:
                        recorded = tree_map(lambda x: self._arg(x) if isinstance(x, torch.Tensor) else x,
                                            (args, kwargs))
                    made = self.made[key] = _Made(func, recorded, i, StorageWeakRef(t.untyped_storage()), self.seq,
                                                  key, _geometry(t), first=first, bounded=bounded)
                    first = first or (made if i == 0 else None)
        return out


def _expands(args: Any, out: Any) -> bool:
    """A product is worth running again only where its output is larger than each of its inputs
    (q.k^T: T x T scores from two T x d inputs, where T > d), so that it re-derives more than either
    input it needs; probabilities.v makes less than the probabilities and is kept. One that does not
    is recorded as bounded, run again only beneath a row-wise op (``resolve``). (Its inputs are
    kept by autograd anyway: the bytes freed are the output's, whatever the inputs' sum; the sum
    as the bar kept heads of 64 at 128 tokens, where the compiler's partitioner recomputes them.)"""
    ins = max((a.numel() for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), default=0)
    return isinstance(out, torch.Tensor) and out.numel() > ins


_KINDS: dict[tuple[Any, bool], tuple[bool, tuple[tuple[int, str], ...], bool]] = {}


def _kind(func: Any, products: bool) -> tuple[bool, tuple[tuple[int, str], ...], bool]:
    """(re-derivable at this level, the arguments it writes into, whether it draws from a
    generator), worked out once per op: the watch runs on every op."""
    kind = _KINDS.get((func, products))
    if kind is None:
        writes = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments)
                       if a.alias_info is not None and a.alias_info.is_write)
        ok = cheap(func) or (products and (func in ROWWISE or func in ACTIVATION_PRODUCTS or func in MASKS))
        kind = _KINDS[(func, products)] = (ok, writes, torch.Tag.nondeterministic_seeded in func.tags)
    return kind


def resolve(made: _Made, watch: OpWatch, kept: Callable[[int], torch.Tensor | None],
            depth: int, rowwise: bool = False) -> _Recipe | None:
    """The recipe for ``made``'s storage, or None: every tensor input is kept by autograd (or a
    parameter or a buffer) and unchanged since, or is re-derivable itself (its storage made by a
    recorded op, never written in place, at most ``MAX_DEPTH`` ops back). A bounded product only
    beneath a row-wise op (``rowwise``: one is above it in this resolution); an entry refused for
    one (``blocked``) is tried again from beneath one."""
    if made.bounded and not rowwise:
        made.blocked = True
        return None
    if made.recipe is not None and not (made.recipe is False and made.blocked and rowwise):
        return made.recipe or None
    if made.index != 0:  # a norm's statistics: the run that makes its output again makes them too
        made.recipe = (made.func in _NORMS and made.first is not None
                       and resolve(made.first, watch, kept, depth, rowwise)) or False
        return made.recipe or None
    if depth > MAX_DEPTH:
        return None
    rowwise = rowwise or made.func in ROWWISE
    made.recipe, made.blocked = False, False  # no cycles while this one resolves
    leaves, spec = tree_flatten(made.args)
    args = []
    for a in leaves:
        if isinstance(a, _Arg):
            found = _input(a, made, watch, kept, depth, rowwise)
            if found is None:
                made.blocked = a.made is not None and a.made.blocked
                return None
            a = found
        args.append(a)
    made.recipe = _Recipe(made.func, tree_unflatten(args, spec), made.geometry)
    return made.recipe


def _input(a: _Arg, made: _Made, watch: OpWatch, kept: Callable[[int], torch.Tensor | None],
           depth: int, rowwise: bool) -> torch.Tensor | _Derived | None:
    """An input of ``made``'s op as a recipe takes it: the tensor where autograd keeps it (or it
    is a parameter or a buffer) and nothing wrote into it since; else its own recipe. A scalar
    tensor of the forward's own is neither: a later forward may hold another value there.
    ``kept(key)``: a tensor of that storage where autograd keeps it, else None. A view the op took
    may have died while its storage is kept: autograd gives a view op's caller a shallow copy of
    what the dispatcher made when something else holds that (as_view; this watch does), so
    matmul's reshape of a one-head q is not the tensor bmm saved; the input is then that view of
    the kept storage."""
    t = a.pinned if a.pinned is not None else a.ref()
    whole = kept(a.key)
    if t is None and whole is not None and not a.storage.expired() and whole.dtype == a.dtype:
        t = whole.detach().as_strided(*a.geometry)
    if t is not None and whole is not None and watch.clean(a.key, made.seq):
        return t
    sub = a.made
    if sub is None or sub.index != 0 or sub.seq >= made.seq or not watch.clean(sub.key, sub.seq + 1):
        return None
    recipe = resolve(sub, watch, kept, depth + 1, rowwise)
    if recipe is None:
        return None
    size, stride, offset = a.geometry
    return _Derived(recipe, size, stride, offset - sub.geometry[2])
