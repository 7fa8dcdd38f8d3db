"""The tools ``peers.py`` sets memfit beside, each applied the way its own documentation shows.

- torch.compile under ``torch._functorch.config.activation_memory_budget`` (``budget_backend``);
- PyTorch's module-level MILP ``torch.distributed._tools.sac_ilp.sac_milp`` over MemTracker,
  RuntimeEstimator and SACEstimator statistics (``SacMilp``);
- the hand-made choices: every layer, every other layer, Megatron-style selective recomputation
  of core attention (``hand_made``);
- Rockmate runs in the user's own environment: see rockmate_worker.py.

Private API: all of ``torch.distributed._tools`` is private; it is what PyTorch ships as its
planner. Its runtime estimators work only on CUDA (event timing, or a roofline that reads the
GPU's capabilities), so on the CPU each operator is timed here on real tensors of its shapes,
and the times are scaled so that the whole step takes the time memfit measured for it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memfit.policy import KEEP, Policies
from memfit.runtime.apply import set_policies
from memfit.steps.compiled_budget import compiler

_aten = torch.ops.aten
PRODUCTS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def budget_backend(budget: float) -> Any:
    """aot_eager partitioning under this activation memory budget: memfit's own
    (``steps/compiled_budget.compiler``), one backend object per budget, so copies compiled for
    other budgets do not share graphs (Dynamo guards on the backend; nn.Modules are graph inputs,
    so with one backend the guards would pass for any copy)."""
    return compiler("aot_eager", budget)


def training_copy(model: nn.Module, policies: Policies | None = None,
                  budget: float | None = None) -> tuple[nn.Module, Any, Any]:
    """A copy of ``model`` in training mode, with memfit's ``policies`` set, compiled under
    activation memory ``budget`` where one is given (``budget_backend``; 1.0, the default, for
    policies planned for the compiled step): the copy, its backend (None: eager) and what a step
    calls (the copy, or it compiled)."""
    m = copy.deepcopy(model)
    m.train()
    if policies:
        set_policies(m, policies)
    backend = None if budget is None else budget_backend(budget)
    return m, backend, m if backend is None else torch.compile(m, backend=backend)


def same_gradients(a: Any, b: Any) -> str:
    """Loss and every gradient of run ``b`` against run ``a`` (``measure_steps``' results),
    parameters taken in order (wrappers rename them)."""
    worst = 0.0
    for x, y in zip([*a.grads.values(), torch.tensor(a.losses)], [*b.grads.values(), torch.tensor(b.losses)],
                    strict=True):
        if x is None or y is None:
            if x is not y:
                return "no (a gradient is missing)"
            continue
        if not torch.equal(x, y):
            worst = max(worst, ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item())
    return "yes" if worst == 0 else (f"yes (within {worst:.0e})" if worst <= 1e-5 else f"no ({worst:.1e} apart)")


def wrap(model: nn.Module, names: list[str], context_fn: Callable[[], Any] | None = None) -> None:
    """``checkpoint_wrapper`` (non-reentrant) around the named modules, as FSDP users do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    targets = {id(model.get_submodule(n)) for n in names}
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    fn = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=fn, check_fn=lambda m: id(m) in targets)


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def hand_made(kind: str, model: nn.Module, units: list[str]) -> str:
    """Apply one hand-made choice; returns how, in words. ``every`` uses Hugging Face's own
    ``gradient_checkpointing_enable`` where the model has it."""
    if kind == "every":
        if hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return "gradient_checkpointing_enable()"
        wrap(model, units)
        return "checkpoint_wrapper on every layer"
    if kind == "every-other":
        wrap(model, units[::2])
        return "checkpoint_wrapper on every other layer"
    if kind == "attention":
        attn = [f"{u}.{c}" for u in units for c, _ in model.get_submodule(u).named_children() if "attn" in c
                or "attention" in c]
        wrap(model, attn, functools.partial(create_selective_checkpoint_contexts, _keep_products))
        return "core attention recomputed (projections kept), every layer"
    raise ValueError(kind)


