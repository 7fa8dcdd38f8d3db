"""Nothing memfit does outlives the step it ran for: the profiler's forward-only passes and a
checkpointed model's forward whose backward never runs (one that raised, an evaluation with grad
on) leave no autograd graph alive. A pack hook that returns the very tensor it was given made an
op's self-saved output (softmax, log_softmax) a reference cycle through C++ that Python's GC cannot
collect: memfit.profile held 530 MB of a 23 MB GPT's activations for good, and on CUDA the next
model in the same process ran out of memory (benchmarks/gpu_check.py on an H200)."""

import gc
import weakref

import pytest
import torch

import memfit
from memfit import zoo
from memfit.policy import DERIVE, DERIVE_PRODUCTS, FULL, KEEP, Segment, Selective


def _graph_tensors() -> dict[int, int]:
    """id -> storage bytes of every live real tensor that has a grad_fn (a graph's activations);
    compiled tests earlier in a session can leave symbolic ones, which are not memory. Objects from
    before the test are frozen (``_frozen_heap``), so ``gc.get_objects`` walks only the test's own: in
    a whole suite's heap the walks took 25 of this file's 31 seconds."""
    gc.collect()
    out = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            n = o.untyped_storage().nbytes()
            if isinstance(n, int):
                out[id(o)] = n
    return out


def _graph_bytes() -> int:
    """Graph bytes alive now that were not before the test began (the heap then is frozen)."""
    return sum(_graph_tensors().values())


@pytest.fixture(autouse=True)
def _frozen_heap():
    """What was alive before the test moves to the collector's permanent generation for its length:
    ``gc.get_objects`` leaves it out, and nothing of it can be a graph the test made."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _gpt():
    return zoo.nanogpt(batch=2, seq=32, vocab=128, d_model=32, n_head=4, n_layer=3, dropout=0.1)


def test_profiling_leaves_no_graph_and_the_model_can_be_freed():
    model, batch = _gpt()
    ref = weakref.ref(model)
    prof = memfit.profile(model, batch, granularity="fine", repeat=1)
    assert _graph_bytes() == 0  # before the fix: the fine profile's forward-only passes, for good
    sched = memfit.plan(prof, memfit.min_budget_bytes(prof, fine=True), granularity="fine")
    memfit.validate(model, batch, sched, steps=0)
    del model, prof, sched
    gc.collect()
    assert ref() is None and _graph_bytes() == 0


def test_a_forward_without_backward_under_every_option_leaves_no_graph():
    model, batch = _gpt()
    prof = memfit.profile(model, batch, granularity="fine", repeat=1)
    options = sorted({o for u in prof.units for o in u.options} - {KEEP}, key=str)
    assert {FULL, DERIVE, DERIVE_PRODUCTS} <= set(options)
    # the op sets, which the profile no longer offers beside derive:products, named by hand as a
    # schedule may name them
    op_sets = [Selective("weights", "attn"), Selective("gemm")]
    sched = memfit.plan(prof, 2**40, granularity="fine")  # its policies are set by hand below
    for option in options + op_sets:
        sched.policies = {u.name: option if option in u.options or option in op_sets else KEEP for u in prof.units}
        memfit.apply(model, sched)
        for _ in range(2):  # the first forward of a derive unit learns, later ones replay
            out = model(**batch)  # the loss
            assert out.requires_grad
            del out
            assert _graph_bytes() == 0, option
        memfit.remove(model)
    # a segment: several units in one region, the calls between its members paused
    names = [u.name for u in prof.units]
    sched.policies = {n: Segment(names[0], names[1]) if n in names[:2] else KEEP for n in names}
    memfit.apply(model, sched)
    out = model(**batch)
    del out
    assert _graph_bytes() == 0
    memfit.remove(model)
