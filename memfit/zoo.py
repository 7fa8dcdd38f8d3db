"""Small built-in models for the scenarios, the tests and the benchmarks (no downloads)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-LN blocks, tied head."""

    def __init__(
        self, vocab: int = 4096, seq: int = 256, d_model: int = 256, n_head: int = 4, n_layer: int = 6,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # GPT-2's initialisation, so losses start near log(vocab)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if targets is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return out


def gpt(
    batch: int = 8, seq: int = 256, vocab: int = 4096, d_model: int = 256, n_head: int = 4,
    n_layer: int = 6, dropout: float = 0.1, seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The default scenario's model and a batch of random tokens with next-token targets."""
    torch.manual_seed(seed)
    model = GPT(vocab, seq, d_model, n_head, n_layer, dropout)
    return model, _next_tokens(batch, seq, vocab)


def _next_tokens(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """Random tokens and, shifted by one, the next-token targets."""
    idx = torch.randint(0, vocab, (batch, seq + 1))
    return {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}


def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(min(8, channels), channels)


class ResBlock(nn.Module):
    """A post-activation residual block; a strided 1x1 projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, c_out)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


def cnn(
    batch: int = 16, image: int = 64, widths: tuple[int, ...] | list[int] = (32, 32, 64, 64, 128, 128),
    classes: int = 10, norm: str = "batch", seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A ResNet-style CNN whose blocks differ in size (widths grow, resolution shrinks);
    ``norm`` is ``batch`` (BatchNorm) or ``group`` (GroupNorm)."""
    torch.manual_seed(seed)
    blocks, c = [], widths[0]
    for i, w in enumerate(widths):
        blocks.append(ResBlock(c, w, stride=2 if i > 0 and w != c else 1, norm=norm))
        c = w
    model = nn.Sequential()
    stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), _norm(norm, widths[0]), nn.ReLU())
    model.add_module("stem", stem)
    model.add_module("blocks", nn.Sequential(*blocks))
    model.add_module("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)))
    return model, (torch.randn(batch, 3, image, image),)


class WrittenOutAttention(nn.Module):
    """nanoGPT's attention without flash: q.k^T, a causal mask buffer, softmax, dropout, .v,
    each an op of its own whose sequence-squared output autograd keeps."""

    def __init__(self, d_model: int, n_head: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = WrittenOutAttention(d_model, n_head, seq, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = NanoMLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT/minGPT-style decoder (``transformer.h``), laid out as people copy it, with the
    attention written out: a model memfit's options were not built around."""

    def __init__(self, vocab: int, seq: int, d_model: int, n_head: int, n_layer: int, dropout: float) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d_model), wpe=nn.Embedding(seq, d_model), drop=nn.Dropout(dropout),
            h=nn.ModuleList(NanoBlock(d_model, n_head, seq, dropout) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(d_model)))
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in tr.h:
            x = block(x)
        logits = self.lm_head(tr.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt(
    batch: int = 8, seq: int = 256, vocab: int = 4096, d_model: int = 256, n_head: int = 4,
    n_layer: int = 6, dropout: float = 0.0, seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """NanoGPT and a batch of random tokens; it returns the loss itself, as nanoGPT's does."""
    torch.manual_seed(seed)
    model = NanoGPT(vocab, seq, d_model, n_head, n_layer, dropout)
    return model, _next_tokens(batch, seq, vocab)
