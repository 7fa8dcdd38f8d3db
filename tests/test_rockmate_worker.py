"""benchmarks/peers.py runs Rockmate only under a Python the user points it at
(``--rockmate-python``): Rockmate is no dependency. Under a Python where rockmate does not import,
the worker says so, needing none of memfit's solvers, and peers.py reports it as rows."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TINY

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
peers = pytest.importorskip("peers")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("rockmate") is not None,
                                reason="rockmate imports here: these tests need a Python without it")
LEVELS = [3_000_000, 4_000_000]

# the worker as the user's Python runs it, with memfit's solvers (and pandas) made unimportable
NO_SOLVERS = """import runpy, sys
for name in ("ortools", "pulp", "pandas"):
    sys.modules[name] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
MISSING = (f"rockmate does not import under {sys.executable} (Python {sys.version.split()[0]}): "
           "ModuleNotFoundError: No module named 'rockmate'")


def test_worker_needs_no_solver_and_reports_a_missing_rockmate(tmp_path):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    out = tmp_path / "rockmate.json"
    done = subprocess.run(
        [sys.executable, "-c", NO_SOLVERS, str(BENCH / "rockmate_worker.py"), "--scenario", str(scenario),
         "--levels", *map(str, LEVELS), "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # past memfit's imports without a solver, stopped at rockmate's
    assert json.loads(out.read_text()) == {"error": MISSING}


def test_peers_turns_a_python_without_rockmate_into_rows(tmp_path):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    rows = peers.rockmate_rows(sys.executable, str(scenario), LEVELS, 1)
    assert [(r.tool, r.level, r.config, r.why) for r in rows] == [("rockmate", level, None, MISSING)
                                                                  for level in LEVELS]


def test_peers_reports_a_python_that_is_not_there(tmp_path):
    missing = str(tmp_path / "no-env" / "bin" / "python")
    rows = peers.rockmate_rows(missing, "gpt-small", LEVELS, 1)
    assert [(r.tool, r.level, r.config) for r in rows] == [("rockmate", level, None) for level in LEVELS]
    assert all(r.why == f"cannot run {missing}: No such file or directory" for r in rows)
