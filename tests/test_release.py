"""What the previous release wrote still loads and applies the same, and the CLI prints the same.

tests/fixtures/release holds schedules and profiles that main wrote on 2026-12-01 (fee0a22),
what its CLI printed for the commands in commands.txt, and what its ``apply`` put on the model
(record.py made them all). Solve times, which differ from run to run, are masked.
"""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

import memfit
from memfit.policy import spelt

from .fixtures.release.record import APPLIED, applied, commands, run

RELEASE = Path(__file__).parent / "fixtures" / "release"
_SOLVE_TIME = re.compile(r'( in [0-9.]+ s\b|"solve_s": [0-9.e-]+)')


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixtures folder, copied: the commands write their schedules beside the release's."""
    root = tmp_path_factory.mktemp("release") / "fixtures"
    shutil.copytree(RELEASE.parent, root)
    return root / "release"


@pytest.mark.parametrize("n", range(len(commands())))
def test_cli_prints_what_the_release_printed(copy: Path, n: int) -> None:
    argv = commands()[n]
    expected = (RELEASE / f"{n:02d}.out").read_text()
    assert _SOLVE_TIME.sub(" in ? s", run(argv, copy)) == _SOLVE_TIME.sub(" in ? s", expected), " ".join(argv)
    if "-o" in argv:  # the schedule written is the release's, byte for byte
        name = argv[argv.index("-o") + 1]
        assert (copy / name).read_bytes() == (RELEASE / name).read_bytes(), name
    if "--csv" in argv:  # the sweep's table too, but for its solve times; columns added since may follow
        name = argv[argv.index("--csv") + 1]
        then = _without_solve_s(RELEASE / name)
        now = _without_solve_s(copy / name)
        assert [{k: row[k] for k in old} for row, old in zip(now, then, strict=True)] == then


def _without_solve_s(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return [{k: v for k, v in row.items() if k != "solve_s"} for row in csv.DictReader(f)]


@pytest.mark.parametrize("name", sorted(p.name for p in RELEASE.glob("*.schedule.json")))
def test_release_schedules_load_unchanged(name: str) -> None:
    text = json.loads((RELEASE / name).read_text())
    schedule = memfit.load_schedule(RELEASE / name)
    assert not schedule.edited
    assert spelt(schedule.policies) == text["policies"] and schedule.baselines == text.get("baselines", {})
    assert schedule.predicted_peak_bytes == text["predicted_peak_bytes"]


@pytest.mark.parametrize("name", ["gpt-small-fine.json", "gpt-1b.json", "../gpt-small.json", "../cnn-mixed.json"])
def test_release_profiles_load_and_predict_the_same(name: str) -> None:
    profile = memfit.Profile.load(RELEASE / name)
    data = json.loads((RELEASE / name).read_text())
    assert [u.name for u in profile.units] == [u["name"] for u in data["units"]]
    assert [list(map(str, u.options)) for u in profile.units] == [list(u["options"]) for u in data["units"]]


def test_release_schedules_apply_as_they_did() -> None:
    from memfit.scenarios import load_scenario

    expected = json.loads((RELEASE / "applied.json").read_text())
    for name in APPLIED:
        model, _ = load_scenario("gpt-small").build()
        assert applied(memfit.apply(model, memfit.load_schedule(RELEASE / name))) == expected[name], name
