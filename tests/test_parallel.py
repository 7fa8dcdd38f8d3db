"""Per-rank plans under FSDP2 and DDP, on 2 gloo ranks on the CPU: the profile measured on a
rank predicts each plan's per-rank peak, and the gradients equal one process's."""

import os
import warnings

import numpy as np
import pytest
import torch.distributed as dist

import memfit
from memfit.planning.peak import fsdp_headroom
from memfit.policy import FULL
from memfit.runtime.harness import measure_steps
from memfit.scenarios import load_scenario
from memfit.steps import parallel
from memfit.steps.parallel import measure_ranks, profile_ranks, spawn_ranks
from memfit.units import find_units

from .conftest import TINY

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("parallel") / "tiny.toml"
    # [args] is the last table: dropout off, and activations large beside a unit's parameters
    path.write_text(TINY.replace("batch = 2", "batch = 16").replace("seq = 32", "seq = 128") + "dropout = 0.0\n")
    return load_scenario(str(path))


_PROFILES: dict[str, memfit.Profile] = {}


def _ranks(tiny, parallel: str) -> memfit.Profile:
    """The 2-rank profile of ``tiny`` under ``parallel``, measured once for the module (each
    measurement spawns two processes that import torch)."""
    if parallel not in _PROFILES:
        _PROFILES[parallel] = profile_ranks(tiny, parallel=parallel, world_size=2, repeat=1)
    return _PROFILES[parallel]


@pytest.mark.parametrize("parallel", ["fsdp", "fsdp-bf16", "ddp"])
def test_per_rank_plans_predict_the_per_rank_peak(tiny, parallel):
    prof = _ranks(tiny, parallel)
    assert prof.parallel == {"kind": parallel, "world_size": 2}
    assert prof.unit_names == ["h.0", "h.1", "h.2", "h.3"]
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    scheds = [memfit.plan(prof, int(lo + f * (hi - lo))) for f in (0.0, 0.5, 1.0)]
    assert scheds[0].parallel == prof.parallel
    plans = [{}, *(s.policies for s in scheds)]
    estimated = _estimated_plans(tiny, parallel) if parallel in ("fsdp", "ddp") else []
    got = measure_ranks(tiny, plans + [s.policies for s in estimated], parallel=parallel, world_size=2)
    # estimate mode for N ranks: FSDP2 on fake tensors over PyTorch's fake process group, in this
    # process; its per-rank plans are checked against the same 2 real gloo ranks
    for s, measured in zip(estimated, got["peaks"][len(plans):], strict=True):
        assert abs(s.predicted_peak_bytes - measured) / measured <= 0.05, (s.policies, s.predicted_peak_bytes, measured)
    got = {k: v[:len(plans)] for k, v in got.items()}
    headroom = fsdp_headroom(prof)
    assert (headroom > 0) == parallel.startswith("fsdp")
    for s, measured in zip(scheds, got["peaks"][1:], strict=True):  # every one to the byte in 3 runs
        assert abs(s.predicted_peak_bytes - measured) / measured <= 0.02, (s.policies, s.predicted_peak_bytes, measured)
        # the same all-checkpointed fsdp-bf16 plan once measured 32 KiB (0.4%) past budget + headroom
        # in CI: frees on gloo's worker threads, which the CPU meter did not hear until it learned to
        # (tests/test_profiler.py); since, every plan here measured its prediction to the byte in 6
        # runs. The 1% stays for a block freed on another thread outside a collective, which the
        # meter drops only when its address is reused
        assert measured <= s.budget_bytes + headroom + s.budget_bytes // 100
    if parallel == "fsdp-bf16":  # bf16 compute: every plan gives the unplanned ranks' results exactly
        for losses, grads in zip(got["losses"][1:], got["grads"][1:], strict=True):
            assert losses == got["losses"][0]
            assert all(np.array_equal(grads[k], got["grads"][0][k]) for k in grads)
        fp32 = _ranks(tiny, "fsdp")
        # units gathered in bf16: the forward's gathered parameters take half the bytes
        assert memfit.predict(prof, {}).peak_bytes < memfit.predict(fp32, {}).peak_bytes
        return
    # checkpointed or not, the ranks compute one process's loss and gradients (every rank has the
    # same batch here, so averaging over ranks changes nothing)
    model, batch = tiny.build()
    one = measure_steps(model, batch, steps=3)
    for losses, grads in zip(got["losses"], got["grads"], strict=True):
        assert losses == one.losses
        assert grads.keys() == one.grads.keys()
        assert all(np.allclose(grads[k], one.grads[k].numpy(), rtol=1e-6, atol=1e-7) for k in grads)


