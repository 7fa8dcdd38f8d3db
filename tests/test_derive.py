"""``derive``: cheap saved tensors re-derived in the backward instead of kept (runtime/derive.py)."""

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.policy import FULL, KEEP, parse
from memfit.runtime.apply import clear_policies, set_policies
from memfit.runtime.derive import Derive
from memfit.runtime.harness import measure_steps
from memfit.units import find_units

from .conftest import tiny_gpt
from .test_apply import _assert_identical, _run


def _block_bytes(batch: int = 4, seq: int = 32, d: int = 64, heads: int = 2) -> int:
    """What a tiny GPT block sheds: both LayerNorm outputs and their statistics (mean and inverse
    deviation, one float a row each, made again by the run that makes the output), the GELU output
    and the attention probabilities after dropout (softmax output times the mask, both kept for
    their own backward)."""
    return 4 * (2 * batch * seq * d + 2 * 2 * batch * seq + batch * seq * 4 * d + batch * heads * seq * seq)


def test_derive_sheds_exactly_the_cheap_saved_tensors():
    model, batch = tiny_gpt()
    prof = memfit.profile(model, batch, repeat=1, granularity="fine")
    for u in prof.units:
        none, derive = u.options[KEEP], u.options[parse("derive")]
        assert none.stored_bytes - derive.stored_bytes == _block_bytes()  # measured over each unit's forward
    # one forward tells the profiler the same, before it measures
    d = Derive(model.h[0])
    model(**batch)["loss"].backward()
    d.remove()
    assert d.derived_bytes == _block_bytes()
    # the whole step under derive: predicted exactly, below the plain step, same results
    policies = dict.fromkeys(prof.unit_names, parse("derive"))
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    measured = measure_steps(twin, batch).peak_bytes
    assert measured == memfit.predict(prof, policies).peak_bytes < memfit.predict(prof, {}).peak_bytes
    clear_policies(twin)
    assert not any("_memfit_derive" in m.__dict__ for m in twin.modules())


def test_derive_keeps_dropout_batchnorm_and_kwargs_results():
    from .test_fidelity import cnn_mixed, hf_gpt2

    for build, units in ((tiny_gpt, "auto"), (hf_gpt2, "auto"), (cnn_mixed, "blocks.*")):
        model, inputs = build()
        names = memfit.units.find_units(model, units)
        twin = copy.deepcopy(model)
        expected = _run(model, inputs)
        set_policies(twin, dict.fromkeys(names, parse("derive")))
        _assert_identical(expected, _run(twin, inputs))


class _ChangesItsInput(nn.Module):
    """``g = h * 3`` is saved by the product and re-derived from ``h``, which the forward then
    changes in place: the recipe would give another ``g``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(x @ self.w)  # sigmoid keeps h for its backward
        out = (h * 3) @ self.w
        h.add_(1)
        return out


def test_an_input_changed_in_place_is_refused_not_used():
    model = _ChangesItsInput()
    d = Derive(model)
    out = model(torch.randn(4, 8))
    assert d.derived_bytes == 4 * 8 * 4
    with pytest.raises(memfit.MemfitError, match="changed in place"):
        out.sum().backward()


def test_derive_steps_aside_inside_another_saved_tensor_context():
    model, batch = tiny_gpt()
    d = Derive(model.h[0])
    with torch.autograd.graph.save_on_cpu():
        model(**batch)["loss"].backward()
    assert d.derived_bytes == 0
    with torch.no_grad():
        model(**batch)
    assert d.derived_bytes == 0 and not d._open


@pytest.mark.parametrize("factory, levels", [(tiny_gpt, ["derive"]),
                                             (lambda: _tiny_nanogpt(), ["derive", "derive:products", "derive:all"])],
                         ids=["gpt-dropout", "nanogpt"])
def test_derive_under_compile_keeps_what_its_level_keeps(factory, levels):
    """Compiled (aot_eager), a unit under ``derive`` runs inside a checkpoint whose selective
    policy has the partitioner recompute what the level re-derives eagerly (op_sets.derive_policy):
    the plain compiled model's losses and gradients bit for bit (dropout's draws are kept, never
    drawn again), and the eager step's peak under the same policies within 4%, lower level by
    level. Before, the option stepped aside and the compiled peak was the plain one. (Not
    ``derive:products`` on the tiny GPT: compiled, its SDPA is one op, whose probabilities the
    partitioner cannot reach; eager, SDPA's math path makes them where the watch sees them.)"""
    model, batch = factory()
    names = find_units(model, "auto")
    torch._dynamo.reset()
    try:
        plain = measure_steps(copy.deepcopy(model), batch, optimizer=None, compile="aot_eager")
        peaks = []
        for level in levels:
            twin = copy.deepcopy(model)
            set_policies(twin, dict.fromkeys(names, parse(level)))
            compiled = measure_steps(twin, batch, optimizer=None, compile="aot_eager")
            eager = measure_steps(twin, batch, optimizer=None)
            assert compiled.losses == plain.losses
            assert all(torch.equal(g, plain.grads[n]) for n, g in compiled.grads.items())
            assert abs(compiled.peak_bytes - eager.peak_bytes) <= 0.04 * eager.peak_bytes, level
            peaks.append(compiled.peak_bytes)
    finally:
        torch._dynamo.reset()
    assert peaks[0] < 0.8 * plain.peak_bytes
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks)


