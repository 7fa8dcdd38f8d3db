"""Shared small models and profiles. Everything runs on the CPU in float32."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from dataclasses import dataclass

# Before torch loads: oneDNN's AVX-512/AMX kernels (Sapphire Rapids CPUs) allocate reordered weight
# copies and scratch that its AVX2 kernels do not: measured there, the CNN's all-checkpointed step
# 6% above the shape estimate (1.65 -> 1.76 MB) and amp-fp16 4.4% above the profile's own prediction.
# The tests' expected figures are the AVX2 kernels'; subprocesses inherit the cap. (A profile
# measured on such a CPU predicts its own steps; estimates are for GPUs.)
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.formats.profile import Profile
from memfit.planning.synthetic import random_profile  # noqa: F401  (tests import it from here)
from memfit.zoo import gpt

TINY = """  # a scenario file for command-line tests
description = "tiny GPT for tests"
model = "memfit.zoo:gpt"
[args]
batch = 2
seq = 32
vocab = 256
d_model = 64
n_head = 2
n_layer = 4
"""


@dataclass(slots=True)
class Ran:
    """What a command-line run returned, as subprocess.CompletedProcess names it."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, cwd: str | os.PathLike) -> Ran:
    """memfit's command line as ``python -m memfit.cli`` runs it from ``cwd``, in this process (a
    process of its own costs 2-4 s of imports): the working directory first on ``sys.path``, and
    the modules imported from it, the SIGINT handler and the unraisable hook put back after."""
    from memfit.cli import main

    out, err = io.StringIO(), io.StringIO()
    here, path, modules = os.getcwd(), list(sys.path), set(sys.modules)
    sigint, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
        sys.path[:] = path
        for name in set(sys.modules) - modules:  # the user's modules: another test writes its own
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(cwd)):
                del sys.modules[name]
        signal.signal(signal.SIGINT, sigint)
        sys.unraisablehook = hook
    return Ran(code, out.getvalue(), err.getvalue())


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


@pytest.fixture(scope="session", autouse=True)
def _kept_ranks():
    """Gloo ranks started once per world size for the whole suite (memfit.steps.parallel.kept_ranks):
    some 35 calls would each start 2 processes that import torch (and transformers) again."""
    from memfit.steps.parallel import kept_ranks

    with kept_ranks():
        yield


@pytest.fixture(scope="session")
def gpt_profile() -> Profile:
    model, batch = tiny_gpt()
    return memfit.profile(model, batch, repeat=1)


def pairwise(*factors: tuple) -> list:
    """Every combination of ``factors`` as pytest params, those outside a pairwise covering set
    marked ``slow``: the default run still sees every pair of settings together (where bugs of
    settings meet), the full product runs with ``-m slow`` (.ci/slow). The set is chosen greedily
    in product order, so it is the same in every run."""
    import itertools

    combos = list(itertools.product(*factors))
    pairs = lambda c: {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}  # noqa: E731
    uncovered = set().union(*map(pairs, combos))
    chosen: set[tuple] = set()
    while uncovered:
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))  # the first of the best
        chosen.add(best)
        uncovered -= pairs(best)
    return [pytest.param(*c, marks=() if c in chosen else pytest.mark.slow) for c in combos]


def plain_state(model: nn.Module) -> list[tuple]:
    """What memfit must leave as it found it on every module: its class, its hooks (forward,
    pre-forward, backward, state-dict) and no memfit region or derive; compare before and after."""
    from memfit.runtime.apply import is_checkpointed

    return [(name, type(m), len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(m._backward_pre_hooks), is_checkpointed(m)) for name, m in model.named_modules()]
