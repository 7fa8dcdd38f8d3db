"""The peers that benchmarks/peers.py sets beside memfit are applied correctly: each gives the
plain model's gradients and frees memory, so the benchmark compares working configurations."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from memfit.measure.step import default_loss, make_optimizer
from memfit.runtime.harness import measure_steps

from .conftest import tiny_gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
peer_tools = pytest.importorskip("peer_tools")
UNITS = [f"h.{k}" for k in range(4)]


def _same(a, b) -> bool:
    return a.losses == b.losses and all(
        torch.equal(x, y) for x, y in zip(a.grads.values(), b.grads.values(), strict=True))


@pytest.mark.parametrize("kind", ["every", "every-other", "attention"])
def test_hand_made_choices_keep_gradients_and_free_memory(kind):
    model, batch = tiny_gpt()
    plain = measure_steps(copy.deepcopy(model), batch)
    twin = copy.deepcopy(model)
    peer_tools.hand_made(kind, twin, UNITS)
    run = measure_steps(twin, batch)
    assert _same(plain, run)
    assert run.peak_bytes < plain.peak_bytes


def test_sac_milp_plans_apply_with_the_plain_gradients():
    pytest.importorskip("pwlf")
    model, batch = tiny_gpt()
    plain = measure_steps(copy.deepcopy(model), batch)
    peer = peer_tools.SacMilp(tiny_gpt, lambda m, inp: default_loss(m(**inp)),
                              lambda m: make_optimizer("adamw", m.parameters()), 0.05)
    assert peer.root == "GPT" and set(peer.stats) >= {f"GPT.{u}" for u in UNITS}
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline

    own_peak, _ = get_peak_memory_runtime_baseline(peer.graph)  # its model of the plain step
    decisions, bound, _ = peer.plan(int(0.8 * own_peak))
    assert 0 < bound <= 0.8 * own_peak and decisions  # it must discard something to fit 80% of it
    twin = copy.deepcopy(model)
    peer.apply(twin, decisions)
    run = measure_steps(twin, batch)
    assert _same(plain, run)
    assert run.peak_bytes < plain.peak_bytes
