"""Checkpointed regions that leave every module call as it was: a unit, or a segment of units.

A region is opened by a forward pre-hook on its first unit and closed by a forward hook on its
last, around non-reentrant checkpointing's saved-tensor machinery. So every unit, segment
members included, is still entered once per forward through its own ``nn.Module.__call__``
with its real input and output: forward hooks (users', FSDP2's all-gather, adapters) see what
they see on the plain model. The recomputation calls the units again through ``__call__``, as
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

Private API: ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, the generator
form of non-reentrant checkpointing that ``torch.distributed._composable.checkpoint`` builds
on for one module; a region spanning several modules needs the same split into "enter before
the first forward" and "exit after the last".
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator, checkpoint
from torch.utils.checkpoint import noop_context_fn as _noop
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError

_state = {"recomputing": 0}


def recomputing() -> bool:
    """True while a region's forward is being recomputed (inside the backward pass)."""
    return _state["recomputing"] > 0


class Region:
    """Units ``modules`` (one, or a segment that runs them one after another) checkpointed as one."""

    def __init__(self, modules: list[nn.Module], context_fn: Callable[[], Any], *, chain: bool = False) -> None:
        # Weak references: the modules hold the region (hooks, attribute), and a cycle back would
        # leave a dropped model to the cyclic collector, whose frees can land inside a measured step.
        self._modules = [weakref.ref(m) for m in modules]
        self.context_fn = context_fn
        self.handles: list[RemovableHandle] = []
        self._open: Generator[None, None, None] | None = None
        self._calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._chain = chain
        self._last: Any = None  # a chain's previous member's output, until the next member takes it
        for k, module in enumerate(modules):
            self.handles.append(module.register_forward_pre_hook(self._pre(k), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(k), always_call=True))
            module.__dict__["_memfit_region"] = self
            module.__dict__["_memfit_forward"] = module.__dict__.get("forward")
            wrap = not chain or (k > 0 and any(True for _ in module.children()))
            module.__dict__["forward"] = functools.partial(_forward, weakref.ref(module), context_fn if wrap else None)

    @property
    def modules(self) -> list[nn.Module]:
        return [m for ref in self._modules if (m := ref()) is not None]

    def remove(self) -> None:
        self._close(error=True)
        for h in self.handles:
            h.remove()
        for module in self.modules:
            module.__dict__.pop("_memfit_region", None)
            module.__dict__.pop("forward", None)
            prior = module.__dict__.pop("_memfit_forward", None)
            if prior is not None:
                module.__dict__["forward"] = prior

    def _pre(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if recomputing() or torch.compiler.is_compiling():
                return
            if k == 0:
                # A forward that raised inside the region (out of memory, say) left it open: its
                # saved-tensor context ends here, before the retry, or at remove().
                self._close(error=True)
                calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
                self._calls = calls
                # Keyword arguments travel in the closure, so that names such as ``debug`` in a
                # unit's forward cannot collide with the generator's own keywords.
                gen = _checkpoint_without_reentrant_generator(
                    self._recompute(calls, kwargs), True, self.context_fn, "default", False, True, *args
                )
                next(gen)  # inside the region from here: saved tensors are left for recomputation
                self._open = gen
            else:
                if self._chain:
                    self._check_link(k, args)
                # The later units' first argument is the previous unit's output, recomputed; keep
                # only the rest (masks, positions), so that inner activations are not held.
                self._calls.append((args[1:], kwargs))

        return hook

    def _post(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if recomputing() or torch.compiler.is_compiling():
                return
            if _raising(output):
                self._close(error=True)
            elif k == len(self.modules) - 1:
                self._close(error=False)
            elif self._chain:
                self._last = output

        return hook

    def _check_link(self, k: int, args: tuple[Any, ...]) -> None:
        """The recomputation feeds member ``k`` the previous member's output: it must be what the
        forward fed it, or the gradients would be computed from another tensor."""
        last, self._last = self._last, None
        if not args or args[0] is not last:
            self._close(error=True)
            names = [type(m).__name__ for m in self.modules]
            raise MemfitError(
                f"memfit: a checkpointed chain expects {names[k]} to be called with the output of {names[k - 1]}, "
                "and this forward called it with something else; the schedule does not fit this model's forward: "
                "profile and plan it again")

    def close_failed(self) -> None:
        """Leave the region after a forward that raised (see ``guard``)."""
        self._close(error=True)

    def _close(self, *, error: bool) -> None:
        gen, self._open = self._open, None
        self._last = None
        # The recomputation holds the later members' other arguments until the backward frees
        # it; the region's own reference would keep them (a Hugging Face layer's masks and
        # position tensors) into the next step, where their free lands inside that step.
        self._calls = []
        if gen is None:
            return
        if error:
            gen.close()  # leave the saved-tensor context without checks
            return
        try:
            next(gen)
        except StopIteration:
            pass

    def _recompute(self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
                   kwargs: dict[str, Any]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            _state["recomputing"] += 1
            try:
                out = self.modules[0](*args, **kwargs)
                for module, (rest, kw) in zip(self.modules[1:], calls, strict=True):
                    out = module(out, *rest, **kw)
            finally:
                _state["recomputing"] -= 1

        return run


def _forward(ref: weakref.ref[nn.Module], context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any) -> Any:
    """A unit's forward: its own, eagerly (the region's hooks checkpoint it); under
    ``torch.compile``, inside ``torch.utils.checkpoint.checkpoint``, unless ``context_fn`` is
    None (a chain member left to the partitioner)."""
    module = ref()
    assert module is not None, "a unit's forward outlived its module"
    own = module.__dict__["_memfit_forward"] or functools.partial(type(module).forward, module)
    if context_fn is None or not torch.compiler.is_compiling():
        return own(*args, **kwargs)
    # Keywords travel in a partial, so that names such as ``debug`` cannot reach checkpoint's own.
    fn = functools.partial(own, **kwargs) if kwargs else own
    # Dynamo accepts no context_fn, or a plain function or partial that makes the contexts.
    extra = {} if context_fn is _noop else {"context_fn": context_fn}
    return checkpoint(fn, *args, use_reentrant=False, **extra)


def _raising(output: Any) -> bool:
    """An ``always_call`` forward hook is called with no output while the forward raises."""
    return output is None and sys.exc_info()[0] is not None


def guard(model: nn.Module, regions: list[Region]) -> list[RemovableHandle]:
    """Hooks on the whole model that leave every open region when its forward raises, or
    before the next forward: an open region would capture whatever autograd saves next."""

    def close_all(*_: Any) -> None:
        if torch.compiler.is_compiling():
            return  # compiled units checkpoint through their forward; no region is ever open
        for region in regions:
            region.close_failed()

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _raising(output):
            close_all()

    return [model.register_forward_pre_hook(close_all, prepend=True),
            model.register_forward_hook(after, always_call=True)]
