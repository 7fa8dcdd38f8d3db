"""A checkpointed model computes exactly what the plain one does: loss, outputs, gradients, buffers."""

import copy

import pytest
import torch

import memfit
from memfit.formats.schedule import Schedule, model_fingerprint
from memfit.policy import FULL, KEEP, parse
from memfit.runtime.apply import clear_policies, is_checkpointed, set_policies
from memfit.units import find_units
from memfit.zoo import cnn

from .conftest import kw_net, tiny_gpt


def _schedule(model, policies):
    return Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0,
                    model_fingerprint(model, list(policies)))


def _run(model, inputs, steps=2, seed=123):
    """Two SGD steps from a fixed seed: per-step losses and outputs, final grads and buffers."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    losses, outputs = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = memfit.default_loss(out)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        first = out["logits"] if isinstance(out, dict) else out
        outputs.append(first.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return losses, outputs, grads, params, buffers


def _assert_identical(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(x, y)
    for d1, d2 in zip(a[2:], b[2:], strict=True):
        assert d1.keys() == d2.keys()
        for k in d1:
            assert torch.equal(d1[k], d2[k]), k


def _small_cnn():
    return cnn(batch=4, image=16, widths=[8, 8, 16, 16])


PATTERNS = {
    "none": ["none"] * 4,
    "full": ["full"] * 4,
    "mixed": ["none", "full", "none", "full"],
    "segments": ["segment:{0}..{2}"] * 3 + ["full"],
    "segment-mixed": ["none", "segment:{1}..{3}", "segment:{1}..{3}", "segment:{1}..{3}"],
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("factory", [tiny_gpt, kw_net, _small_cnn], ids=["gpt-dropout", "kwargs-tuple", "cnn-bn"])
def test_gradients_equal_plain(factory, pattern):
    model, inputs = factory()
    names = find_units(model, "auto")[:4]
    if pattern.startswith("segment") and factory is kw_net:
        pytest.skip("segments need a chain of single-tensor units; KwNet's blocks return tuples")
    twin = copy.deepcopy(model)
    policies = {n: parse(p.format(*names)) for n, p in zip(names, PATTERNS[pattern], strict=True)}
    memfit.apply(twin, _schedule(model, policies))
    assert [is_checkpointed(twin.get_submodule(n)) for n in names] == [p != KEEP for p in policies.values()]
    _assert_identical(_run(model, inputs), _run(twin, inputs))


def test_bad_segment_policies():
    model, _ = tiny_gpt()
    for policies in (
        {"h.0": parse("segment:h.0..h.2"), "h.1": parse("segment:h.0..h.2"), "h.2": KEEP},
        {"h.0": parse("segment:h.1..h.2"), "h.1": parse("segment:h.1..h.2"), "h.2": parse("segment:h.1..h.2")},
        {"h.0": parse("selective:sometimes")},  # no such op set
        {"h.0": parse("derive@nowhere")},  # no such child
    ):
        with pytest.raises(memfit.MemfitError):
            set_policies(model, policies)
        assert not any(is_checkpointed(m) for m in model.modules())


def test_checkpointing_really_saves_memory_and_recomputes():
    """Guards against an apply() that silently does nothing: fewer saved bytes, more forward calls."""
    model, inputs = tiny_gpt()
    names = find_units(model, "auto")
    calls = []
    model.get_submodule(names[0]).attn.register_forward_hook(lambda *a: calls.append(1))

    def saved_bytes():
        total = 0

        def pack(t):
            nonlocal total
            total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = memfit.default_loss(model(**inputs))
        return loss, total

    loss, plain = saved_bytes()
    loss.backward()
    assert len(calls) == 1
    set_policies(model, dict.fromkeys(names, FULL))
    calls.clear()
    loss, ckpt = saved_bytes()
    loss.backward()
    assert len(calls) == 2  # the forward ran again inside backward
    assert ckpt < plain / 2


def test_names_and_state_dict_unchanged():
    model, _ = tiny_gpt()
    names = find_units(model, "auto")
    before = [n for n, _ in model.named_parameters()], list(model.state_dict())
    set_policies(model, dict.fromkeys(names, FULL))
    assert ([n for n, _ in model.named_parameters()], list(model.state_dict())) == before
    assert isinstance(model.get_submodule(names[0]), type(tiny_gpt()[0].h[0]))
    clear_policies(model)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_refuses_to_wrap_twice():
    model, _ = tiny_gpt()
    names = find_units(model, "auto")
    sched = _schedule(model, dict.fromkeys(names, FULL))
    memfit.apply(model, sched)
    with pytest.raises(memfit.MemfitError, match="already applied"):
        memfit.apply(model, sched)
    with pytest.raises(memfit.MemfitError, match="already checkpointed"):
        set_policies(model, sched.policies)


def test_refuses_schedule_of_another_model():
    model, _ = tiny_gpt()
    other, _ = kw_net()
    sched = _schedule(other, dict.fromkeys(find_units(other, "auto"), FULL))
    with pytest.raises(memfit.ScheduleMismatchError, match="another model"):
        memfit.apply(model, sched)
    bigger, _ = memfit.zoo.gpt(batch=1, seq=32, vocab=256, d_model=64, n_head=2, n_layer=5)
    sched = _schedule(bigger, dict.fromkeys(find_units(bigger, "auto"), FULL))
    with pytest.raises(memfit.ScheduleMismatchError, match=r"no unit named 'h.4' \(1 of the schedule's 5 units"):
        memfit.apply(model, sched)
    sched = _schedule(bigger, dict.fromkeys(find_units(bigger, "auto")[:4], FULL))
    five_of_four = r"another model \(268,480 parameters in the schedule, 218,496 in the model\)"  # no dtype talk
    with pytest.raises(memfit.ScheduleMismatchError, match=five_of_four):
        memfit.apply(model, sched)
    sched = _schedule(model, dict.fromkeys(find_units(model, "auto"), FULL))
    with pytest.raises(memfit.ScheduleMismatchError, match="parameter dtypes float32 in the schedule, bfloat16 in"):
        memfit.apply(tiny_gpt()[0].to(torch.bfloat16), sched)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_refuses_unknown_unit():
    model, _ = tiny_gpt()
    sched = _schedule(model, {"h.0": FULL, "h.9": FULL})
    sched.fingerprint = model_fingerprint(model, ["h.0", "h.9"])
    with pytest.raises(memfit.ScheduleMismatchError, match=r"h\.9"):
        memfit.apply(model, sched)
    assert not is_checkpointed(model.h[0])


@pytest.mark.parametrize(
    "policies",
    [{}, {"h.0": FULL, "h.2": FULL},
     {**dict.fromkeys(["h.0", "h.1", "h.2"], parse("segment:h.0..h.2")), "h.3": FULL}],
    ids=["none", "full", "segment"],
)
def test_units_hooks_see_what_they_see_on_the_plain_model(policies):
    """Every unit, segment members included, is entered once per forward through its own
    __call__ with its real input and output; gradients stay equal."""

    def record(model):
        seen = []
        for name in find_units(model, "auto"):
            unit = model.get_submodule(name)
            unit.register_forward_pre_hook(lambda m, a, n=name: seen.append(("pre", n, a[0].detach().clone())))
            unit.register_forward_hook(lambda m, a, o, n=name: seen.append(("post", n, o.detach().clone())))
        return seen

    plain, batch = tiny_gpt()
    model, _ = tiny_gpt()
    names = find_units(model, "auto")
    expected, got = record(plain), record(model)
    set_policies(model, {n: policies.get(n, KEEP) for n in names})
    torch.manual_seed(1)
    loss_plain = memfit.default_loss(plain(**batch))
    torch.manual_seed(1)
    loss = memfit.default_loss(model(**batch))
    assert [(k, n) for k, n, _ in got] == [(k, n) for k, n, _ in expected]  # once each, in order
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(got, expected, strict=True))
    loss_plain.backward()
    loss.backward()
    assert torch.equal(loss, loss_plain)
    grads = dict(plain.named_parameters())
    assert all(torch.equal(p.grad, grads[n].grad) for n, p in model.named_parameters())
    clear_policies(model)


def test_a_forward_that_fails_inside_a_segment_can_be_retried():
    """Out of memory inside an open region: the retry closes it and computes the plain gradients."""
    plain, batch = tiny_gpt()
    model, _ = tiny_gpt()
    seg = parse("segment:h.0..h.2")
    set_policies(model, {"h.0": seg, "h.1": seg, "h.2": seg, "h.3": FULL})
    fail = {"once": True}

    def out_of_memory(module, args):
        if fail.pop("once", False):
            raise torch.OutOfMemoryError("injected")

    handle = model.h[1].register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model(**batch)
    torch.manual_seed(3)
    memfit.default_loss(model(**batch)).backward()
    torch.manual_seed(3)
    memfit.default_loss(plain(**batch)).backward()
    grads = dict(plain.named_parameters())
    assert all(torch.equal(p.grad, grads[n].grad) for n, p in model.named_parameters())
    handle.remove()
    clear_policies(model)