def test_fsdp_shards_what_one_process_holds(tiny):
    """Each of 2 FSDP2 ranks starts its step with about half the parameters and optimizer state
    one process holds (the shards; replicated inputs and buffers aside)."""
    model, batch = tiny.build()
    single = memfit.profile(model, batch, units=find_units(model, tiny.units), repeat=1)
    rank = _ranks(tiny, "fsdp")
    held = single.param_bytes + single.optimizer_state_bytes
    assert abs(rank.baseline_bytes - rank.input_bytes - held / 2) <= 0.02 * held


def _pids(device: str, failing_rank: int = -1) -> list[int]:
    """Every rank's process id, gathered; ``failing_rank`` raises first and leaves the others
    waiting in the gather."""
    if dist.get_rank() == failing_rank:
        raise RuntimeError("this rank fails")
    every = [0] * dist.get_world_size()
    dist.all_gather_object(every, os.getpid())
    return every


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_kept_ranks_take_every_call_and_a_failing_call_stops_them(monkeypatch):
    """Under ``kept_ranks`` (the suite runs inside it) two calls run in the same two processes; a
    rank that fails is reported at once, by number, though the other waits in a collective for
    it, and its ranks are stopped: the next call starts fresh ones. Without it, each call's ranks
    are gone when it returns."""
    first = spawn_ranks(_pids, 2, "cpu")
    assert spawn_ranks(_pids, 2, "cpu") == first and len(set(first)) == 2 and os.getpid() not in first
    with pytest.raises(memfit.MemfitError, match=r"failed: rank 1: RuntimeError: this rank fails"):
        spawn_ranks(_pids, 2, "cpu", failing_rank=1)
    assert all(_gone(p) for p in first)
    fresh = spawn_ranks(_pids, 2, "cpu")
    assert not set(fresh) & set(first)
    monkeypatch.setattr(parallel, "_KEPT", None)
    alone = spawn_ranks(_pids, 2, "cpu")
    assert not set(alone) & set(fresh) and all(_gone(p) for p in alone)


def test_bad_parallel_settings(tiny):
    with pytest.raises(memfit.MemfitError, match="unknown parallelism 'pp'"):
        profile_ranks(tiny, parallel="pp", world_size=2)
    alone = r"^--parallel tp needs the model's own tensor-parallel plan, which GPT does not declare [^\n]*guide.md\)$"
    with pytest.raises(memfit.MemfitError, match=alone):  # the message alone, no rank's traceback
        profile_ranks(tiny, parallel="tp", world_size=2)
    with pytest.raises(memfit.MemfitError, match="at least 2"):
        profile_ranks(tiny, parallel="ddp", world_size=1)


def chatty_gpt(**args):
    """A GPT whose first block warns on every training forward (a library's deprecation, say)."""
    from memfit.zoo import gpt

    model, batch = gpt(**args)
    model.h[0].register_forward_pre_hook(lambda module, _: warnings.warn("block 0 says so", UserWarning, 2)
                                         if module.training else None)
    return model, batch


