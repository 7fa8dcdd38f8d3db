"""Profile and schedule JSON: round trips, atomic writes, errors that name the field."""

import json

import pytest

import memfit
from memfit.formats.profile import Profile

from .conftest import random_profile


def test_profile_round_trip(gpt_profile, tmp_path):
    path = tmp_path / "p.json"
    gpt_profile.save(path)
    again = Profile.load(path)
    assert again == gpt_profile
    assert json.loads(path.read_text())["format"] == "memfit.profile/1"
    frame = again.to_frame()
    assert list(frame.index) == gpt_profile.unit_names
    assert (frame["saved_bytes"] > 0).all()


def test_schedule_round_trip(tmp_path):
    prof = random_profile(6, 1)
    sched = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes - 1)
    path = tmp_path / "sub" / "s.json"
    sched.save(path)
    sched.solve_s = None  # not saved, so that identical plans give identical files
    assert memfit.load_schedule(path) == sched
    assert [p.name for p in path.parent.iterdir()] == ["s.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("budget_bytes"), "missing field 'budget_bytes'"),
        (lambda d: d.update(budget_bytes="big"), "'budget_bytes' must be an integer"),
        (lambda d: d.update(format="memfit.schedule/9"), "field 'format'"),
        (lambda d: d["policies"].update(u0="sometimes"), "policy 'sometimes'"),
        (lambda d: d["fingerprint"].pop("params_sha256"), "params_sha256"),
    ],
)
def test_schedule_errors_name_the_field(tmp_path, mutate, message):
    prof = random_profile(3, 2)
    path = tmp_path / "s.json"
    memfit.plan(prof, memfit.predict(prof, {}).peak_bytes).save(path)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(memfit.FileFormatError, match=message):
        memfit.load_schedule(path)


def test_corrupt_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "memfit.schedule/1", "policies": ')
    with pytest.raises(memfit.FileFormatError, match="not valid JSON"):
        memfit.load_schedule(bad)
    with pytest.raises(memfit.FileFormatError, match="no such file"):
        memfit.load_schedule(tmp_path / "nope.json")
    with pytest.raises(memfit.FileFormatError, match="'units'"):
        (tmp_path / "p.json").write_text('{"format": "memfit.profile/1"}')
        Profile.load(tmp_path / "p.json")


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    prof = random_profile(3, 3)
    path = tmp_path / "s.json"
    sched = memfit.plan(prof, memfit.predict(prof, {}).peak_bytes)
    sched.save(path)
    before = path.read_text()
    sched.baselines = {"bad": {"peak_bytes": object()}}  # not JSON-serialisable: the write fails midway
    with pytest.raises(TypeError):
        sched.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