def _tiny_nanogpt() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """nanoGPT with its attention written out (q.k^T, mask, softmax, .v), no dropout."""
    return zoo.nanogpt(batch=2, seq=32, vocab=128, d_model=32, n_head=4, n_layer=3)


def _tiny_vit() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Hugging Face's ViT with its eager attention (matmul, softmax in float32, dropout, matmul)."""
    pytest.importorskip("transformers")
    from memfit import hf

    return hf.vit(batch=2, image=32, patch=8, n_layer=3, hidden=32, n_head=4, classes=10, attention="eager")


def _nanogpt_of_short_sequences() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Heads of 8 at 16 tokens: the scores (T x T) are as large as q and k together (2 x T x d),
    larger than either; the compiler's partitioner recomputes them, and so does ``derive:products``."""
    return zoo.nanogpt(batch=2, seq=16, vocab=128, d_model=32, n_head=4, n_layer=3)


def _nanogpt_of_two_heads() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Two heads: the probabilities are 8% of a block's saved bytes, under the tenth a first
    finer option must shed (profiler/options.MIN_SHARE), over what one beyond ``derive`` must."""
    return zoo.nanogpt(batch=2, seq=48, vocab=128, d_model=64, n_head=2, n_layer=3)


def _nanogpt_of_one_head() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One head: matmul's reshape of q is a view of the fused qkv output, not a copy, and autograd
    hands bmm a shallow copy of the view the dispatcher made (a recipe must find it by storage)."""
    return zoo.nanogpt(batch=2, seq=32, vocab=128, d_model=16, n_head=1, n_layer=3)


