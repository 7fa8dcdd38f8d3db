"""The first unit's ``derive`` takes the head (the embeddings before it), the last unit's the tail
(final norm, head, loss after it): what the model's forward runs there saves no tensor that cheap
ops re-make (runtime/derive.py), and the memory model books it (profiler/phases.add_tail):
predicted = measured, gradients = the plain model's."""

import copy

import pytest
import torch

import memfit
from memfit import zoo
from memfit.policy import FULL, Derive, parse
from memfit.runtime.apply import set_policies
from memfit.runtime.harness import measure_steps
from memfit.torch_private import saved_tensors_hooks_active
from memfit.trainstep import TrainStep
from memfit.units import find_units

from .test_apply import _assert_identical, _run

BATCH, TOKENS, WIDTH = 2, 32, 64


def _nano(dropout: float = 0.1):
    """nanoGPT (final LayerNorm, tied head, the loss in its forward), dropout on; a vocabulary that
    puts the step's peak at the loss, as in GPTs."""
    return zoo.nanogpt(batch=BATCH, seq=TOKENS, vocab=2048, d_model=WIDTH, n_head=2, n_layer=3, dropout=dropout)


def _unit_only(model, names):
    """Derive as it was before the head and the tail: the first and last units' hooks on the root
    and on the blocks like them go."""
    for name in (names[0], names[-1]):
        d = model.get_submodule(name).__dict__["_memfit_derive"]
        for h in d.handles[2:]:
            h.remove()
    return model


def test_the_first_and_last_blocks_derive_re_derive_the_embeddings_and_final_norms_outputs():
    """The first block's input (the embeddings' sum times dropout's mask), which its first norm
    keeps, is re-derived from the token ids and the mask (the head); the final norm's output, kept
    by the head's product, from the last block's output, and its statistics by the same run (the
    tail): exactly their bytes leave the measured peak (nanoGPT's peak is at the loss), and
    losses, outputs, gradients and buffers (dropout on) are the plain model's."""
    model, batch = _nano()
    names = find_units(model, "auto")
    policies = dict.fromkeys(names, parse("derive"))
    runs = {}
    head, tail = BATCH * TOKENS * WIDTH * 4, BATCH * TOKENS * (WIDTH + 2) * 4  # float32
    for on in (True, False):
        twin = copy.deepcopy(model)
        set_policies(twin, policies)
        runs[on] = measure_steps(twin if on else _unit_only(twin, names), batch)
        derived = [twin.get_submodule(n).__dict__["_memfit_derive"].derived_bytes for n in names]
        block = derived[1]
        assert [d - block for d in derived] == ([head, 0, tail] if on else [0, 0, 0])
    assert runs[False].peak_bytes - runs[True].peak_bytes == head + tail
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    _assert_identical(_run(copy.deepcopy(model), batch, steps=3), _run(twin, batch, steps=3))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_tail_is_predicted_to_the_byte(accumulate):
    """The head's backward re-makes what the tail re-derived and no longer frees it: folded into
    the last unit's backward (a later micro-batch's too), with the loss's lower peak
    (``after_peak_bytes``); the first block's input goes when the model's loop drops it, after
    the block (``freed_after_bytes``): every mix with a head or a tail is predicted to the byte
    (dropout on: the same masks in the profile's steps and the measured ones)."""
    model, batch = _nano()
    step = TrainStep(accumulate=accumulate)
    prof = memfit.profile(model, batch, step=step, repeat=1, granularity="fine")
    names = prof.unit_names
    last = prof.units[-1].options
    levels = [o for o in last if isinstance(o, Derive)]  # on a child too, which takes no tail
    assert levels and all(last[o].after_peak_bytes < 0 for o in levels if not o.child and o.tail)
    assert all(last[o].after_peak_bytes == 0 for o in levels if o.child or not o.tail)
    assert parse("derive:all/no-tail") in levels and all(o.tail for u in prof.units[:-1] for o in u.options
                                                         if isinstance(o, Derive))
    for level in levels:
        mixes = [{names[-1]: level}, {**dict.fromkeys(names[:-1], FULL), names[-1]: level}]
        if level.tail:
            mixes += [dict.fromkeys(names, level), {names[0]: level},
                      {names[0]: level, **dict.fromkeys(names[1:], FULL)}]
        else:  # the last unit's alone: derive:all's twin beside derive:all on the others
            mixes.append({**dict.fromkeys(names, parse("derive:all")), names[-1]: level})
        for policies in mixes:
            twin = copy.deepcopy(model)
            set_policies(twin, {n: policies.get(n, parse("none")) for n in names})
            measured = measure_steps(twin, batch, step=step).peak_bytes
            assert memfit.predict(prof, policies).peak_bytes == measured, (level, policies)


def test_a_tail_closes_where_the_forward_raises_or_the_block_runs_alone():
    """The tail's hooks are open only inside the model's forward: a block called on its own
    closes them as it returns, and a head that raises leaves none open; the next step learns
    and trains as the plain model."""
    model, batch = _nano()
    names = find_units(model, "auto")
    set_policies(model, dict.fromkeys(names, parse("derive")))
    last = model.get_submodule(names[-1])
    last(torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)).sum().backward()
    assert not saved_tensors_hooks_active()

    def broken(*_: object) -> None:
        raise RuntimeError("head")

    head = model.lm_head.forward
    model.lm_head.forward = broken
    with pytest.raises(RuntimeError, match="head"):
        model(**batch)
    assert not saved_tensors_hooks_active()
    model.lm_head.forward = head
    plain, _ = _nano()
    _assert_identical(_run(plain, batch), _run(model, batch))


