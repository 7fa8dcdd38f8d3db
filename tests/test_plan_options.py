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