def _nanogpt_of_heads_as_long_as_the_sequence() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Heads of 16 at 16 tokens (the launch-bound benchmark's nanoGPT): q.k^T makes no more than it
    takes, and is run again only for the probabilities; P.v, the same size, is not."""
    return zoo.nanogpt(batch=2, seq=16, vocab=128, d_model=32, n_head=2, n_layer=3)


def _nanogpt_of_heads_longer_than_the_sequence() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Heads of 32 at 8 tokens: the scores are smaller than q and k (a batch of 64, for the blocks to
    hold the step's peak)."""
    return zoo.nanogpt(batch=64, seq=8, vocab=128, d_model=64, n_head=2, n_layer=3)


@pytest.mark.parametrize(("build", "tokens", "heads", "profiled"), [
    (_tiny_nanogpt, 32, 4, True), (_tiny_vit, 17, 4, True), (_nanogpt_of_two_heads, 48, 2, True),
    (_nanogpt_of_one_head, 32, 1, True), (_nanogpt_of_short_sequences, 16, 4, False),
    (_nanogpt_of_heads_as_long_as_the_sequence, 16, 2, False),
    (_nanogpt_of_heads_longer_than_the_sequence, 8, 2, False)])
def test_derive_products_re_derives_written_out_attention_probabilities(build, tokens, heads, profiled):
    """``derive:products`` also sheds the probabilities (batch x heads x T x T), re-derived from
    the q and k the first product keeps; P.v, which makes less than it takes, is not run again.
    Two models written by different hands: memfit's nanoGPT and Hugging Face's ViT. The shapes
    that only move what is re-derived (short sequences, heads as long as or longer than the
    sequence) skip the fine profile's prediction (``profiled``); their shed bytes are checked."""
    model, batch = build()
    names = find_units(model, "auto")
    assert len(names) == 3

    def loss(out: object) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.loss  # type: ignore[attr-defined]

    shed = {}
    for products in (False, True):
        d = Derive(model.get_submodule(names[0]), products)
        loss(model(**batch)).backward()
        d.remove()
        shed[products] = d.derived_bytes
    rows = next(iter(batch.values())).shape[0]
    assert shed[True] - shed[False] == heads * rows * 4 * tokens * tokens  # the probabilities, float32
    prof = memfit.profile(model, batch, units=names, repeat=1, granularity="fine") if profiled else None
    if prof is not None:
        assert parse("derive:products") in prof.units[0].options
        none, deep = prof.units[0].options[KEEP], prof.units[0].options[parse("derive:products")]
        assert none.stored_bytes - deep.stored_bytes == shed[True]
    plain = measure_steps(copy.deepcopy(model), batch)
    for policies in (dict.fromkeys(names, parse("derive:products")),
                     {names[0]: parse("derive:products"), names[1]: FULL, names[2]: parse("derive")}):
        twin = copy.deepcopy(model)
        set_policies(twin, policies)
        run = measure_steps(twin, batch)
        assert run.peak_bytes < plain.peak_bytes
        assert prof is None or run.peak_bytes == memfit.predict(prof, policies).peak_bytes
        assert all(torch.equal(g, plain.grads[n]) for n, g in run.grads.items())  # bit for bit
        assert run.losses == plain.losses
    # and in a loop written here as a user writes it (SGD with momentum, two steps): the same
    # losses, outputs, gradients and buffers as a plain copy trained alike
    twin = copy.deepcopy(model)
    set_policies(twin, dict.fromkeys(names, parse("derive:products")))
    _assert_identical(_run(copy.deepcopy(model), batch), _run(twin, batch))


def test_derive_products_recomputes_one_product_per_block():
    """The backward runs q.k^T once more per block (the probabilities are made once, for both
    the softmax's backward and the product with V), and nothing else that multiplies matrices."""
    from torch.utils.flop_counter import FlopCounterMode

    for build, heads, tokens, head in ((_tiny_nanogpt, 4, 32, 8),
                                       (_nanogpt_of_heads_as_long_as_the_sequence, 2, 16, 16),
                                       (_nanogpt_of_heads_longer_than_the_sequence, 2, 8, 32)):
        model, batch = build()
        flops = {}
        for policy in ("none", "derive:products"):
            twin = copy.deepcopy(model)
            set_policies(twin, {f"transformer.h.{i}": parse(policy) for i in range(3)})
            counter = FlopCounterMode(display=False)
            with counter:
                twin(**batch).backward()
            flops[policy] = counter.get_total_flops()
        qk = 2 * (batch["idx"].shape[0] * heads) * tokens * tokens * head  # batch x heads, T x T scores, head dim
        assert flops["derive:products"] - flops["none"] == 3 * qk


@pytest.mark.parametrize(("build", "tokens", "width", "projections", "rest", "tail"), [
    (_tiny_vit, 17, 32, 4, 4, 4), (_tiny_nanogpt, 32, 32, 1, 7, 4)])
def test_derive_projections_and_all_re_derive_products_with_weights(build, tokens, width, projections, rest, tail):
    """``derive:projections`` also runs products with a weight that make no more than they take:
    in Hugging Face's ViT q, k and v (their per-head copies for the products) and the output
    projection (for the residual the second norm saves), from the first norm's output that
    ``derive`` re-derives from the block's input; what the compiler's partitioner recomputes at
    budget 0.3. nanoGPT's fused qkv makes three times what it takes and its MLP four times, so only
    the output projection is run again there. ``derive:all`` runs every product with a weight: the
    MLP's up-projection (its output, four widths), and in nanoGPT the fused qkv too, once for its
    three per-head copies (their bytes, three widths; its product, three). Exactly those bytes and
    those products, predicted = measured, and the plain model's losses, gradients and buffers in a
    user's loop. The last block's tail (runtime/derive.py) re-derives the final norm's saved input,
    the block's output, from its MLP's down-projection (four widths in: ``tail`` products) under
    ``derive:all`` only: ``derive:projections`` runs no product whose sum is wider than the block."""

    model, batch = build()
    names = find_units(model, "auto")
    shed, flops = _shed_and_flops(model, batch, names, ("derive:products", "derive:projections", "derive:all"))
    one = 2 * tokens * width * 4  # batch x tokens x width, float32
    assert shed["derive:projections"] - shed["derive:products"] == projections * one
    product = 2 * (2 * tokens) * width * width  # batch x tokens rows, width x width weight
    assert flops["derive:projections"] - flops["derive:products"] == len(names) * projections * product
    assert shed["derive:all"] - shed["derive:projections"] == rest * one
    assert flops["derive:all"] - flops["derive:projections"] == (len(names) * rest + tail) * product
    prof = memfit.profile(model, batch, units=names, repeat=1, granularity="fine")
    assert {parse("derive:projections"), parse("derive:all")} <= set(prof.units[0].options)
    policies = {names[0]: parse("derive:projections"), names[1]: parse("derive:all"), names[2]: FULL}
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    plain = measure_steps(copy.deepcopy(model), batch)
    run = measure_steps(twin, batch)
    assert run.peak_bytes == memfit.predict(prof, policies).peak_bytes < plain.peak_bytes
    for option in ("derive:projections", "derive:all"):
        twin = copy.deepcopy(model)
        set_policies(twin, dict.fromkeys(names, parse(option)))
        _assert_identical(_run(copy.deepcopy(model), batch), _run(twin, batch))


def test_derive_projections_re_derives_llamas_rotated_q_and_k():
    """Hugging Face's Llama with its defaults (SDPA, grouped KV heads, rotary embeddings): SDPA
    keeps the rotated q and k, made by RoPE's ``x * cos + cat(-x2, x1) * sin`` from the
    projections' outputs; ``derive:projections`` re-derives them through the ``cat`` from the norm
    output (and v, and the residual sum from the output projection), so the four projections run
    again (their FLOPs exactly, grouped k and v too: their sums run over the block's width) and
    their bytes go, with the plain model's losses, gradients and buffers in a user's loop. The MLP's
    down-projection (8/3 widths in) does not run again, not even for the last block's output,
    which the final norm keeps (its tail: under ``derive:all``)."""

    pytest.importorskip("transformers")
    from memfit import hf

    batch_size, tokens, width, heads, kv = 2, 32, 64, 4, 2
    model, batch = hf.llama(batch=batch_size, seq=tokens, n_layer=2, hidden=width, n_head=heads, kv_heads=kv,
                            vocab=256)
    names = find_units(model, "auto")
    shed, flops = _shed_and_flops(model, batch, names, ("derive:products", "derive:projections"))
    # q's width, k's and v's, and the output projection's (the residual sum the second norm keeps)
    rows, widths = batch_size * tokens, width + 2 * kv * width // heads + width
    assert shed["derive:projections"] - shed["derive:products"] == rows * widths * 4  # float32
    assert flops["derive:projections"] - flops["derive:products"] == len(names) * 2 * rows * width * widths
    twin = copy.deepcopy(model)
    set_policies(twin, dict.fromkeys(names, parse("derive:projections")))
    _assert_identical(_run(copy.deepcopy(model), batch), _run(twin, batch))


def _shed_and_flops(model: nn.Module, batch: dict[str, torch.Tensor], names: list[str],
                    options: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """Per derive option: the bytes the first unit sheds in one step, and the FLOPs of a step
    (forward and backward) of a copy with every unit under it."""
    from torch.utils.flop_counter import FlopCounterMode

    def loss(out: object) -> torch.Tensor:
        return out if isinstance(out, torch.Tensor) else out.loss  # type: ignore[attr-defined]

    shed, flops = {}, {}
    for option in options:
        policy = parse(option)
        d = Derive(model.get_submodule(names[0]), policy.level)
        loss(model(**batch)).backward()
        d.remove()
        shed[option] = d.derived_bytes
        twin = copy.deepcopy(model)
        set_policies(twin, dict.fromkeys(names, policy))
        counter = FlopCounterMode(display=False)
        with counter:
            loss(twin(**batch)).backward()
        flops[option] = counter.get_total_flops()
    return shed, flops


def test_derive_products_through_sdpa_math_path_with_dropout_gives_the_plain_results():
    """SDPA with dropout on the CPU takes its math path (q.k^T, a causal mask from ones, tril and
    where, safe softmax, a random mask): the probabilities are re-derived, and so are dropout's
    noises (made again from the generator's state before each draw), and loss, gradients and
    buffers equal the plain model's."""
    model, batch = zoo.gpt(batch=2, seq=64, vocab=128, d_model=32, n_head=4, n_layer=2, dropout=0.1)
    shed = {}
    for products in (False, True):
        d = Derive(model.h[0], products)
        model(**batch)["loss"].backward()
        d.remove()
        shed[products] = d.derived_bytes
    probabilities, residual = 4 * 2 * 4 * 64 * 64, 4 * 2 * 64 * 32  # float32
    # the softmax output and the attention's noise, and the noises of both residual dropouts
    assert shed[True] - shed[False] == 2 * probabilities + 2 * residual
    twin = copy.deepcopy(model)
    expected = _run(model, batch)
    set_policies(twin, {"h.0": parse("derive:products"), "h.1": parse("derive:products")})
    _assert_identical(expected, _run(twin, batch))


def test_later_forwards_follow_the_learned_plan_without_a_dispatch_mode(monkeypatch):
    """The first training forward learns; every later one re-derives the same tensors with
    saved-tensor hooks alone (the watch made to raise proves it never runs again), at the same
    measured peak, with the plain model's losses, outputs, gradients and buffers over 3 steps."""
    from memfit.runtime import derive_watch

    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    learned = copy.deepcopy(model)
    set_policies(learned, dict.fromkeys(names, parse("derive")))
    first = measure_steps(copy.deepcopy(learned), batch, optimizer="sgd", steps=1)  # learns in its step
    learned(**batch)["loss"].backward()  # learns here, once per unit
    learned.zero_grad(set_to_none=True)
    units = [learned.get_submodule(n).__dict__["_memfit_derive"] for n in names]
    assert all(len(d.plans) == 1 for d in units)

    def watched(*_: object, **__: object) -> None:
        raise AssertionError("the watch ran after the plan was learned")

    monkeypatch.setattr(derive_watch.OpWatch, "__torch_dispatch__", watched)
    later = measure_steps(learned, batch, optimizer="sgd", steps=1)
    assert later.peak_bytes == first.peak_bytes
    assert all(not d.misses for d in units)
    # the first block's head also re-derives its input (the embeddings' sum times dropout's mask), the
    # last block's tail the final norm's output and statistics (float32)
    head, tail = 4 * 32 * 64 * 4, 4 * 32 * (64 + 2) * 4
    assert [d.derived_bytes - _block_bytes() for d in units] == [head] + [0] * (len(units) - 2) + [tail]
    _assert_identical(_run(copy.deepcopy(model), batch, steps=3), _run(learned, batch, steps=3))


class _Switches(nn.Module):
    """Data-dependent control flow with the same shapes on both paths: the norm before the
    product is one of two, so a plan learned on one path must not re-derive the other's."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.ModuleList([nn.LayerNorm(8), nn.LayerNorm(8)])
        self.fc = nn.Linear(8, 8)
        self.path = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln[self.path](x))  # the norm's output, saved by the product, is re-derived


def test_a_forward_that_differs_from_its_plan_keeps_what_it_cannot_vouch_for():
    torch.manual_seed(0)
    model = _Switches()
    with torch.no_grad():
        model.ln[1].weight.mul_(2.0)  # the other norm gives other values
    twin = copy.deepcopy(model)
    d = Derive(twin)
    x = torch.randn(4, 8)

    def step(m: nn.Module, path: int) -> dict[str, torch.Tensor]:
        m.path = path
        m.zero_grad(set_to_none=True)
        m(x).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    for path in (0, 0):  # learns, then follows
        assert step(twin, path).keys() == (want := step(model, path)).keys()
        assert all(torch.equal(g, want[n]) for n, g in step(twin, path).items())
    assert d.derived_bytes == 4 * (8 + 2) * 4 and not d.misses  # the norm's output and statistics, from its own weights
    # the other path: its norm's output is not the plan's, so it is kept; the unit learns again
    got, want = step(twin, 1), step(model, 1)
    assert all(torch.equal(g, want[n]) for n, g in got.items())
    assert sum(d.misses.values()) == 1 and not d.plans
    got, want = step(twin, 1), step(model, 1)  # learned on path 1
    assert all(torch.equal(g, want[n]) for n, g in got.items()) and len(d.plans) == 1
    with pytest.warns(memfit.MemfitWarning, match="differs from step to step"):
        got, want = step(twin, 0), step(model, 0)  # a second miss: from now on watched on every forward
    assert all(torch.equal(g, want[n]) for n, g in got.items())
    assert list(d.plans.values()) == [None]
    for path in (0, 1, 0):
        got, want = step(twin, path), step(model, path)
        assert all(torch.equal(g, want[n]) for n, g in got.items())
    assert d.derived_bytes == 4 * (8 + 2) * 4


def test_copies_and_pickles_learn_their_own_plans():
    import pickle

    model, batch = tiny_gpt()
    set_policies(model, {"h.0": parse("derive")})
    model(**batch)["loss"].backward()
    assert model.h[0].__dict__["_memfit_derive"].plans
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        d = twin.h[0].__dict__["_memfit_derive"]
        assert not d.plans
        twin(**batch)["loss"].backward()
        assert len(d.plans) == 1 and d.derived_bytes == _block_bytes() + 4 * 32 * 64 * 4  # and its input (the head)


def test_a_recipe_dropped_on_a_miss_lets_go_of_the_input_it_shares():
    """Two recipes take one re-derived input (q's and k's copies of a fused qkv): while one holds
    it, it is made once and held; when the forward misses its plan at the other and keeps that
    tensor, the input is let go once the first has used it, not held to the graph's end."""
    from memfit.runtime.derive_plan import Bind, Derived, Leaf, SubRef, Template, _flatten

    aten = torch.ops.aten
    x = torch.randn(4, 6)
    whole = ((4, 6), (6, 1), 0)
    shared = Template(aten.mul.Tensor, _flatten((x, x), {})[1], [Leaf(False, 0, None)] * 2, whole, 0)
    users = [Template(aten.neg.default, _flatten((x,), {})[1], [SubRef(shared, whole)], whole, 1) for _ in range(2)]
    bind = Bind([])
    bind.slots[0] = x
    kept, missed = (bind.recipe(t) for t in users)
    assert kept is not None and missed is not None
    kept.hold()  # a saved view of the first holds it (runtime/derive_forward.py's Replay.pack)
    held = Derived(kept, whole)
    inner = bind.recipes[id(shared)]
    assert inner.pending == 2
    bind.release(users[1])  # the forward kept the second's tensor after all
    assert inner.pending == 1 and id(users[1]) not in bind.recipes
    bind.release(users[0])  # a recipe a saved view holds is not dropped
    assert bind.recipes[id(users[0])] is kept and inner.pending == 1
    assert torch.equal(held.unpack(), -(x * x))
    assert all(h is None for h in (*inner.held, *kept.held))  # nothing held once the first was unpacked


def test_derive_on_a_child_keeps_no_more_than_the_gemm_op_set_there_at_the_hooks_cost(monkeypatch):
    """``derive@mlp`` re-derives the MLP's GELU output from the product's input it keeps: exactly
    those bytes in every block (a child's derive takes no head or tail), less than
    ``selective:gemm@mlp`` keeps (its region also holds its input and RNG state), predicted to the
    byte by a fine profile, the plain results, and later steps with no dispatch mode at all: neither
    derive's watch nor SAC's."""
    import torch.utils.checkpoint as ckpt

    from memfit.runtime import derive_watch

    model, batch = tiny_gpt()
    names = find_units(model, "auto")
    gelu = 4 * 32 * 4 * 64 * 4  # batch x seq x 4d floats, per block
    child = parse("derive@mlp")
    twin = copy.deepcopy(model)
    set_policies(twin, dict.fromkeys(names, child))
    twin(**batch)["loss"].backward()  # learns, once per block
    twin.zero_grad(set_to_none=True)
    units = [twin.get_submodule(f"{n}.mlp").__dict__["_memfit_derive"] for n in names]
    assert [d.derived_bytes for d in units] == [gelu] * len(names)
    sac = copy.deepcopy(model)
    set_policies(sac, dict.fromkeys(names, parse("selective:gemm@mlp")))
    plain = measure_steps(copy.deepcopy(model), batch).peak_bytes
    op_set = measure_steps(sac, batch).peak_bytes

    def never(*_: object, **__: object) -> None:
        raise AssertionError("a dispatch mode ran after the plan was learned")

    monkeypatch.setattr(derive_watch.OpWatch, "__torch_dispatch__", never)
    monkeypatch.setattr(ckpt, "create_selective_checkpoint_contexts", never)
    derived = measure_steps(twin, batch).peak_bytes
    assert derived <= op_set < plain
    monkeypatch.undo()
    prof = memfit.profile(model, batch, repeat=1, granularity="fine")
    assert all(child in u.options for u in prof.units)
    assert memfit.predict(prof, dict.fromkeys(names, child)).peak_bytes == derived
    fresh = copy.deepcopy(model)
    set_policies(fresh, dict.fromkeys(names, child))
    _assert_identical(_run(copy.deepcopy(model), batch, steps=3), _run(fresh, batch, steps=3))
