"""The schedule's parts are typed records (schedule.py), each read from a file by one field-driven
reader (``jsonio.Fields.record``): a hand-edited file that breaks one gets an error naming the
field, and a good one reads back exactly as written."""

import json
from pathlib import Path

import pytest

import memfit
from memfit.errors import FileFormatError
from memfit.policy import spelt

SCHEDULE = Path(__file__).parent / "fixtures" / "release" / "gpt-small.schedule.json"


def _edited(tmp_path, change):
    data = json.loads(SCHEDULE.read_text())
    change(data)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["baselines"]["full"].update(fits="yes"), r"baselines.full: field 'fits' must be true or false"),
    (lambda d: d["baselines"]["full"].update(peak_bytes=1.5), r"baselines.full: field 'peak_bytes' must be an integer"),
    (lambda d: d["baselines"]["full"].update(overhead=-1), r"field 'overhead' must be a finite number"),
    (lambda d: d.update(compile={"backend": "inductor"}), r"compile: missing field 'peak_bytes'"),
    (lambda d: d.update(compile={"backend": "inductor", "peak_bytes": 0}), r"'peak_bytes' must be at least 1"),
    (lambda d: d.update(parallel={"kind": "ddp", "world_size": 1}), r"'world_size' must be at least 2"),
    (lambda d: d.update(parallel={"kind": "zero3", "world_size": 2}), r"'kind' has an invalid value 'zero3'"),
    (lambda d: d["source"].update(units=3), r"field 'source.units' must be a string or a list or null"),
    (lambda d: d["source"].update(input_shape="8x3"), r"field 'source.input_shape' must be a list or null"),
    (lambda d: d.update(fallbacks=[{"budget_bytes": 1, "policies": d["policies"], "predicted_peak_bytes": 1,
                                    "predicted_recompute_s": 0.1}]),
     r"fallbacks\[0\]: missing field 'predicted_overhead'"),
])
def test_a_broken_part_is_named(tmp_path, change, message):
    with pytest.raises(FileFormatError, match=message):
        memfit.load_schedule(_edited(tmp_path, change))


def test_parts_read_back_as_written_in_order(tmp_path):
    data = json.loads(SCHEDULE.read_text())
    data["parallel"] = {"kind": "fsdp", "world_size": 4}
    data["compile"] = {"backend": "inductor", "peak_bytes": 12345}
    data["fallbacks"] = [{"budget_bytes": 1, "policies": data["policies"], "predicted_peak_bytes": 1,
                          "predicted_recompute_s": 0.1, "predicted_overhead": 0.01}]
    data["source"] = {"model": "pkg:build", "input_shape": [8, 3], "units": ["a", "b"], "dtype": None}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    s = memfit.load_schedule(path)
    assert (s.parallel, s.compile, s.source) == (data["parallel"], data["compile"], data["source"])
    assert list(s.source) == list(data["source"])  # saved again in the file's order
    assert s.baselines == data["baselines"]
    assert [{**f, "policies": spelt(f["policies"])} for f in s.fallbacks] == data["fallbacks"]
    s.save(tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    assert {k: again[k] for k in ("parallel", "compile", "source", "baselines", "fallbacks")} == {
        k: data[k] for k in ("parallel", "compile", "source", "baselines", "fallbacks")}


def test_fields_a_record_does_not_know_are_dropped(tmp_path):
    s = memfit.load_schedule(_edited(tmp_path, lambda d: d["baselines"]["full"].update(note="by hand")))
    assert "note" not in s.baselines["full"] and s.baselines["full"]["fits"] is True