def test_a_plan_switched_to_at_the_start_of_a_forward_takes_its_tail():
    """A schedule for two lengths switches plans inside the model's forward pre-hooks (the drift
    watch), after PyTorch took the list of hooks to call: the new first unit's head and last
    unit's tail still run in that very forward (its input and the final norm's output
    re-derived), and training matches the plain model."""
    import warnings

    model, batch = _nano()
    short = {k: v[:, : TOKENS // 2].contiguous() for k, v in batch.items()}
    profiles = [memfit.profile(model, b, repeat=1) for b in (short, batch)]
    schedule = memfit.plan(profiles, memfit.predict(profiles[1], {}).peak_bytes)
    names = profiles[0].unit_names
    for k, plan in enumerate(schedule.plans):  # other plans per length, so that each switch makes new hooks
        plan.policies = dict.fromkeys(names, parse("derive" if k else "derive:products"))
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memfit.MemfitWarning)  # the policies were edited after planning
        scheduled = memfit.apply(copy.deepcopy(model), schedule)
    last = scheduled.get_submodule(names[-1])
    for step, b in enumerate([short, batch, short, batch]):
        for m in (plain, scheduled):
            torch.manual_seed(step)
            m.zero_grad(set_to_none=True)
            m(**b).backward()
        tokens = b["idx"].shape[1]
        first, block = (scheduled.get_submodule(n).__dict__["_memfit_derive"].derived_bytes for n in names[:2])
        assert first - block == BATCH * tokens * WIDTH * 4  # the head: the first block's input
        assert last.__dict__["_memfit_derive"].derived_bytes - block == BATCH * tokens * (WIDTH + 2) * 4
        for p, q in zip(plain.parameters(), scheduled.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)


def test_a_head_re_derives_nothing_the_models_own_code_still_holds():
    """Hugging Face's Llama holds ``inputs_embeds`` to the end of its forward: re-deriving the
    first block's input there frees nothing where the block's option is measured, so once learned
    the plan keeps it (the first block sheds what the next sheds), every step predicted to the byte
    or above, and the plain model's losses and gradients."""
    pytest.importorskip("transformers")
    from memfit import hf

    model, batch = hf.llama(batch=2, seq=32, n_layer=3, hidden=64, n_head=4, kv_heads=2, vocab=256)
    names = find_units(model, "auto")
    prof = memfit.profile(model, batch, repeat=1, granularity="fine")
    twin = copy.deepcopy(model)
    policies = dict.fromkeys(names, parse("derive"))
    set_policies(twin, policies)
    run = measure_steps(twin, batch)
    derived = [twin.get_submodule(n).__dict__["_memfit_derive"].derived_bytes for n in names]
    assert derived[0] == derived[1] < derived[2]  # no head; the tail's final norm
    predicted = memfit.predict(prof, policies).peak_bytes
    assert 0 <= predicted - run.peak_bytes <= 0.001 * run.peak_bytes
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    _assert_identical(_run(copy.deepcopy(model), batch), _run(twin, batch))


def test_a_torchvision_style_resnet_with_derive_on_every_block_trains_as_the_plain_model():
    """A model memfit was not shaped around, with its head and tail under derive: torchvision's
    stem (conv, BatchNorm, in-place ReLU, max pool) before the first block, average pool and the
    classifier after the last, in-place residual ReLUs. Nothing there is cheap to re-derive (the
    profile offers no derive option on these blocks), but the hooks around the stem and the head
    learn once, follow their plans, leave none open, and a user's SGD loop gives the plain model's
    losses, gradients and BatchNorm statistics."""
    from .models import resnet18ish
    from .test_real_models import BLOCKS, train_and_compare

    plain, x = resnet18ish()
    names = BLOCKS["resnet18"][1]
    scheduled = copy.deepcopy(plain)
    set_policies(scheduled, dict.fromkeys(names, parse("derive")))
    train_and_compare(copy.deepcopy(plain), scheduled, x)
    assert not saved_tensors_hooks_active()
    for name in (names[0], names[-1]):
        d = scheduled.get_submodule(name).__dict__["_memfit_derive"]
        assert (d.head, d.tail) == (name == names[0], name == names[-1])
        assert len(d.plans) == 1 and not d.misses


def test_the_deepest_level_without_its_tail_keeps_the_last_units_output():
    """``derive:all`` re-makes the last block's output for the final norm through the block's own
    products (the tail); ``derive:all/no-tail`` leaves the step after the block as the plain model
    runs it: exactly the final norm's output and statistics and the block's output are re-derived
    no more, the other blocks are as under ``derive:all``, and losses, gradients and buffers (dropout
    on) are the plain model's."""
    model, batch = _nano()
    names = find_units(model, "auto")
    derived = {}
    for text in ("derive:all", "derive:all/no-tail"):
        twin = copy.deepcopy(model)
        set_policies(twin, dict.fromkeys(names, parse(text)))
        _assert_identical(_run(copy.deepcopy(model), batch, steps=3), _run(twin, batch, steps=3))
        derived[text] = [twin.get_submodule(n).__dict__["_memfit_derive"].derived_bytes for n in names]
    tail, output = BATCH * TOKENS * (WIDTH + 2) * 4, BATCH * TOKENS * WIDTH * 4  # float32
    assert derived["derive:all"][:-1] == derived["derive:all/no-tail"][:-1]
    assert derived["derive:all"][-1] - derived["derive:all/no-tail"][-1] == tail + output
