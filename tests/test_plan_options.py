"""optimizer/options.py: planning settings are one record that checks itself when made; plan(),
sweep() and the command line share it, each naming a wrong setting its own way."""

import pytest

import memfit
from memfit.errors import MemfitError, PlanOptionError
from memfit.planning.options import PlanOptions, check_strategies


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("strategy", "magic", "unknown strategy 'magic'; use one of ilp, none, full"),
    ("solver", "gurobi", "unknown solver 'gurobi'; use one of cpsat, cbc, dp"),
    ("max_segment", 1, "max_segment must be at least 2"),
    ("granularity", "op", "unknown granularity 'op'; use module or fine"),
    ("fallbacks", 21, "fallbacks is a count of tighter plans from 0 to 20, got 21"),
    ("time_limit", 0.0, "time_limit must be a positive number of seconds"),
    ("time_limit", float("nan"), "time_limit must be a positive number of seconds"),
])
def test_a_wrong_setting_is_named_by_whoever_made_it(setting, value, message):
    with pytest.raises(PlanOptionError, match=message) as e:
        PlanOptions(**{setting: value})
    flag = "--" + setting.replace("_", "-")
    spelled = str(e.value.spelled(lambda n: "--" + n.replace("_", "-")))
    assert spelled == str(e.value).replace(setting, flag, 1)  # the command line's words for the same mistake


def test_plan_and_sweep_check_through_the_record(gpt_profile):
    with pytest.raises(MemfitError, match="max_segment must be at least 2"):
        memfit.plan(gpt_profile, "1GB", max_segment=1)
    with pytest.raises(MemfitError, match="max_segment must be at least 2"):
        memfit.sweep(gpt_profile, ["1GB"], max_segment=1)
    with pytest.raises(MemfitError, match="unknown solver"):
        memfit.sweep(gpt_profile, ["1GB"], solver="gurobi")


def test_strategies_once_each_in_order():
    assert check_strategies(["full", "ilp", "full"]) == ["full", "ilp"]
    with pytest.raises(MemfitError, match="--strategies: unknown magic; use some of"):
        check_strategies(["ilp", "magic"], "--strategies")
    with pytest.raises(MemfitError, match=r"unknown \(none given\)"):
        check_strategies([])


def test_one_record_by_options_or_by_keywords(gpt_profile):
    """``plan`` and ``sweep`` take the record, or its settings as keywords put into it: the same plan
    either way, a keyword over the record's setting, and one record checked once."""
    budget = (memfit.min_budget_bytes(gpt_profile) + memfit.predict(gpt_profile, {}).peak_bytes) // 2
    record = memfit.PlanOptions(segments=False, fallbacks=2)
    by_record = memfit.plan(gpt_profile, budget, record)
    by_keywords = memfit.plan(gpt_profile, budget, segments=False, fallbacks=2)
    assert by_record.policies == by_keywords.policies and by_record.strategy == "ilp"
    assert [f["policies"] for f in by_record.fallbacks] == [f["policies"] for f in by_keywords.fallbacks]
    assert by_record.fallbacks  # at least one tighter plan (the ladder stops at the floor)
    every_k = memfit.plan(gpt_profile, budget, record, strategy="every-k", fallbacks=0)  # keywords win
    assert every_k.strategy == "every-k" and not every_k.fallbacks
    frame = memfit.sweep(gpt_profile, [budget], memfit.PlanOptions(segments=False), strategies=["ilp"])
    again = memfit.sweep(gpt_profile, [budget], segments=False, strategies=["ilp"])
    assert frame["policies"][0] == again["policies"][0]
    with pytest.raises(MemfitError, match=r"options must be a memfit\.PlanOptions, got dict"):
        memfit.plan(gpt_profile, budget, {"strategy": "full"})


def test_fit_names_what_is_no_setting_and_keys_its_cache_by_the_record(tmp_path):
    """A keyword ``fit`` does not know is named with the settings there are (it used to reach
    ``plan`` as a TypeError); a setting spelt at its default is the same plan in the cache as one
    left out (the cache digests the record, not the keywords as written)."""
    from .conftest import tiny_gpt

    model, batch = tiny_gpt()
    with pytest.raises(MemfitError, match=r"unknown planning setting batch_size; the settings .* are strategy, "):
        memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1, batch_size=4)
    memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1)
    memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1, segments=True, solver="cpsat")
    memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1, options=memfit.PlanOptions(max_segment=8))
    [entry] = list(tmp_path.iterdir())
    assert len(list(entry.glob("plan-*.json"))) == 1
    memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1, segments=False)
    assert len(list(entry.glob("plan-*.json"))) == 2
