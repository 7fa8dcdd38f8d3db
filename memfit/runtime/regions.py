"""Checkpointed regions that leave every module call as it was: a unit, or a segment of units.

A region is opened by a forward pre-hook on its first unit and closed by a forward hook on its
last, around non-reentrant checkpointing's saved-tensor machinery; a region of one unit, by
memfit's forward of the unit around the unit's own (no hooks: ``nn.Module.__call__`` keeps its
fast path). So every unit, segment members included, is still entered once per forward through
its own ``nn.Module.__call__`` with its real input and output: forward hooks (users', FSDP2's
all-gather, adapters) see what they see on the plain model, and a single unit's hooks run outside
its region. The recomputation calls the units again through ``__call__``, as
``torch.utils.checkpoint`` around the same modules would.

Under ``torch.compile`` the hooks step aside (Dynamo would trace them as if the saved-tensor
context were not there, so nothing would be checkpointed): each unit's forward is instead
wrapped in ``torch.utils.checkpoint.checkpoint``, which Dynamo turns into its activation-
checkpoint higher-order op and AOTAutograd's partitioner recomputes. A segment then compiles as
one checkpoint per member, so it keeps every member's input, as ``full`` units do: plan with
``segments=False`` (``memfit plan --compile``) for a compiled model.

A **chain** (``child:ln_2>mlp.0``) is a region over modules of one unit that feed each other,
typically a cheap producer (a norm, an activation) and the product that consumes its output.
Non-reentrant checkpointing stops recomputing as soon as every tensor the region saved is back
(``torch.utils.checkpoint``'s early stop, on by default), and a matrix product saves its inputs
before it computes: so the backward recomputes only the producer, and the producer's output is
not kept. Each member must be called with the previous one's output, which the region checks.
Under ``torch.compile`` a chain's producer is left to the partitioner, which recomputes such
ops itself; only members with modules inside them are wrapped (``child:ln_2>mlp``).

A segment's members must run in order, each taking the previous one's output (or its first
element): that is what the recomputation replays. A forward that skips a member (LayerDrop),
feeds one something else, or ends early (an exit, a depth argument) closes the region after the
last member that ran in order, and the next member opens a region of its own, so the
recomputation replays exactly what ran. Between members the region steps aside (identity
saved-tensor hooks), so ops the model runs between its units are saved as on the plain model.

State that belongs to a forward (the open region, the recompute depth) is per thread, as
autograd's saved-tensor hooks are; the regions and hooks reach their modules through ``Weak``
references, which ``copy.deepcopy`` and pickling carry over to the copy's own modules.

A unit whose parameters were substituted for the call (``torch.func.functional_call`` with fast
weights) is recomputed with the same substituted tensors; BatchNorm's running statistics are
left as they were by a recomputation (held still, or put back: ``PutBack``), so they are updated
once, whatever the mode was at ``apply``, and nothing of the unit is kept across the forward (a
kept output could be changed in place later, as every ResNet does with ``out += identity``). A
member whose input was changed in place since the previous member returned (``relu_`` between
two units) opens a region of its own, since the replay feeds it the previous member's output.

Private API: ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, the generator
form of non-reentrant checkpointing that ``torch.distributed._composable.checkpoint`` builds
on for one module; a region spanning several modules needs the same split into "enter before
the first forward" and "exit after the last".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError
from memfit.measure.host import UnderDispatchMode, Work
from memfit.measure.step import packed
from memfit.runtime.op_sets import OP_SETS, keep
from memfit.runtime.recompute_state import PutBack, Tables, substituted
from memfit.runtime.threads import PerThread, Recomputing, Weak, opened_regions, raising, recomputing
from memfit.runtime.unit_forward import NOOP, install, own, uninstall
from memfit.torch_private import MODULE_HOOKS, BatchNorm, checkpoint_generator


@dataclass(slots=True)
class _Call:
    """A member as the forward called it: the arguments after the first (the first member's all
    travel in the checkpoint), and the tensors substituted for its parameters, if any."""

    k: int
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    takes_first: bool  # it was given the previous member's output[0], not the whole output
    tensors: dict[str, torch.Tensor] | None


@dataclass(slots=True)
class _Open:
    gen: Generator[None, None, None]
    calls: list[_Call]
    k: int  # the member that ran last
    last: Any = None  # its output, until the next member takes it
    version: int = 0  # that output's version counter then: changed in place since, it is not what the replay makes
    pause: Any = None  # identity saved-tensor hooks between members
    ran: bool = False  # the member ``k`` returned


class Region(PerThread):
    """Units ``modules`` (one, or a segment that runs them one after another) checkpointed as
    one, keeping what ``op_set`` (a name in ``OP_SETS``, or "") says."""

    def __init__(self, modules: list[nn.Module], op_set: str = "", *, chain: bool = False,
                 inner: bool = False) -> None:
        super().__init__()
        self._modules = [Weak(m) for m in modules]
        self.op_set = op_set
        self.handles: list[RemovableHandle] = []
        self._chain = chain
        self.inner = inner  # inside a checkpointed unit (``nested:``): opens in its recomputation too
        # One unit: its own forward (memfit's, below) opens and closes the region, which spares
        # two hooks on the unit and ``nn.Module.__call__``'s slow path for hooks, forward and
        # recompute (2 points of a launch-bound step, benchmarks/launch_bound.py).
        self.single = len(modules) == 1 and not chain
        for k, module in enumerate(modules):
            if not self.single:
                self.handles.append(module.register_forward_pre_hook(
                    functools.partial(Region._pre_hook, self, k), with_kwargs=True))
                self.handles.append(module.register_forward_hook(
                    functools.partial(Region._post_hook, self, k), always_call=True))
            module.__dict__["_memfit_region"] = self
            install(module, wrap=not chain or (k > 0 and any(True for _ in module.children())))

    @property
    def modules(self) -> list[nn.Module]:
        return [m for ref in self._modules if (m := ref()) is not None]

    def _aside(self) -> bool:
        """Steps aside while recomputing: the forward runs again inside the region's checkpoint.
        A region nested in a checkpointed unit opens again in the unit's recomputation, as a
        ``torch.utils.checkpoint`` call inside another does (the unit's recomputation then keeps
        only what the region leaves out), and steps aside only in its own."""
        if self.inner:
            return getattr(self._tls, "recomputing", 0) > 0
        return recomputing()

    @property
    def is_open(self) -> bool:
        """This thread is inside the region (its saved-tensor context), or between its members."""
        return getattr(self._tls, "open", None) is not None

    def compiled_context(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
        """What a compiled unit's checkpoint keeps instead of recomputing: nothing, or the op
        policy's choice (the compiled graph updates BatchNorm's buffers once by itself)."""
        if not self.op_set:
            return NOOP
        return functools.partial(create_selective_checkpoint_contexts,
                                 functools.partial(keep, OP_SETS[self.op_set]))

    def _contexts(self) -> tuple[Any, Any]:
        """The region's checkpoint contexts: the op set's, and around its recomputation, the
        BatchNorm statistics put back as they were (outside SAC's dispatch mode, which would
        take the copies for ops of the unit)."""
        if self.op_set:  # estimate mode's clock prices the op set's dispatch modes per op
            made = self.compiled_context()()
            made = (UnderDispatchMode(made[0]), UnderDispatchMode(made[1]))
        else:
            made = _NOTHING
        norms = self._norms()
        return (made[0], PutBack(norms, made[1])) if norms else made

    def _tables(self, k: int) -> Tables:
        """The parameter tables of member ``k``'s modules that have parameters, found once per
        thread (a walk over every submodule on every call cost more than the check itself)."""
        tables = getattr(self._tls, "tables", None)
        if tables is None:
            tables = self._tls.tables = [Tables([m._parameters for m in module.modules() if m._parameters])
                                         for module in self.modules]
        return tables[k]

    def _norms(self) -> list[nn.Module]:
        """The members' BatchNorm layers, found once per thread (held weakly, as the members are)."""
        norms = getattr(self._tls, "norms", None)
        if norms is None:
            norms = self._tls.norms = [Weak(m) for unit in self.modules for m in unit.modules()
                                       if isinstance(m, BatchNorm)]
        return [m for ref in norms if (m := ref()) is not None]

    def remove(self) -> None:
        self._close(error=True)
        for h in self.handles:
            h.remove()
        for module in self.modules:
            module.__dict__.pop("_memfit_region", None)
            uninstall(module)

    def _pre_hook(self, k: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._aside() or torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return  # no_grad: nothing is saved, nothing to checkpoint
        st: _Open | None = getattr(self._tls, "open", None)
        if (st is not None and st.ran and k == st.k + 1 and (takes_first := _takes(st.last, args)) is not None
                and _version(st.last) == st.version):
            st.pause.__exit__(None, None, None)
            st.pause, st.last, st.k, st.ran = None, None, k, False
            st.calls.append(_Call(k, args[1:], kwargs, takes_first, substituted(module, self._tables(k))))
            return
        # Not the next member fed the previous one's output: the members so far close as a region
        # of their own (a forward that raised before left it open too), and this one opens another.
        self._close(error=st is not None and not st.ran)
        if self._chain and k > 0:
            names = [type(m).__name__ for m in self.modules]
            raise MemfitError(
                f"memfit: a checkpointed chain expects {names[k]} to be called with the output of {names[k - 1]}, "
                "and this forward called it with something else; the schedule does not fit this model's forward: "
                "profile and plan it again")
        gen, calls = self._enter(k, module, args, kwargs)
        self._tls.open = _Open(gen, calls, k)
        opened_regions()[self] = None

    def _enter(self, k: int, module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[Generator[None, None, None], list[_Call]]:
        """Inside the region from here on, from member ``k``'s call: saved tensors are left for
        recomputation until the generator is resumed (checked) or closed (without checks). The
        calls list is what the recomputation replays; later members append theirs."""
        calls = [_Call(k, (), {}, False, substituted(module, self._tables(k)))]
        # Keyword arguments travel in the closure, so that names such as ``debug`` in a unit's
        # forward cannot collide with the generator's own keywords.
        gen = checkpoint_generator(
            self._recompute(calls, kwargs), True, self._contexts, "default", False, True, *args)
        next(gen)
        return gen, calls

    def run(self, module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        """A single unit's call of its forward, inside the region (outside it while recomputing,
        or where nothing is saved)."""
        if self._aside() or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        gen, _ = self._enter(0, module, args, kwargs)
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            gen.close()  # leave the saved-tensor context without checks
            raise
        _finish(gen)
        return out

    def _post_hook(self, k: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._aside() or torch.compiler.is_compiling():
            return
        st: _Open | None = getattr(self._tls, "open", None)
        if st is None or st.k != k or st.ran:
            return  # this call ran outside the region (under no_grad, say)
        if raising(output):
            self._close(error=True)
        elif k == len(self._modules) - 1:
            self._close(error=False)
        else:
            st.last, st.ran, st.version = output, True, _version(output)
            st.pause = torch.autograd.graph.saved_tensors_hooks(packed, _same)
            st.pause.__enter__()

    def close(self, *, error: bool) -> None:
        """Leave the region if this thread has it open: after the members that ran, or (``error``)
        without checks, after a forward that raised."""
        st: _Open | None = getattr(self._tls, "open", None)
        self._close(error=error or (st is not None and not st.ran))

    def _close(self, *, error: bool) -> None:
        st: _Open | None = getattr(self._tls, "open", None)
        if st is None:
            return
        self._tls.open = None  # drops the later members' arguments and the last output with it
        opened_regions().pop(self, None)
        if st.pause is not None:
            st.pause.__exit__(None, None, None)
        if error:
            st.gen.close()  # leave the saved-tensor context without checks
        else:
            _finish(st.gen)

    def _recompute(self, calls: list[_Call], kwargs: dict[str, Any]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            with Recomputing(self._tls), Work():
                out: Any = None
                for i, call in enumerate(calls):
                    if i == 0:
                        inputs, kw = args, kwargs
                    else:
                        inputs, kw = (out[0] if call.takes_first else out, *call.rest), call.kwargs
                    module = self._modules[call.k]()
                    if call.tensors is None:
                        # with no hook to run, nn.Module.__call__ would call the forward straight away;
                        # a unit whose region went since (another shape's plan) is called as it is now
                        direct = module.__dict__.get("_memfit_region") is self and not _hooked(module)
                        out = own(module)(*inputs, **kw) if direct else module(*inputs, **kw)
                    else:  # the fast weights the forward ran with
                        out = torch.func.functional_call(module, call.tensors, inputs, kw)

        return run


_NOTHING = (contextlib.nullcontext(), contextlib.nullcontext())  # reusable: what noop_context_fn makes


def _hooked(module: nn.Module) -> bool:
    """``nn.Module.__call__`` would run hooks around this module's forward (its fast path's test)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or any(MODULE_HOOKS))


def _finish(gen: Generator[None, None, None]) -> None:
    """Leave a region's saved-tensor context, with non-reentrant checkpointing's checks."""
    try:
        next(gen)
    except StopIteration:
        pass


def _takes(last: Any, args: tuple[Any, ...]) -> bool | None:
    """How a member's first argument is the previous member's output: whole (False), its first
    element (True, as Hugging Face layers return tuples), or not at all (None)."""
    if not args or last is None:
        return None
    if args[0] is last:
        return False
    if isinstance(last, (tuple, list)) and last and args[0] is last[0]:
        return True
    return None


def _version(output: Any) -> int:
    """The version counter of a member's output (its first element's, for a tuple): an in-place op
    between two members (``bn1``, then ``relu_``, then ``maxpool``) bumps it, and the recomputation,
    which feeds each member the previous one's output, would leave that op out."""
    first = output[0] if isinstance(output, (tuple, list)) and output else output
    return first._version if isinstance(first, torch.Tensor) else 0


def _same(t: Any) -> Any:
    return t


def guard(model: nn.Module, regions: list[Region]) -> list[RemovableHandle]:
    """Hooks on the whole model that leave every region this thread has open when the forward
    returns (after the members that ran: an early exit) or raises, and before the next forward:
    an open region would capture whatever autograd saves next, in any model."""
    return [model.register_forward_pre_hook(functools.partial(_close_all, regions), prepend=True),
            model.register_forward_hook(functools.partial(_after, regions), always_call=True)]


def _close_all(regions: list[Region], *_: Any, error: bool = True) -> None:
    if torch.compiler.is_compiling() or recomputing():
        return  # compiled units checkpoint through their forward; no region is ever open
    for region in [r for r in opened_regions() if r in regions]:
        region.close(error=error)


def _after(regions: list[Region], module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    _close_all(regions, error=raising(output))