def test_a_ranks_warnings_are_said_once_by_the_parent():
    """What profiling warns on the ranks reaches the caller's warnings (its filters, pytest's
    capture), rank 0's only; before, each rank printed its own to the terminal."""
    from memfit.scenarios import Scenario

    sc = Scenario(name="chatty", model="tests.test_parallel:chatty_gpt",
                  args={"batch": 2, "seq": 16, "vocab": 64, "d_model": 32, "n_head": 2, "n_layer": 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile_ranks(sc, parallel="ddp", world_size=2, repeat=1)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert prof.unit_names == ["h.0", "h.1"] and set(said) == {"block 0 says so"}
    model, batch = sc.build()
    with warnings.catch_warnings(record=True) as alone:  # one process profiling the same: as many
        warnings.simplefilter("always")
        memfit.profile(model, batch, repeat=1)
    assert len(said) == sum(str(w.message) == "block 0 says so" for w in alone) > 0


def test_cli_plans_and_validates_per_rank_and_refuses_what_it_cannot_check(tiny, tmp_path, capsys):
    import json

    from memfit.cli import main

    out = tmp_path / "ranks.json"
    prof = _ranks(tiny, "ddp")
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    assert main(["plan", "--scenario", tiny.origin, "--budget", str((lo + hi) // 2), "--parallel", "ddp",
                 "--repeat", "1", "-o", str(out)]) == 0
    assert "per rank, for ddp on 2 ranks" in capsys.readouterr().out
    sched = memfit.load_schedule(out)
    assert sched.parallel == {"kind": "ddp", "world_size": 2} and sched.checkpointed
    # validate runs the ranks the schedule is for: plain and scheduled, every rank's peak measured
    assert main(["validate", "--schedule", str(out), "--scenario", tiny.origin, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["rank_peaks"]) == 2 and got["measured_peak_bytes"] == max(got["rank_peaks"])
    for peak in got["rank_peaks"]:
        assert abs(peak - sched.predicted_peak_bytes) <= 0.02 * sched.predicted_peak_bytes, got
    assert got["ok"] and got["losses_equal"] and got["grads_equal"] and got["buffers_equal"]
    assert got["plain_peak_bytes"] > got["measured_peak_bytes"]
    assert main(["validate", "--schedule", str(out), "--timeline", str(tmp_path / "t.png")]) == 2
    assert "--timeline is for one process; this schedule is per rank (ddp on 2 ranks)" in capsys.readouterr().err
    assert main(["plan", "--budget", "1GB", "--world-size", "4"]) == 2
    assert "give --parallel too" in capsys.readouterr().err
    assert main(["plan", "--scenario", "gpt-small", "--target", "rtx4090", "--budget", "1GB", "--parallel", "fsdp",
                 "--world-size", "8", "-o", str(out)]) == 0
    assert "on each rank (fsdp on 8 ranks)" in capsys.readouterr().out  # estimated for 8 RTX 4090s
    assert memfit.load_schedule(out).parallel == {"kind": "fsdp", "world_size": 8}
    assert main(["validate", "--schedule", str(out)]) == 2  # for 8 GPUs this machine does not have
    assert "estimated for rtx4090" in capsys.readouterr().err


def _estimated_plans(tiny, parallel: str) -> list[memfit.Schedule]:
    """Plans at three budgets from the estimated 2-rank profile of ``tiny``."""
    from memfit.profiler.estimate import estimate

    prof = estimate(lambda: tiny.build("cpu"), target="cpu", units=tiny.units, parallel=parallel, world_size=2)
    assert prof.parallel == {"kind": parallel, "world_size": 2} and prof.mode == "estimated"
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    return [memfit.plan(prof, int(lo + f * (hi - lo))) for f in (0.0, 0.5, 1.0)]


def test_eight_fsdp_ranks_hold_an_eighth_of_the_static_memory():
    """A GPT with AdamW, estimated for 8 H100s: each rank starts its step with an eighth of the
    parameters and optimizer state, and peaks with the activations and the gathered units on top."""
    from memfit.profiler.estimate import estimate

    sc = load_scenario("gpt-small")
    one = estimate(lambda: sc.build("cpu"), target="h100", units=sc.units)
    eight = estimate(lambda: sc.build("cpu"), target="h100", units=sc.units, parallel="fsdp", world_size=8)
    held = one.param_bytes + one.optimizer_state_bytes
    assert abs(eight.baseline_bytes - eight.input_bytes - held / 8) <= 0.01 * held / 8
    activations = memfit.predict(one, {}).peak_bytes - one.baseline_bytes
    assert memfit.predict(eight, {}).peak_bytes - eight.baseline_bytes >= 0.9 * activations


def test_fsdp_estimate_counts_the_gathers_fsdp2_resizes(tmp_path):
    """FSDP2 frees each gathered unit with ``untyped_storage().resize_(0)`` and allocates it again
    with ``resize_(n)``, which no op shows: on a GPT whose 32k-token embedding is most of its
    parameters, estimated for 2 fake ranks and measured on 2 gloo ranks, the plans' peaks agree
    within 3%."""
    from memfit.profiler.estimate import estimate

    path = tmp_path / "wide.toml"
    path.write_text(TINY.replace("vocab = 256", "vocab = 32000").replace("batch = 2", "batch = 4")
                    + "dropout = 0.0\n")
    wide = load_scenario(str(path))
    model, _ = wide.build()
    embedding = model.wte.weight.numel()
    assert embedding >= 0.4 * sum(p.numel() for p in model.parameters())
    prof = estimate(lambda: wide.build("cpu"), target="cpu", units=wide.units, parallel="fsdp", world_size=2)
    plans = [{}, dict.fromkeys(prof.unit_names, FULL)]
    measured = measure_ranks(wide, plans, parallel="fsdp", world_size=2)["peaks"]
    for policies, peak in zip(plans, measured, strict=True):
        predicted = memfit.predict(prof, policies).peak_bytes
        assert abs(predicted - peak) <= 0.03 * peak, (policies, predicted, peak)


def test_fsdp_estimate_counts_an_optimizer_step_on_shards_not_whole_parameters():
    """The optimizer steps FSDP2's DTensor parameters, whose ops a dispatch mode sees at their
    global size while each rank's kernels run on its shard: the estimate counts the shards. A
    Llama whose embedding and head are most of it, estimated for 2 fake ranks and measured on 2
    gloo ranks: every phase of the all-checkpointed step leaves the same level within 1%, and the
    optimizer's step peaks within 1% (it was counted at the parameters' whole size: 2x here, 8x
    on 8 ranks); other peaks within 3% (the head's backward is 2.3% low, not yet explained), but
    for the root's reduce-scatter at the end of the backward, where the gloo run holds 115 MiB
    (about the root's unsharded gradients) that the fake process group's collective does not:
    gloo's copy of the input (made inside ``c10d::_reduce_scatter_base_``), which NCCL does not make."""
    from memfit.profiler.estimate import estimate
    from memfit.scenarios import Scenario

    pytest.importorskip("transformers")
    sc = Scenario(name="llama-wide", model="memfit.hf:llama", optimizer="adamw-single",
                  args={"batch": 1, "seq": 64, "n_layer": 2, "hidden": 512, "intermediate": 1024, "n_head": 8,
                        "kv_heads": 8, "vocab": 32000})
    est = estimate(lambda: sc.build("cpu"), target="cpu", units="auto", step=sc.train_step, parallel="fsdp",
                   world_size=2)
    measured = profile_ranks(sc, parallel="fsdp", world_size=2, repeat=1)
    full = dict.fromkeys(est.unit_names, FULL)
    got, want = memfit.predict(est, full).levels, memfit.predict(measured, full).levels
    assert [name for name, _, _ in got] == [name for name, _, _ in want]
    step = next(i for i, (name, _, _) in enumerate(want) if name == "optimizer step")
    assert want[step][2] - want[step][1] > 0  # the step's temporaries, on the shards
    root = want[step - 1][0]  # the embedding's backward, where the root's gradients are reduce-scattered
    for (name, level, peak), (_, level_m, peak_m) in zip(got, want, strict=True):
        assert abs(level - level_m) <= 0.01 * level_m, name  # what each phase leaves: within 1%
        if name == root:  # gloo's reduce-scatter holds 115 MiB more than the collective's own buffers
            assert peak <= peak_m, name
        else:
            assert abs(peak - peak_m) <= (0.01 if name == "optimizer step" else 0.03) * peak_m, name
