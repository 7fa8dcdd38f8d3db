"""Every private PyTorch symbol memfit uses, reached here once, each with why and since which
torch it is known to work (checked on 2.13, the version memfit is tested with, and 2.11). Where a
public API does the job (``torch.compiler.reset``, ``list_backends``), memfit uses that instead.

A torch upgrade that moves one of these fails the feature that uses it, with a MemfitError that
names the symbol, not the import of memfit: a symbol that cannot be found is replaced by a stand-in
(``_private``) that raises when used."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from memfit.errors import MemfitError


def _private(module: str, name: str, since: str, *, kind: str = "function") -> Any:
    """``module.name``, or a stand-in of the same kind (a class can still be subclassed and
    tested with isinstance, which is then False) that raises MemfitError when called."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        missing = exc

    def fail(*_: Any, **__: Any) -> Any:
        raise MemfitError(f"this feature needs PyTorch's private {module}.{name} (there since torch {since}), "
                          f"which torch {torch.__version__} does not have ({missing}); use a torch memfit is "
                          "tested with (2.11 to 2.13), or report it")

    if kind == "class":
        return type(name, (), {"__init__": fail, "__module__": __name__})
    return fail


# An allocator event of the profiler's event tree, with the block's address: the CPU meter
# (measure/memory.py) counts a free only if it saw the block made. The public events carry no
# address, and the CPU allocator reports a free of a block made while no profiler ran with a stale
# size from its table (an earlier block at that address). Since torch 1.13.
ProfiledAllocation = _private("torch._C._profiler", "_ExtraFields_Allocation", "1.13", kind="class")
# An op's event in the same tree; with ``record_shapes`` its ``inputs`` name each tensor input's
# storage address (``_TensorMetadata.storage_data_ptr``): when a block a collective's worker thread
# freed unheard was last used. Since torch 2.0.
ProfiledOp = _private("torch._C._profiler", "_ExtraFields_TorchOp", "2.0", kind="class")

# Fake tensors: estimate mode builds and runs the model without memory. Since torch 2.0.
# ``unset_fake_temporarily``: a small computation run for real while a model is built (its values
# read in Python: drop-path rates, relative position tables; FSDP2's mesh of both dimensions over
# tensor-parallel parameters, made from a tensor of rank numbers). Since torch 2.1.
FakeTensorMode = _private("torch._subclasses.fake_tensor", "FakeTensorMode", "2.0", kind="class")
is_fake = _private("torch._subclasses.fake_tensor", "is_fake", "2.0")
unset_fake_temporarily = _private("torch._subclasses.fake_tensor", "unset_fake_temporarily", "2.1")

# A weak reference to a storage, which outlives every tensor object that views it: derive
# (runtime/derive.py) asks whether a storage an op made is still the live one at its address.
# torch.multiprocessing's own; the same ``_weak_ref``/``_expired`` pair FakeTensor's converter
# uses. Since torch 1.x.
StorageWeakRef = _private("torch.multiprocessing.reductions", "StorageWeakRef", "1.x", kind="class")

# The base of every dispatch-level observer: FlopCounterMode and selective checkpointing are
# built on it. memfit's meters (measure/fake.py), saved-tensor attribution (profiler/saved.py)
# and derive (runtime/derive.py) see each op with its real arguments through it. Since torch 1.13.
TorchDispatchMode = _private("torch.utils._python_dispatch", "TorchDispatchMode", "1.13", kind="class")
is_traceable_wrapper_subclass = _private("torch.utils._python_dispatch", "is_traceable_wrapper_subclass", "2.1")

# pytree flattening of op arguments, as SAC and torch.compile use it. Since torch 1.10.
tree_flatten = _private("torch.utils._pytree", "tree_flatten", "1.10")
tree_map = _private("torch.utils._pytree", "tree_map", "1.10")
tree_unflatten = _private("torch.utils._pytree", "tree_unflatten", "1.10")

# The generator form of non-reentrant checkpointing (what torch.distributed._composable.checkpoint
# builds on): opened and closed around several module calls, a segment of units. Since torch 2.1.
checkpoint_generator = _private("torch.utils.checkpoint", "_checkpoint_without_reentrant_generator", "2.1")

# BatchNorm1d/2d/3d and SyncBatchNorm share this base; its running statistics are put back around
# a recompute (runtime/regions.py). Since torch 1.0.
BatchNorm = _private("torch.nn.modules.batchnorm", "_BatchNorm", "1.0", kind="class")

