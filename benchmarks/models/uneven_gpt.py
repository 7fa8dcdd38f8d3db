"""A decoder memfit was not built around, for the benchmarks only (issue 37's held-out model):
attention written out with ``masked_fill`` and ``F.softmax`` (no SDPA, no ``bmm`` on 3-D views:
4-D ``matmul``), head counts and MLP widths that change from block to block, LayerNorm and
RMSNorm blocks alternating, an erf GELU in some blocks and SiLU-gated MLPs in others, no dropout,
a tied head. Nothing in memfit reads this file; no test or default was tuned on it.

    python benchmarks/vs_compile_budget.py --scenario benchmarks/uneven-gpt.toml --budgets 0.6 0.3 0.1
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).permute(0, 2, 1, 3)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // h)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.out(y.permute(0, 2, 1, 3).reshape(b, t, d))


class GatedMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False), \
            nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, seq: int, rms: bool, gated: bool) -> None:
        super().__init__()
        norm = nn.RMSNorm if rms else nn.LayerNorm
        self.n1, self.n2 = norm(d), norm(d)
        self.attn = Attention(d, heads, seq)
        plain = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.mlp = GatedMLP(d, hidden) if gated else plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class UnevenGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: list[int], widths: list[int]) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h, w * d, seq, rms=i % 2 == 1, gated=i % 3 == 2)
                                    for i, (h, w) in enumerate(zip(heads, widths, strict=True)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(batch: int = 8, seq: int = 128, vocab: int = 2048, d_model: int = 192,
          heads: tuple[int, ...] = (2, 3, 4, 6, 3, 2), widths: tuple[int, ...] = (2, 3, 4, 6, 4, 2),
          seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    model = UnevenGPT(vocab, seq, d_model, list(heads), list(widths))
    for emb in (model.tok, model.pos):
        nn.init.normal_(emb.weight, std=0.02)
    idx = torch.randint(0, vocab, (batch, seq + 1))
    return model, {"idx": idx[:, :-1], "targets": idx[:, 1:]}
