"""Shared small models and profiles. Everything runs on the CPU in float32."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.profile import OptionCost, Phase, Profile, UnitProfile
from memfit.zoo import gpt


def tiny_gpt(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT with dropout, 4 blocks, small enough to profile in about a second."""
    return gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=4, seed=seed)


class KwBlock(nn.Module):
    """A block with a keyword argument, a tuple output and dropout."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, mask: torch.Tensor | None = None):
        h = self.drop(self.fc2(F.gelu(self.fc1(self.ln(x)))))
        if mask is not None:
            h = h * mask
        return x + scale * h, h.detach().norm()


class KwNet(nn.Module):
    def __init__(self, d: int = 32, n: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(KwBlock(d) for _ in range(n))
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h, _ = block(h, scale=self.scale, mask=mask)
        return self.out(h)


def kw_net(seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    return KwNet(), {"x": torch.randn(4, 16, 8), "mask": (torch.rand(4, 16, 1) > 0.1).float()}


@pytest.fixture(scope="session")
def gpt_profile() -> Profile:
    model, batch = tiny_gpt()
    return memfit.profile(model, batch, repeat=1)


def random_profile(n: int, seed: int, *, chain: bool = True) -> Profile:
    """A synthetic chain profile with integer bytes, for solver checks against brute force. As in
    a real step, each unit's net change (its gradients) is the same whether it is checkpointed."""
    r = random.Random(seed)
    units, phases = [], [Phase("pre", None, "remainder", r.randint(0, 50), r.randint(0, 50), r.randint(50, 60))]
    for i in range(n):
        a = r.randint(10, 100)
        s = r.randint(1, a)
        grads = r.randint(0, 10)
        units.append(
            UnitProfile(
                f"u{i}", r.uniform(0.001, 0.01), 0.01, s, a, grads,
                {
                    "none": OptionCost(a + r.randint(0, 30), a, r.randint(0, 40), grads - a, 0.0),
                    "full": OptionCost(s + r.randint(0, 30), s, a + r.randint(0, 40), grads - s,
                                       r.randint(1, 1000) * 1e-6),
                },
                output_bytes=r.randint(1, s),
            )
        )
        phases.append(Phase(f"forward u{i}", i, "forward"))
        phases.append(Phase(f"gap{i}", None, "remainder", r.randint(0, 5), 0, 0))
    phases.append(Phase("head", None, "remainder", r.randint(0, 80), r.randint(-10, 10), r.randint(-10, 10)))
    for i in reversed(range(n)):
        phases.append(Phase(f"backward u{i}", i, "backward"))
    phases.append(Phase("step", None, "remainder", r.randint(0, 80), 0, 0))
    phases[0].ckpt_end_bytes = max(phases[0].ckpt_end_bytes, phases[0].end_bytes)
    return Profile("Synthetic", "cpu", "adamw", "", 100, 0, 0, 0, 0, 0, 0.1, units, phases,
                   {"model_class": "Synthetic", "units": [u.name for u in units], "params_sha256": "0"},
                   chain=chain)