# nn.Module's global hooks, which its __call__ tests before taking its fast path: a recomputation
# calls a unit's forward straight away when neither these nor the unit's own hooks are set
# (runtime/regions.py). Since torch 1.13 (backward pre-hooks since 2.0). A stand-in is a function,
# which counts as a hook: the recomputation then goes through __call__.
MODULE_HOOKS = tuple(_private("torch.nn.modules.module", name, "2.0", kind="function")
                     for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                  "_global_backward_pre_hooks"))

__all__ = ["MODULE_HOOKS", "BatchNorm", "FakeTensorMode", "ProfiledAllocation", "ProfiledOp", "StorageWeakRef",
           "TorchDispatchMode", "allow_in_compiled_graph",
           "amp_unscale_", "amp_update_scale_", "aten_kernels", "below_autograd", "checkpoint_generator", "fake_store",
           "grad_scaler_tensors",
           "inner_tensors", "is_fake", "on_top", "op_schema", "saved_tensors_hooks_active", "schedule_ops",
           "stages_per_rank",
           "tree_flatten",
           "tree_map", "tree_unflatten", "unset_fake_temporarily", "without_autocast_cpu"]


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a wrapper subclass's data (a DTensor's local shard), or ``t`` itself.
    A dispatch mode sees a DTensor op's wrapper output, whose storage has the global size; the
    op on the shard runs below the mode. ``__tensor_flatten__`` is the traceable-subclass protocol
    torch.compile flattens DTensors by (torch.utils._python_dispatch, since torch 2.1)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    held = (getattr(t, name) for name in names)
    return [inner for h in held if isinstance(h, torch.Tensor) for inner in inner_tensors(h)]


def op_schema(func: Any) -> Any:
    """An ATen op's schema (mutability, argument names): ``OpOverload._schema``. Since torch 1.13."""
    return func._schema


def without_autocast_cpu() -> Any:
    """A context in which CPU autocast's kernels are skipped, as autocast's own C++ wrappers leave
    it around the op they wrap (``torch._C._ExcludeDispatchKeyGuard``; since torch 1.10)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


@contextlib.contextmanager
def aten_kernels(kernels: Iterable[tuple[str, Any]], key: str) -> Iterator[None]:
    """ATen kernels, (``name.overload``, kernel), registered at dispatch ``key`` while open; on
    leaving, the library's registrations are removed at once (``Library._destroy``, what its own
    teardown calls; since torch 2.0) and the kernels they replaced are in force again."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            for name, kernel in kernels:
                lib.impl(name, kernel, key)
        yield
    finally:
        lib._destroy()


def below_autograd() -> Any:
    """A context in which ops dispatch below autograd, as autograd's own kernels run the op they
    record (``torch._C._AutoDispatchBelowAutograd``; since torch 1.10)."""
    return torch._C._AutoDispatchBelowAutograd()


# The innermost dispatch mode in force: whether derive's head still has its watch on top (on_top).
# Since torch 2.0.
_current_dispatch_mode = _private("torch.utils._python_dispatch", "_get_current_dispatch_mode", "2.0")


