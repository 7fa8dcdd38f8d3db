"""What a scheduled unit's ``forward`` attribute is: its own forward, eagerly (a region or
``derive`` does the work around it), and under ``torch.compile`` its own forward inside
``torch.utils.checkpoint.checkpoint`` with the option's selective-checkpoint policy, which
Dynamo turns into its activation-checkpoint higher-order op and AOTAutograd's partitioner obeys.

So a compiled step keeps what the plan chose, at the compiler's cost (no saved-tensor hooks, no
Python per op): ``full`` keeps the unit's input, ``selective:`` its op set, ``derive`` levels
what ``op_sets.derive_policy`` keeps (the products of their level; cheap ops are recomputed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.checkpoint import noop_context_fn as NOOP

from memfit.runtime.threads import Weak


class Runs(Protocol):
    """What runs a unit (a region, a ``derive``): eagerly, ``run``; its compiled policy."""

    def compiled_context(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]: ...


def install(module: nn.Module, wrap: bool = True) -> None:
    """``module``'s forward becomes memfit's (``UnitForward``); ``uninstall`` puts its own back."""
    module.__dict__["_memfit_forward"] = module.__dict__.get("forward")
    module.__dict__["forward"] = UnitForward(module, wrap)


def uninstall(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)
    prior = module.__dict__.pop("_memfit_forward", None)
    if prior is not None:
        module.__dict__["forward"] = prior


def own(module: nn.Module) -> Callable[..., Any]:
    """The unit's own forward, under memfit's (an instance's own forward attribute, or its class's)."""
    return module.__dict__["_memfit_forward"] or type(module).forward.__get__(module)


class UnitForward:
    """A unit's forward: its own, eagerly (a single unit's region runs it inside the region);
    under ``torch.compile``, inside ``checkpoint`` with the compiled policy of what runs it (its
    region or its ``derive``), unless ``wrap`` is False (a chain member left to the partitioner)."""

    __slots__ = ("module", "wrap")

    def __init__(self, module: nn.Module, wrap: bool) -> None:
        self.module = Weak(module)
        self.wrap = wrap

    def __reduce__(self) -> tuple[Any, ...]:
        return (UnitForward, (self.module(), self.wrap))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        assert module is not None, "a unit's forward outlived its module"
        forward = own(module)
        region = module.__dict__.get("_memfit_region")
        if not torch.compiler.is_compiling():
            return region.run(module, forward, args, kwargs) if region is not None and region.single \
                else forward(*args, **kwargs)
        if not self.wrap:
            return forward(*args, **kwargs)
        runs: Runs = region if region is not None else module.__dict__["_memfit_derive"]
        # Keywords travel in a partial, so that names such as ``debug`` cannot reach checkpoint's own.
        fn = functools.partial(forward, **kwargs) if kwargs else forward
        context_fn = runs.compiled_context(args, kwargs)
        # Dynamo accepts no context_fn, or a plain function or partial that makes the contexts.
        extra = {} if context_fn is NOOP else {"context_fn": context_fn}
        return checkpoint(fn, *args, use_reentrant=False, **extra)
