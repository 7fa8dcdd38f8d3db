"""The examples run as a user runs them, in a new process: each plans with memfit on its first
batch, says what it chose and the measured peak beside the prediction, and trains."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, cache: Path) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=cache.parent, env={**os.environ, "MEMFIT_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_train_py_plans_with_memfit_fit_then_loads_the_cache(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    args = ("--scenario", str(tmp_path / "tiny.toml"), "--budget", "3.9MB")
    first = _run("train.py", *args, "--steps", "2", cache=tmp_path / "c")
    assert "memfit: checkpointing" in first and "profiled in" in first and "step 1: loss" in first
    again = _run("train.py", *args, "--steps", "1", cache=tmp_path / "c")
    assert "from the cache" in again
    script = str(ROOT / "examples" / "train.py")
    proc = subprocess.run([sys.executable, script, *args[:2], "--budget", "1MB"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "MEMFIT_CACHE": "c"})
    assert proc.returncode == 2 and "smallest budget that works" in proc.stderr and "Traceback" not in proc.stderr


def test_the_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = _run("train_hf_trainer.py", "--budget", "6MB", "--steps", "3", cache=tmp_path / "c")
    assert "memfit: checkpointing" in out and "memfit: measured peak" in out and "within the budget" in out
    assert "'memfit/measured_peak_mib'" in out  # in the Trainer's printed logs


def test_the_lightning_example(tmp_path):
    pytest.importorskip("lightning")
    out = _run("train_lightning.py", "--budget", "5MB", "--steps", "3", cache=tmp_path / "c")
    assert "memfit: checkpointing" in out and "memfit: measured peak" in out and "within the budget" in out


MYMODELS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MyNet(nn.Module):
    def __init__(self, width=128, depth=4, patch=8):
        super().__init__()
        self.patches = nn.Conv2d(3, width, patch, stride=patch)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, pixel_values):
        x = self.patches(pixel_values).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def build(batch=8, image=224):
    torch.manual_seed(0)
    return MyNet(), {"pixel_values": torch.randn(batch, 3, image, image)}
'''


def test_your_own_model_in_three_steps_as_the_readme_says(tmp_path):
    """README's "Your own model in three steps", typed as a newcomer types it: a factory module,
    ``memfit plan --model mymodels:build --args ... --budget 60%``, ``memfit.apply(model,
    "schedule.json")`` in the training script, and the sweep's picture."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)

    def memfit_cli(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "memfit.cli", *args], capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    plan = memfit_cli("plan", "--model", "mymodels:build", "--args", "batch=8", "image=128", "--budget", "60%",
                      "--repeat", "1")
    assert "budget 60% of the unplanned peak" in plan.stdout and "wrote schedule.json" in plan.stdout
    train = (
        "import torch, memfit\n"
        "from mymodels import build\n"
        "model, batch = build(batch=8, image=128)\n"
        "model = memfit.apply(model, 'schedule.json')\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "for _ in range(2):\n"
        "    opt.zero_grad(); model(**batch).square().mean().backward(); opt.step()\n"
        "print('checkpointed', len(model.__dict__['_memfit_applied'].schedule.checkpointed))\n")
    proc = subprocess.run([sys.executable, "-c", train], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 1
    pytest.importorskip("matplotlib")
    memfit_cli("sweep", "--model", "mymodels:build", "--args", "batch=4", "image=32", "--points", "4",
               "--repeat", "1", "--plot", "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000