def on_top(pack: Any, mode: Any) -> bool:
    """Whether ``pack`` is the saved-tensor pack hook in force and ``mode`` (None: any) the
    innermost dispatch mode: nothing was opened inside them since.
    ``torch._C._autograd._top_saved_tensors_default_hooks`` and ``_current_dispatch_mode``."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top[0] == pack and (mode is None or _current_dispatch_mode() is mode)


def saved_tensors_hooks_active() -> bool:
    """Whether another saved-tensor hook pair is in force (checkpoint's, FSDP's, the user's):
    ``torch._C._autograd._top_saved_tensors_default_hooks``. Since torch 2.0."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def fake_store() -> Any:
    """PyTorch's own store for the "fake" process group, whose collectives move nothing, for
    estimating N ranks in one process. Imported on use: it pulls in torch.testing. Since torch 2.2."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def allow_in_compiled_graph(fn: Any) -> None:
    """Let ``fn`` be called from a compiled forward without a graph break: Dynamo runs the
    functions in ``torch._dynamo.config.reorderable_logging_functions`` after the graph (a config
    set, not a documented API; it keeps ``fullgraph=True`` working). Since torch 2.2. Imports
    torch._dynamo (seconds), so call it only where compilation may follow."""
    torch._dynamo.config.reorderable_logging_functions.add(fn)


def more_compiled_versions(n: int) -> contextlib.AbstractContextManager[Any]:
    """Let Dynamo keep ``n`` more compiled versions of one forward before it falls back to eager
    (copies of a model whose units run different options are each a cache entry of the model's
    forward): ``torch._dynamo.config.recompile_limit`` and ``accumulated_recompile_limit``, patched
    for the duration. Since torch 2.7 (``cache_size_limit`` before)."""
    import torch._dynamo

    config = torch._dynamo.config
    return config.patch(recompile_limit=config.recompile_limit + n,
                        accumulated_recompile_limit=config.accumulated_recompile_limit + n)


def partitioner_budget(memory_budget: float) -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd's min-cut partitioner keeps at most ``memory_budget`` (0 to 1) of the
    activations it could keep, recomputing the rest: ``torch._functorch.config.activation_memory_budget``,
    patched for the duration. Read when a graph is partitioned, inside the backend's first call
    for it. Since torch 2.4."""
    import torch._functorch.config

    return torch._functorch.config.patch(activation_memory_budget=memory_budget)


def backend_by_name(name: str) -> Any:
    """The compiler ``torch.compile(backend=name)`` would call (``torch._dynamo.lookup_backend``),
    so that memfit can wrap it. Since torch 2.0."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def amp_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's unscaling kernel (``torch._amp_foreach_non_finite_check_and_unscale_``), for
    estimate mode's stand-in scaler (measure/step.py:ValuelessScaler). Since torch 1.9."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def amp_update_scale_(scale: torch.Tensor, growth: torch.Tensor, found_inf: torch.Tensor, factor: float,
                      backoff: float, interval: int) -> None:
    """GradScaler's scale update (``torch._amp_update_scale_``), for the same stand-in. Since torch 1.9."""
    torch._amp_update_scale_(scale, growth, found_inf, factor, backoff, interval)


def grad_scaler_tensors(scaler: Any) -> list[torch.Tensor]:
    """The tensors a ``torch.amp.GradScaler`` keeps across steps (its scale and growth tracker,
    made on the first ``scale()``): ``_scale`` and ``_growth_tracker``. Since torch 1.6."""
    return [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
            if isinstance(t, torch.Tensor)]


def stages_per_rank(schedule: Any) -> int:
    """How many stages a ``torch.distributed.pipelining`` schedule (a name as torchtitan names it,
    "1F1B", "GPipe", "Interleaved1F1B", ..., or its class) runs on each rank: one for a
    ``PipelineScheduleSingle`` (whose runtime is its own loop), two for the others (memfit plans
    them so). An unknown name raises torch's ValueError. Since torch 2.6."""
    single = _private("torch.distributed.pipelining.schedules", "PipelineScheduleSingle", "2.6", kind="class")
    return 1 if issubclass(_schedule_class(schedule), single) else 2


def _schedule_class(schedule: Any) -> Any:
    """The schedule class a name stands for (torch's ``get_schedule_class``), or the class given."""
    if not isinstance(schedule, str):
        return schedule
    return _private("torch.distributed.pipelining.schedules", "get_schedule_class", "2.6")(schedule)


def schedule_ops(schedule: Any, stages: int, microbatches: int) -> tuple[list[list[Any]], bool]:
    """Each rank's actions (``_Action``: stage_index, computation_type, microbatch_index; None for
    an idle step) in a ``torch.distributed.pipelining`` schedule (``stages_per_rank``'s), for
    ``stages`` stages: the schedule's own ``pipeline_order``, made on stand-in stages by the
    pipelining package's visualizer, so that memfit reads the order without a process group; and
    whether the schedule runs one stage a rank (its runtime is then its own loop, not this order).
    Imported here, not with memfit (it loads the pipelining package). Since torch 2.6."""
    ops = _private("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", "2.6")
    per_rank = stages_per_rank(schedule)
    name = schedule if isinstance(schedule, str) else schedule.__name__
    if stages % per_rank:
        raise MemfitError(f"{name} runs {per_rank} stages on each rank: give a number of stages it divides")
    return ops(_schedule_class(schedule), stages // per_rank, microbatches, per_rank), per_rank == 1


def fsdp_reduce_after_pipeline(module: Any) -> None:
    """What ``PipelineStage.perform_reduce_grad`` does for an FSDP2 stage after its last backward:
    gradient sync and resharding on again, every FSDP state's parameter groups' ``post_backward``
    (the reduce-scatter of the gradients accumulated unsharded over the micro-batches), then the
    root's final callback. Reads ``fully_shard.state(module)._state_ctx.all_states``,
    ``_fsdp_param_groups`` and ``_root_post_backward_final_callback``, as torch's stage does.
    Since torch 2.6."""
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    root = fully_shard.state(module)
    for state in root._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            group.post_backward()
    root._root_post_backward_final_callback()
