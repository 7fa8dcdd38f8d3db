"""runtime/regions.py on its own: a Region checkpoints its modules in place (recomputed once in the
backward, gradients and BatchNorm statistics as without it), a segment keeps only its first
member's input, and removing a region gives the module back as it was."""

import copy

import torch
from torch import nn

from memfit.runtime.regions import Region, guard
from memfit.runtime.threads import recomputing


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.BatchNorm1d(d)
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(recomputing())
        y = self.norm(self.lin(x))
        y += x  # in place on the BatchNorm output, as ResNets do
        return torch.relu(y)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(4)))


def _step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _saved_bytes(model: nn.Module) -> int:
    """Bytes autograd packs in the forward (what the step keeps until its backward)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(8, 16)).sum()
    return total[0]


def test_a_region_recomputes_once_and_trains_as_without_it():
    plain, ckpt = _net(), _net()
    regions = [Region([ckpt[1]]), Region([ckpt[3]])]
    handles = guard(ckpt, regions)
    for a, b in zip(_step(plain)[1], _step(ckpt)[1], strict=True):
        assert torch.equal(a, b)
    assert _step(plain)[0] == _step(ckpt)[0]
    for p, c in zip(plain.modules(), ckpt.modules(), strict=True):  # BatchNorm statistics put back
        if isinstance(p, nn.BatchNorm1d):
            assert torch.equal(p.running_mean, c.running_mean) and p.num_batches_tracked == c.num_batches_tracked
    assert ckpt[1].calls[:2] == [False, True] and ckpt[0].calls[:1] == [False] and len(ckpt[0].calls) == 2
    for h in handles:
        h.remove()


def test_a_segment_keeps_less_than_its_members_alone():
    alone, segment = _net(), _net()
    regions_alone = [Region([alone[1]]), Region([alone[2]])]
    region_seg = Region([segment[1], segment[2]])
    assert _saved_bytes(segment) < _saved_bytes(alone) < _saved_bytes(_net())
    for r in [*regions_alone, region_seg]:
        r.remove()


def test_removing_a_region_gives_the_module_back():
    model = _net()
    before = model[2].forward
    region = Region([model[2]])
    assert "_memfit_region" in model[2].__dict__
    region.remove()
    assert "_memfit_region" not in model[2].__dict__ and model[2].forward == before
    assert not model[2]._forward_hooks and not model[2]._forward_pre_hooks
    twin = copy.deepcopy(model)
    assert torch.equal(_step(model)[0], _step(twin)[0])


def test_a_single_units_region_needs_no_hooks_and_a_raising_forward_leaves_nothing_open():
    """One unit's region is opened and closed by memfit's forward of it: no hooks on the unit
    (nn.Module.__call__'s fast path), its own hooks run outside the region, and a forward that
    raises leaves the saved-tensor context, so what the next step saves is saved as usual."""
    from memfit.torch_private import saved_tensors_hooks_active

    model, plain = _net(), _net()
    region, segment = Region([model[1]]), Region([model[2], model[3]])
    assert not model[1]._forward_hooks and not model[1]._forward_pre_hooks
    assert model[2]._forward_hooks and model[3]._forward_pre_hooks  # a segment's members have them
    inside: list[bool] = []
    model[1].register_forward_hook(lambda m, a, out: inside.append(saved_tensors_hooks_active()))
    fail = [True]

    def boom(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if fail[0] and not recomputing():
            raise RuntimeError("boom")

    h = model[1].lin.register_forward_pre_hook(boom)
    try:
        _step(model)
    except RuntimeError:
        pass
    assert not saved_tensors_hooks_active()  # left with the exception
    fail[0] = False
    h.remove()
    segment.close(error=True)  # the step raised before the segment; nothing to close
    for a, b in zip(_step(plain)[1], _step(model)[1], strict=True):
        assert torch.equal(a, b)
    assert inside[-1] is False and model[1].calls[-2:] == [False, True]
    region.remove()
    segment.remove()


class _OwnForwardNorm(nn.BatchNorm1d):
    """A BatchNorm with a forward of its own: memfit cannot hold it still by its attributes, so
    its buffers are copied back after the recomputation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1.0


class _Norms(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(16, 16), norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x))) + x


def test_batch_norm_statistics_after_a_recomputation_are_the_plain_models():
    """Every kind of BatchNorm (momentum, the cumulative average of momentum=None, a subclass with
    its own forward) ends two steps with the plain model's statistics, counter and momentum; the
    layers that run BatchNorm's own forward are held still with no tensor op (no clone, no copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    for make, copies in [(lambda: nn.BatchNorm1d(16), False), (lambda: nn.BatchNorm1d(16, momentum=None), False),
                         (lambda: _OwnForwardNorm(16), True)]:
        torch.manual_seed(0)
        plain = nn.Sequential(*(_Norms(make()) for _ in range(2)))
        ckpt = copy.deepcopy(plain)
        regions = [Region([m]) for m in ckpt]
        handles = guard(ckpt, regions)
        for _ in range(2):
            torch.manual_seed(1)
            x = torch.randn(8, 16)
            plain(x).sum().backward()
            loss = ckpt(x).sum()
            ops = Ops()
            with ops:
                loss.backward()
            assert any(n.startswith("native_batch_norm") for n in ops.names)  # recomputed in the backward
            assert any(n.startswith(("clone", "copy_")) for n in ops.names) == copies, ops.names
        for p, c in zip(plain.modules(), ckpt.modules(), strict=True):
            if isinstance(p, nn.BatchNorm1d):
                assert torch.equal(p.running_mean, c.running_mean) and torch.equal(p.running_var, c.running_var)
                assert p.num_batches_tracked == c.num_batches_tracked == 2 and p.momentum == c.momentum
                assert "num_batches_tracked" in c._buffers
        for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
        for h in handles:
            h.remove()


class _InPlaceBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu_())  # the op between the two members changes a's output in place


def test_a_segment_whose_member_output_is_changed_in_place_between_members_trains_as_without_it():
    """The segment's replay feeds b the output of a; an in-place op between them would be left out
    (b's saved input, so its weight's gradient, would differ): the region closes after a instead and
    b opens one of its own, keeping b's input."""
    torch.manual_seed(0)
    plain = _InPlaceBetween()
    seg = copy.deepcopy(plain)
    region = Region([seg.a, seg.b])
    x = torch.randn(8, 16) - 0.5
    plain(x).square().sum().backward()
    seg(x).square().sum().backward()
    for p, q in zip(plain.parameters(), seg.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    region.remove()


def test_a_recomputation_calls_the_unit_through_its_hooks_when_it_has_any():
    """As ``torch.utils.checkpoint`` around the module would: the unit's own hooks and nn.Module's
    global ones see the recomputation's call too; with none, the forward is called straight away
    (nn.Module.__call__'s fast path) and still runs once more."""
    model = _net()
    region = Region([model[1]])
    x = torch.randn(8, 16)
    seen: list[tuple[str, bool]] = []
    # pre-hooks: the recomputation stops once the last saved tensor is back, before a forward hook
    own = model[1].register_forward_pre_hook(lambda m, a: seen.append(("own", recomputing())))
    model(x).sum().backward()
    assert seen == [("own", False), ("own", True)]
    own.remove()
    seen.clear()
    every = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: seen.append(("global", recomputing())) if m is model[1] else None)
    model(x).sum().backward()
    every.remove()
    assert seen == [("global", False), ("global", True)]
    model[1].calls.clear()
    model(x).sum().backward()
    assert model[1].calls == [False, True]
    region.remove()
