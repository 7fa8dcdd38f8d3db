"""What apply adds belongs to the model instance: copies (deepcopy, AveragedModel, pickle,
torch.save) train with their own weights; threads keep their own regions; a forward that leaves
a segment early or skips a member closes it; substituted weights are recomputed with; a layer
shared by several unit positions is refused."""

import copy
import io
import pickle
import threading

import pytest
import torch

import memfit
from memfit.formats.schedule import Schedule, model_fingerprint
from memfit.policy import FULL, Children, Segment, as_policies
from memfit.runtime.apply import is_checkpointed

from .conftest import tiny_gpt
from .models import LayerDropNet

SEG = Segment("h.0", "h.2")
POLICIES = {"h.0": SEG, "h.1": SEG, "h.2": SEG, "h.3": FULL}
FINE = as_policies({"h.0": "child:ln_2>mlp.0", "h.1": "derive", "h.2": "selective:gemm", "h.3": "child:attn+mlp"})


def _schedule(model, policies) -> Schedule:
    return Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0, model_fingerprint(model, list(policies)))


def _grads(model, batch, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = memfit.default_loss(model(**batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def _equal(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _copies():
    return {
        "deepcopy": copy.deepcopy,
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "torch.save": lambda m: _saved(m),
    }


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("policies", [POLICIES, FINE], ids=["segment", "fine"])
@pytest.mark.parametrize("how", list(_copies()))
def test_a_copy_trains_its_own_weights(how, policies):
    """The copy's units run with the copy's weights and send gradients to the copy: the copy
    (weights changed after copying) gives what a plain model with those weights gives, and the
    original's gradients stay untouched; remove works on both."""
    model, batch = tiny_gpt()
    memfit.apply(model, _schedule(model, policies))
    twin = _perturbed(_copies()[how](model))
    assert all(is_checkpointed(twin.get_submodule(n)) == (not isinstance(p, Children)) for n, p in policies.items())
    reference = copy.deepcopy(twin)
    memfit.remove(reference)
    _equal(_grads(twin, batch), _grads(reference, batch))
    assert all(p.grad is None for p in model.parameters())
    plain, _ = tiny_gpt()
    _equal(_grads(model, batch), _grads(plain, batch))  # the original is still its own
    memfit.remove(twin)
    assert not any(is_checkpointed(m) for m in twin.modules())
    assert sum(is_checkpointed(m) for m in model.modules()) == (6 if policies is FINE else 4)  # untouched
    memfit.remove(model)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_averaged_model_and_a_frozen_reference():
    """EMA through torch.optim.swa_utils.AveragedModel, and a frozen reference copy (DPO, PPO):
    training the policy leaves the reference as it was, and the EMA averages the policy."""
    policy, batch = tiny_gpt()
    memfit.apply(policy, _schedule(policy, POLICIES))
    ema = torch.optim.swa_utils.AveragedModel(policy, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    reference = copy.deepcopy(policy).requires_grad_(False)
    frozen = [p.clone() for p in reference.parameters()]
    plain = copy.deepcopy(policy)
    memfit.remove(plain)
    plain_ema = torch.optim.swa_utils.AveragedModel(plain, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (policy, plain)]
    for step in range(3):
        for model, opt, avg in ((policy, opts[0], ema), (plain, opts[1], plain_ema)):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = model(**batch)
            with torch.no_grad():
                ref = reference(**batch) if model is policy else None
            loss = memfit.default_loss(out) + (0.0 if ref is None else 0.0 * memfit.default_loss(ref))
            loss.backward()
            opt.step()
            avg.update_parameters(model)
    assert all(torch.equal(p, q) for p, q in zip(reference.parameters(), frozen, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), plain.parameters(), strict=True))
    assert all(torch.equal(p, q) for p, q in zip(ema.parameters(), plain_ema.parameters(), strict=True))
    _equal(_grads(ema.module, batch), _grads(plain_ema.module, batch))  # the EMA copy trains as its plain twin


def _layerdrop():
    torch.manual_seed(0)
    model = LayerDropNet()
    names = [f"blocks.{i}" for i in range(6)]
    seg = Segment(names[1], names[4])
    policies = {n: (seg if 1 <= i <= 4 else FULL) for i, n in enumerate(names)}
    return model, torch.randn(4, 16, 8), policies


@pytest.mark.parametrize("how", [{"depth": 3}, {"depth": 1}, {"skip": (2,)}, {"skip": (1, 3)}, {"scale": (2,)},
                                 {"depth": 4, "skip": (2,)}],
                         ids=["exit-inside", "exit-before", "skip-middle", "skip-first", "op-between", "both"])
def test_a_forward_that_leaves_a_segment_early_or_skips_a_member(how):
    """Early exit, LayerDrop and ops between blocks: the region closes after the members that ran
    in order, gradients equal the plain model's, and a plain model's backward in the same
    process (and this model's next, full forward) still works."""
    plain, x, policies = _layerdrop()
    model = copy.deepcopy(plain)
    memfit.apply(model, _schedule(model, policies))
    for kw in (how, {}):
        grads = []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            loss = m(x, **kw).square().mean()
            loss.backward()
            grads.append({n: p.grad for n, p in m.named_parameters()})
        assert grads[0].keys() == grads[1].keys()
        for n, g in grads[0].items():
            h = grads[1][n]
            assert (g is None) == (h is None) and (g is None or torch.equal(g, h)), n
    other, batch = tiny_gpt()
    memfit.default_loss(other(**batch)).backward()  # nothing of the scheduled model captures it
    assert all(p.grad is not None for p in other.parameters())


def test_an_early_exit_then_the_model_deleted_leaves_later_backwards_alone():
    _, x, policies = _layerdrop()
    model = LayerDropNet()
    memfit.apply(model, _schedule(model, policies))
    model(x, depth=3).sum().backward()
    del model
    other, batch = tiny_gpt()
    memfit.default_loss(other(**batch)).backward()
    assert all(p.grad is not None for p in other.parameters())


def _no_dropout_gpt(seed):
    return memfit.zoo.gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=4, seed=seed, dropout=0.0)


def test_two_threads_each_train_their_own_scheduled_model():
    """20 trials of two threads, each training its own scheduled model three steps: every
    thread's gradients equal its plain twin's (computed before, in the main thread). Without
    dropout: both threads draw from torch's one global generator, in an order the threads decide."""
    models = []
    for seed in (0, 1):
        model, batch = _no_dropout_gpt(seed)
        plain = copy.deepcopy(model)
        memfit.apply(model, _schedule(model, POLICIES))
        models.append((model, plain, batch))
    expected = [_grads(plain, batch, seed=5) for _, plain, batch in models]
    for _trial in range(20):
        errors: list[BaseException] = []
        got: list = [None, None]
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_train_three, args=(models[i], barrier, got, i, errors)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for i in range(2):
            _equal(got[i], expected[i])


def _train_three(entry, barrier, got, i, errors):
    model, _, batch = entry
    try:
        barrier.wait()
        for _ in range(3):
            got[i] = _grads(model, batch, seed=5)
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_an_eval_forward_in_another_thread_during_a_training_forward():
    """A no_grad forward of the same model in a second thread, while the first thread is inside
    a segment: neither disturbs the other. Without dropout, whose global generator the two
    threads would share (the mode belongs to the shared model, so the evaluation runs in it)."""
    model, batch = _no_dropout_gpt(0)
    plain = copy.deepcopy(model)
    memfit.apply(model, _schedule(model, POLICIES))
    expected = _no_grad_forward(plain, batch)
    outputs = []
    main = threading.get_ident()

    def evaluate(module, args):
        if threading.get_ident() == main and not outputs:
            t = threading.Thread(target=lambda: outputs.append(_no_grad_forward(model, batch)))
            t.start()
            t.join()

    handle = model.h[1].register_forward_pre_hook(evaluate)
    got = _grads(model, batch, seed=2)
    handle.remove()
    _equal(got, _grads(plain, batch, seed=2))
    assert len(outputs) == 1 and torch.equal(outputs[0], expected)


def _no_grad_forward(model, batch):
    with torch.no_grad():
        return memfit.default_loss(model(**batch))


def test_functional_call_with_fast_weights_recomputes_with_them():
    """MAML-style: the inner step's fast weights go into torch.func.functional_call; the
    checkpointed units are recomputed with them, so the outer gradients equal the plain ones."""
    results = []
    for scheduled in (False, True):
        model, batch = tiny_gpt()
        if scheduled:
            memfit.apply(model, _schedule(model, POLICIES))
        params = dict(model.named_parameters())
        torch.manual_seed(4)
        inner = memfit.default_loss(model(**batch))
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads, strict=True)}
        torch.manual_seed(5)
        outer = memfit.default_loss(torch.func.functional_call(model, fast, (), batch))
        outer.backward()
        results.append((outer.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    _equal(*results)


def test_a_layer_shared_by_several_unit_positions_is_refused():
    model, _ = tiny_gpt()
    layer = model.h[0]
    model.h = torch.nn.ModuleList([layer] * 4)
    names = ["h.0", "h.1", "h.2", "h.3"]  # named_modules() lists the layer once; a schedule may name each place
    with pytest.raises(memfit.MemfitError, match=r"'h.0' and 'h.1' are one module object"):
        memfit.apply(model, _schedule(model, dict.fromkeys(names, FULL)))
    assert not any(is_checkpointed(m) for m in model.modules())
