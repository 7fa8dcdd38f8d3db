"""``derive:products`` and deeper re-make dropout's noise from the generator's state taken before
its draw (runtime/derive_rng.Fill), instead of keeping it: what a selective-checkpoint op set
frees by recomputing dropout under its saved RNG state, at the hooks' cost."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit import zoo
from memfit.policy import KEEP, parse
from memfit.runtime.apply import set_policies
from memfit.runtime.derive import Derive
from memfit.runtime.derive_rng import CPU_STATE_BYTES
from memfit.runtime.harness import measure_steps
from memfit.units import find_units

from .test_apply import _assert_identical, _run


def _shed(model: nn.Module, batch: dict[str, torch.Tensor], unit: str, level: int) -> int:
    d = Derive(model.get_submodule(unit), level)
    memfit.default_loss(model(**batch)).backward()
    d.remove()
    return d.derived_bytes


@pytest.mark.parametrize("attention", ["written-out", "sdpa"])
def test_dropout_noise_is_made_again_bit_for_bit(monkeypatch, attention):
    """nanoGPT (nn.Dropout modules after softmax and after both residual branches) and memfit's GPT
    (SDPA's math path, which calls dropout itself): every noise is shed at ``derive:products``, the
    fine profile predicts the step to the byte, later steps run no watch, and three SGD steps give
    the plain copy's losses, outputs, gradients, weights, buffers and generator state."""
    from memfit.runtime import derive_watch

    b, t, d, h = 2, 32, 32, 4
    if attention == "sdpa":
        model, batch = zoo.gpt(batch=b, seq=t, vocab=64, d_model=d, n_head=h, n_layer=3, dropout=0.1)
    else:
        model, batch = zoo.nanogpt(batch=b, seq=t, vocab=64, d_model=d, n_head=h, n_layer=3, dropout=0.1)
    names = find_units(model, "auto")
    noises = 4 * (b * h * t * t + 2 * b * t * d)  # float32: the probabilities' and both residuals'
    probabilities = 4 * b * h * t * t  # the softmax output, the level's own
    assert _shed(model, batch, names[1], 1) - _shed(model, batch, names[1], 0) == noises + probabilities

    prof = memfit.profile(model, batch, units=names, repeat=1, granularity="fine")
    policies = dict.fromkeys(names, parse("derive:products"))
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    first = measure_steps(twin, batch)
    assert first.peak_bytes == memfit.predict(prof, policies).peak_bytes
    plain = measure_steps(copy.deepcopy(model), batch)
    assert first.peak_bytes < plain.peak_bytes
    assert first.losses == plain.losses and all(torch.equal(g, plain.grads[n]) for n, g in first.grads.items())

    def watched(*_: object, **__: object) -> None:
        raise AssertionError("the watch ran after the plan was learned")

    monkeypatch.setattr(derive_watch.OpWatch, "__torch_dispatch__", watched)
    assert measure_steps(twin, batch).peak_bytes == first.peak_bytes
    monkeypatch.undo()

    expected = _run(copy.deepcopy(model), batch, steps=3)
    after = torch.get_rng_state()
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    _assert_identical(expected, _run(twin, batch, steps=3))
    assert torch.equal(torch.get_rng_state(), after)  # the backward's re-draws moved no one's generator


class _FusedDropout(nn.Module):
    """A GPU's dropout, one ``native_dropout`` whose boolean mask its backward keeps, here on the
    CPU, taking a view at an odd offset (the fused kernel's vector width follows the pointer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width + 1)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)[..., 1:]
        dropped, _ = torch.native_dropout(h, 0.25, True)
        return x + self.down(dropped)


class _DrawBetween(nn.Module):
    """A seeded op between the last packed tensor and dropout's draw: the state a pack hook could
    take is not the one the draw starts from, so the noise is kept."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        jitter = torch.rand_like(h)
        return x + F.dropout(h, 0.25) * (1 + 0 * jitter)


class _Stack(nn.Module):
    def __init__(self, block: type[nn.Module], width: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x).square().mean()


@pytest.mark.parametrize(("block", "shed"), [(_FusedDropout, 8 * 32 * 32), (_DrawBetween, 0)])
def test_fused_dropouts_mask_is_made_again_and_a_draw_in_between_keeps_the_noise(block, shed):
    torch.manual_seed(0)
    model = _Stack(block)
    batch = {"x": torch.randn(8, 32, 16)}
    names = [f"blocks.{i}" for i in range(3)]
    assert _shed(model, batch, names[0], 1) - _shed(model, batch, names[0], 0) == shed  # the mask: one byte each
    small = {"x": batch["x"][:1]}  # a mask no larger than the CPU generator's state is kept
    assert _shed(model, small, names[0], 1) == _shed(model, small, names[0], 0)
    policies = dict.fromkeys(names, parse("derive:products"))
    twin = copy.deepcopy(model)
    set_policies(twin, policies)
    _assert_identical(_run(copy.deepcopy(model), batch, steps=3), _run(twin, batch, steps=3))
    prof = memfit.profile(model, batch, units=names, repeat=1, granularity="fine")
    if shed:
        none, deep = prof.units[0].options[KEEP], prof.units[0].options[parse("derive:products")]
        assert none.stored_bytes - deep.stored_bytes == shed - CPU_STATE_BYTES  # the state it takes instead
        twin = copy.deepcopy(model)
        set_policies(twin, policies)
        assert measure_steps(twin, batch).peak_bytes == memfit.predict(prof, policies).peak_bytes


def test_derive_products_on_attention_keeps_what_the_weights_op_set_keeps():
    """Why the profiler no longer offers ``selective:weights@attn`` where it offers
    ``derive:products@attn``: with dropout's draws re-made, the derive level keeps the same bytes
    (within one CPU generator state: it takes one per draw, the op set's region one) at the hooks'
    cost, and gives the plain model's results."""
    model, batch = zoo.nanogpt(batch=2, seq=64, vocab=64, d_model=32, n_head=4, n_layer=2, dropout=0.1)
    plain = measure_steps(copy.deepcopy(model), batch)
    peaks = {}
    for option in ("derive:products@attn", "selective:weights@attn"):
        twin = copy.deepcopy(model)
        set_policies(twin, {"transformer.h.0": parse(option)})
        run = measure_steps(twin, batch)
        assert run.losses == plain.losses and all(torch.equal(g, plain.grads[n]) for n, g in run.grads.items())
        peaks[option] = run.peak_bytes
    assert plain.peak_bytes - peaks["derive:products@attn"] > 4 * 2 * 4 * 64 * 64  # at least the probabilities
    assert peaks["derive:products@attn"] <= peaks["selective:weights@attn"] + CPU_STATE_BYTES


class _SometimesJitters(nn.Module):
    """A forward that draws between its product's saved tensors and its dropout only when asked
    (a random augmentation some steps take): nothing autograd packs shows it, so the learned plan
    is followed, and the state its hook took is not the one the dropout drew from."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.jitter = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.jitter:
            h = h + 0 * torch.rand_like(h)
        return x + F.dropout(h, 0.25)


def test_a_draw_the_plan_did_not_see_stops_the_backward_instead_of_a_wrong_mask():
    torch.manual_seed(0)
    model = _Stack(_SometimesJitters)
    batch = {"x": torch.randn(8, 32, 16)}
    set_policies(model, {f"blocks.{i}": parse("derive:products") for i in range(3)})
    model(**batch).backward()  # learns: no draw between the product and the dropout
    model(**batch).backward()  # follows the plan, the masks made again and checked
    for blk in model.blocks:
        blk.jitter = True
    with pytest.raises(memfit.MemfitError, match="drew from the random generator"):
        model(**batch).backward()


def _amp_loop(model: nn.Module, batch: dict[str, torch.Tensor], accumulate: int) -> list[list[torch.Tensor]]:
    """Three AdamW steps under CPU bf16 autocast, each over ``accumulate`` micro-batches, as a
    training script writes them: the losses, the last gradients and the weights."""
    torch.manual_seed(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    rows = next(iter(batch.values())).shape[0] // accumulate
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        for k in range(accumulate):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(**{n: v[k * rows:(k + 1) * rows] for n, v in batch.items()})
            loss = out["loss"] if isinstance(out, dict) else out
            (loss / accumulate).backward()
            losses.append(loss.detach())
        opt.step()
    return [losses, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()]]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("build", [zoo.nanogpt, zoo.gpt], ids=["written-out", "sdpa"])
def test_re_made_draws_under_bf16_autocast_and_accumulation_give_the_plain_results(build, accumulate):
    """The noises in bfloat16 (autocast's dtype for the products they follow), one plan per
    micro-batch's signature: the same losses, gradients and weights as a plain copy, bit for bit."""
    model, batch = build(batch=8, seq=64, vocab=128, d_model=64, n_head=4, n_layer=3, dropout=0.1)
    names = find_units(model, "auto")
    twin = copy.deepcopy(model)
    set_policies(twin, dict.fromkeys(names, parse("derive:products")))
    expected, got = _amp_loop(copy.deepcopy(model), batch, accumulate), _amp_loop(twin, batch, accumulate)
    assert twin.get_submodule(names[1]).__dict__["_memfit_derive"].derived_bytes > 0
    for xs, ys in zip(expected, got, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))
