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