def _real(t: Any) -> Any:
    """A real CPU tensor with a fake tensor's shape, strides and dtype (random values)."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    if t.dtype.is_floating_point:
        out.uniform_(0.5, 1.0)  # positive: no log or sqrt of a negative, no NaN slow paths
    elif t.dtype != torch.bool:
        out.zero_()
    else:
        out.fill_(True)
    return out


class CpuClock:
    """Times each operator on real CPU tensors of the fake ones' shapes (median of 3 runs, in
    milliseconds, as the estimators report), then answers the fake result."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.cache: dict[tuple[Any, ...], float] = {}

    def __call__(self, func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_map

        res = func(*args, **(kwargs or {}))
        key = (func, *(tuple(a.shape) if isinstance(a, torch.Tensor) else repr(a) for a in args))
        if key not in self.cache:
            with unset_fake_temporarily():
                real_args, real_kwargs = tree_map(_real, (args, kwargs or {}))
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    try:
                        func(*real_args, **real_kwargs)
                    except Exception:  # an op that needs real values (indices, say): counted as free
                        times = [0.0]
                        break
                    times.append(time.perf_counter() - start)
            self.cache[key] = statistics.median(times) * 1e3
        return res, self.cache[key] * self.scale


class SacMilp:
    """PyTorch's planner on one model: statistics gathered once, then ``plan(budget_bytes)``
    gives the module -> discard-ratio decisions and ``apply`` checkpoints a copy accordingly."""

    def __init__(self, build: Callable[[], tuple[nn.Module, Any]], step: Callable[[nn.Module, Any], torch.Tensor],
                 optimizer: Callable[[nn.Module], torch.optim.Optimizer | None], step_s: float) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
        from torch.distributed._tools.mem_tracker import MemTracker, _ModState
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        from torch.distributed._tools.sac_estimator import SACEstimator

        started = time.perf_counter()
        clock = CpuClock()
        with FakeTensorMode():
            model, inputs = build()
            opt = optimizer(model)

            def one_step() -> None:
                step(model, inputs).backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad()

            mem = MemTracker()
            mem.track_external(model, *([opt] if opt is not None else []))
            with mem as mt:  # twice, as its tests do: the second step has the optimizer state
                one_step()
                mt.reset_mod_stats()
                step(model, inputs).backward()
                last = mt.get_tracker_snapshot("current")
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            for stats in mem.memory_tracking.values():  # modules whose inputs need no grad: see its tests
                if _ModState.POST_BW not in stats.snapshots:
                    stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last))
            runtime = RuntimeEstimator()
            runtime("operator-level-benchmark")
            runtime._estimate = clock  # the CUDA-only estimators replaced by CPU timing
            with contextlib.redirect_stdout(io.StringIO()), runtime:  # it prints its total
                one_step()
            clock.scale = step_s * 1e3 / runtime.total_runtime if runtime.total_runtime > 0 else 1.0
            with contextlib.redirect_stdout(io.StringIO()), runtime:  # again, at memfit's measured scale
                one_step()
            sac = SACEstimator()
            sac("operator-level-benchmark")
            sac._estimate_runtime = clock
            with sac:
                loss = step(model, inputs)
            loss.backward()
            self.info = aggregate_stats(model, mem, runtime, sac, torch.device("cpu"))
            self.stats = dict(sac.sac_mod_stats)
        self.graph = parse_module_info(self.info)
        self.root = self.graph.nodes[0]["fqn"]
        self.stats_s = time.perf_counter() - started

    def plan(self, budget_bytes: int) -> tuple[dict[str, float], int, float]:
        """(module name -> share of its activation memory to discard, its peak bound or -1, seconds)."""
        from torch.distributed._tools.sac_ilp import sac_milp

        started = time.perf_counter()
        decisions, _, peak = sac_milp(self.graph, memory_budget=budget_bytes / 2**30)
        return decisions, peak, time.perf_counter() - started

    def apply(self, model: nn.Module, decisions: dict[str, float]) -> None:
        """Each chosen module under the op policy PyTorch's per-module MILP picks for its ratio."""
        from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

        for fqn, discard in decisions.items():
            stats = self.stats[fqn]
            keep = get_optimal_checkpointing_policy_per_module(stats, memory_budget=max(0.0, 1 - discard))
            name = fqn[len(self.root) + 1:]
            # an in-place op shares its producer's decision (SACEstimator pairs them): a kept dropout
            # mask is filled in place after it is cached, which SAC allows only when told
            wrap(model, [name], functools.partial(create_selective_checkpoint_contexts,
                                                  _IndexedPolicy(stats.func_names, keep),
                                                  allow_cache_entry_mutation=True))


class _IndexedPolicy:
    """The per-operator decisions, matched to the operators in the order SACEstimator saw them
    (it skips the same ``OPS_TO_ALWAYS_SKIP``); a recomputation starts counting again."""

    def __init__(self, names: list[str], keep: list[int]) -> None:
        from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

        self.skip = OPS_TO_ALWAYS_SKIP
        self.names, self.keep = names, keep
        self.at = {False: 0, True: 0}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.skip:
            return CheckpointPolicy.PREFER_RECOMPUTE
        k = self.at[ctx.is_recompute] % max(1, len(self.names))
        self.at[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if k < len(self.keep) and self.keep[k] else CheckpointPolicy.PREFER_RECOMPUTE


def plan_summary(policies: Policies | None) -> str:
    """A schedule's options, counted: ``derive x4, full x2`` (units left as they are not named)."""
    counts = Counter(str(p) for p in (policies or {}).values() if p != KEEP)
    return ", ".join(f"{p} x{k}" for p, k in sorted(counts.items())) or "nothing checkpointed"
