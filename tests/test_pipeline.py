"""Pipeline stages (issue 41): each rank planned for the micro-batches its schedule holds in flight,
measured against torch.distributed.pipelining's own schedules on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from memfit.errors import MemfitError
from memfit.planning.peak import predict
from memfit.policy import FULL, KEEP
from memfit.report import stages_report
from memfit.steps.parallel import spawn_ranks
from memfit.steps.pipeline import in_flight, makespan, rank_orders, stage_ranks
from memfit.steps.stages import _rank_plan, plan_stages
from tests.pipeline_models import plain_grads, plain_name, run_rank, stage_profiles


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (8, 8), (4, 4)])
def test_the_schedules_own_order_says_how_many_micro_batches_each_stage_holds(stages: int, microbatches: int) -> None:
    one_f_one_b = rank_orders("1F1B", stages, microbatches)
    assert [in_flight(o, s) for s, o in enumerate(one_f_one_b)] == [min(stages - s, microbatches)
                                                                   for s in range(stages)]
    gpipe = rank_orders("GPipe", stages, microbatches)
    assert [in_flight(o, s) for s, o in enumerate(gpipe)] == [microbatches] * stages
    # interleaved: two stages a rank, from its own pipeline_order; the first rank holds the most
    inter = rank_orders("Interleaved1F1B", stages, microbatches)
    ranks = stage_ranks(inter)
    assert len(inter) == stages // 2 and sorted(ranks) == list(range(stages))
    held = [in_flight(inter[ranks[s]], s) for s in range(stages)]
    assert held[0] == max(held) and held[-1] == 1


def test_schedules_memfit_cannot_plan_are_refused_with_what_it_can() -> None:
    with pytest.raises(MemfitError, match="whose backward is whole"):
        rank_orders("ZBVZeroBubble", 4, 8)
    with pytest.raises(MemfitError, match="Unknown schedule name"):
        rank_orders("2F2B", 4, 8)
    with pytest.raises(MemfitError, match="2 stages or more"):
        rank_orders("1F1B", 1, 8)


def test_makespan_is_the_textbook_bubble_for_equal_stages_and_waits_on_the_slowest() -> None:
    for name in ("1F1B", "GPipe"):
        for stages, mbs in ((4, 8), (2, 4), (8, 16)):
            orders = rank_orders(name, stages, mbs)
            even = makespan(orders, dict.fromkeys(range(stages), 1.0), dict.fromkeys(range(stages), 2.0))
            assert even == (mbs + stages - 1) * 3.0
    orders = rank_orders("1F1B", 4, 8)
    slow_first = makespan(orders, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, {0: 3.0, 1: 2.0, 2: 2.0, 3: 2.0})
    assert slow_first > 33.0 and slow_first >= 8 * 4.0  # the slow rank's own work bounds the step


def _check_ranks(schedule: str, stages: int, microbatches: int, n_layer: int, kind: str = "gpt") -> None:
    profiles = stage_profiles(schedule, stages, microbatches, n_layer=n_layer, kind=kind)
    ranks = len(profiles)
    peaks = [p.measured_peak_bytes[KEEP] for p in profiles]
    budget = int(0.85 * max(peaks))
    plans = plan_stages(profiles, budget, schedule=schedule, microbatches=microbatches)
    assert any(any(p != KEEP for p in s.policies.values()) for s in plans.schedules)  # something to recompute
    for label, applied, predicted in (
            ("plain", [None] * ranks, peaks),
            ("per-stage", plans.schedules, [s.predicted_peak_bytes for s in plans.schedules])):
        got = spawn_ranks(run_rank, ranks, "cpu", schedule, stages, microbatches, applied, n_layer=n_layer,
                          kind=kind)["ranks"]
        loss, grads = plain_grads(n_layer=n_layer, kind=kind)
        for r, rank in enumerate(got):
            assert abs(rank["peak"] - predicted[r]) <= 0.02 * predicted[r], (label, r, rank["peak"], predicted[r])
            for name, g in rank["grads"].items():
                want = grads[plain_name(kind, name)]
                assert torch.allclose(torch.from_numpy(g), want, rtol=1e-4, atol=1e-6), (label, r, name)
            assert rank["grads"]
        assert got[-1]["loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_two_stages_on_gloo_measure_what_their_profiles_predict(schedule: str) -> None:
    """Every rank's measured peak, with nothing and with its per-stage plan, within 2% of its
    prediction (to the byte, as measured); gradients and loss equal to the unparallelized model's."""
    _check_ranks(schedule, 2, 4, 4)


def test_a_gpt_with_written_out_attention_in_two_stages_on_gloo() -> None:
    """nanoGPT's blocks (q.k^T, a causal mask buffer, softmax, .v, each an op autograd keeps), a
    model memfit was not shaped around, under GPipe."""
    _check_ranks("GPipe", 2, 4, 4, kind="nanogpt")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_four_stages_on_gloo_measure_what_their_profiles_predict(schedule: str) -> None:
    _check_ranks(schedule, 4, 8, 8)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", pytest.param("LoopedBFS", marks=pytest.mark.slow)])
def test_two_stages_a_rank_run_from_the_schedules_order_of_actions(schedule: str) -> None:
    """4 stages on 2 ranks, each rank a ModuleDict of its two stages, planned as one."""
    _check_ranks(schedule, 4, 4, 8)


def test_hugging_face_llama_in_two_stages_on_gloo_measures_what_its_profiles_predict() -> None:
    """Llama from a config (rotary embeddings, GQA, SwiGLU, RMSNorm), its decoder layers run by
    stage modules as LlamaModel.forward runs them, under 1F1B."""
    _check_ranks("1F1B", 2, 4, 4, kind="llama")


@pytest.mark.slow
def test_hugging_face_llama_in_four_stages_under_gpipe() -> None:
    _check_ranks("GPipe", 4, 4, 4, kind="llama")


def test_per_stage_plans_recompute_most_where_most_is_in_flight_and_beat_the_uniform_plan() -> None:
    profiles = stage_profiles("1F1B", 4, 8, n_layer=8)
    budget = int(0.8 * max(p.measured_peak_bytes[KEEP] for p in profiles))
    plans = plan_stages(profiles, budget, schedule="1F1B", microbatches=8)
    checkpointed = [sum(p != KEEP for p in s.policies.values()) for s in plans.schedules]
    assert [r.in_flight for r in plans.per_stage] == [4, 3, 2, 1]
    assert checkpointed[0] > checkpointed[-1] and checkpointed == sorted(checkpointed, reverse=True)
    assert all(r.prediction.peak_bytes <= budget for r in plans.per_stage + plans.uniform)
    # the uniform plan checkpoints the first k units of every stage, the least k that fits them all
    k = plans.uniform_k
    assert k >= 1 and any(predict(p, {u.name: FULL if j < k - 1 else KEEP for j, u in enumerate(p.units)}).peak_bytes
                          > budget for p in profiles)
    assert plans.plain_s < plans.per_stage_s < plans.uniform_s
    text = stages_report(plans)
    assert "per-stage plan +" in text and f"the first {k} units of every stage" in text


def test_a_rank_of_two_stages_times_each_stage_for_its_own_units_and_the_uniform_plan_takes_each_stages_first() -> None:
    """Interleaved1F1B: a rank holds stages s and s + 2. Each stage's forward and backward per
    micro-batch are its own units' share of the rank's step (summing to the rank's step, not each
    the whole of it), a stage's recompute goes to its own backward, and the uniform plan
    checkpoints the first k units of every stage, not of the rank's list."""
    profiles = stage_profiles("Interleaved1F1B", 4, 4, n_layer=8)
    budget = int(0.85 * max(p.measured_peak_bytes[KEEP] for p in profiles))
    plans = plan_stages(profiles, budget, schedule="Interleaved1F1B", microbatches=4)
    for r, (profile, rank) in enumerate(zip(profiles, plans.uniform, strict=True)):
        assert sorted(rank.fwd_s) == [r, r + 2]
        full = {n for n, p in rank.policies.items() if p == FULL}
        assert full == {f"{s}.layers.{2 * s + j}" for s in (r, r + 2) for j in range(plans.uniform_k)}
        plain = _rank_plan(profile, {}, plans.orders[r], 4)
        assert sum(plain.fwd_s.values()) + sum(plain.bwd_s.values()) == pytest.approx(profile.step_s / 4)
        extra = {s: rank.bwd_s[s] - plain.bwd_s[s] for s in rank.bwd_s}
        assert sum(extra.values()) == pytest.approx(rank.prediction.recompute_s / 4)
        assert all(extra[s] > 0 for s in extra) == (plans.uniform_k > 0)


def test_a_ranks_step_validates_in_one_process_and_its_plan_applies_without_drift_warnings() -> None:
    """memfit.validate runs the emulated rank step (memfit.steps.pipeline.RankStep): measured peak equal to
    the plan's, gradients equal to the plain step's; the stage's forward sees a micro-batch, not the
    step's buffers, and the drift watch does not take one for the other."""
    import warnings

    import memfit
    from memfit.steps.pipeline import RankStep, rank_orders, stage_data
    from tests.pipeline_models import PipelinedGPT, loss_fn, stages_of

    torch.manual_seed(0)
    stages = stages_of(PipelinedGPT(n_layer=4), 2)
    idx = torch.randint(0, 512, (8, 64))
    with torch.no_grad():
        acts = [stages[0](x) for x in idx.tensor_split(4)]
    data = {0: stage_data(list(idx.tensor_split(4)), acts[0], [], first=True)}
    step = RankStep(rank_orders("1F1B", 2, 4)[0], 1, 4, torch.optim.AdamW(stages[0].parameters()), loss_fn)
    prof = memfit.profile(stages[0], data, step_fn=step, units="layers.*", repeat=3)
    assert prof.input_bytes == idx.numel() * 8 + 4 * acts[0].numel() * 4  # the batch and the gradient buffers
    sched = memfit.plan(prof, int(0.8 * prof.measured_peak_bytes[KEEP]))
    assert any(p != KEEP for p in sched.policies.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", memfit.PlanDriftWarning)
        v = memfit.validate(stages[0], data, sched, step_fn=step)
    assert v.measured_peak_bytes == v.predicted_peak_bytes and v.grads_equal and v.losses_equal


@pytest.mark.filterwarnings("ignore::memfit.NoisyTimesWarning")  # memory only: the times do not matter here
def test_estimated_stages_equal_the_measured_ones_from_shapes() -> None:
    """estimate_stages on fake tensors (target cpu) against profile_stages' measured ranks, for
    Llama in 2 stages under 1F1B: nothing checkpointed to the byte; everything checkpointed
    within 1% (the CPU's RNG state each checkpoint keeps, 5,056 bytes a micro-batch in flight, is
    no fake tensor: 0 on a CUDA target, where it stays on the host)."""
    from memfit.steps.stages import estimate_stages
    from tests.pipeline_models import built, cut, loss_fn

    def build() -> tuple:
        model, vocab = built("llama", 4, 64)
        idx = torch.randint(0, vocab, (8, 64))
        return cut("llama", model, 2), idx, torch.randint(0, vocab, (8, 64))

    est = estimate_stages(build, loss_fn, target="cpu", schedule="1F1B", microbatches=4, units="layers.*")
    meas = stage_profiles("1F1B", 2, 4, n_layer=4, kind="llama")
    assert all(e.mode == "estimated" for e in est)
    for e, m in zip(est, meas, strict=True):
        assert e.measured_peak_bytes[KEEP] == m.measured_peak_bytes[KEEP]
        assert abs(e.measured_peak_bytes[FULL] - m.measured_peak_bytes[FULL]) <= 0.01 * m.measured_peak_bytes[FULL]


def test_the_command_line_plans_a_hugging_face_decoders_ranks_and_writes_a_schedule_each(tmp_path) -> None:
    import memfit
    from memfit.hf import decoder_stages, llama
    from tests.conftest import run_cli

    ran = run_cli("plan", "--scenario", "hf-llama", "--pp", "2", "--budget", "95%", "--repeat", "1", "-o", "pp.json",
                  cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "in flight" in ran.stdout and "uniform plan" in ran.stdout and "pp.rank1.json" in ran.stdout
    stages = decoder_stages(llama()[0], 2)
    for r, stage in enumerate(stages):
        schedule = memfit.load_schedule(tmp_path / f"pp.rank{r}.json")
        memfit.apply(stage, schedule)  # made for this rank's stage: its fingerprint matches
        assert list(schedule.policies) == [f"layers.{2 * r}", f"layers.{2 * r + 1}"]
    ran = run_cli("validate", "--schedule", "pp.rank1.json", cwd=tmp_path)  # every rank, on gloo
    assert ran.returncode == 0 and "validation OK" in ran.stdout, ran.stdout + ran.stderr
    rows = [line.split() for line in ran.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 and all(row[8] == "yes" for row in rows)  # rank, predicted, measured, off, budget, fits
    for row in rows:
        assert abs(float(row[5].rstrip("%"))) <= 2.0  # each rank's measured peak within 2% of its prediction
    (tmp_path / "pp.rank0.json").unlink()
    ran = run_cli("validate", "--schedule", "pp.rank1.json", cwd=tmp_path)
    assert ran.returncode == 2 and "pp.rank0.json missing" in ran.stderr


def test_stages_on_a_pp_by_fsdp_mesh_are_estimated_then_validated_on_every_rank(tmp_path) -> None:
    """``--pp 2 --parallel fsdp --world-size 2`` with clipping, estimated for the CPU on fake ranks
    and validated on 4 gloo ranks under torch's own 1F1B with FSDP2 stages (PipelineStage's
    gradient accumulation unsharded, reduced after the last backward): every rank's peak within 1%
    of its prediction, gradients the unparallelized model's."""
    from tests.conftest import run_cli

    ran = run_cli("plan", "--scenario", "hf-llama", "--pp", "2", "--parallel", "fsdp", "--world-size", "2",
                  "--clip-grad-norm", "1.0", "--target", "cpu", "--budget", "95%", "-o", "pp.json", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "each stage on fsdp on 2 ranks (4 ranks in all)" in ran.stderr and "fully_shard" in ran.stdout
    ran = run_cli("validate", "--schedule", "pp.rank0.json", cwd=tmp_path)
    assert ran.returncode == 0 and "validation OK" in ran.stdout, ran.stdout + ran.stderr
    rows = [line.split() for line in ran.stdout.splitlines() if line[:1].isdigit()]
    assert [row[3].rstrip(")") for row in rows] == ["0", "0", "1", "1"]  # "r (stage rank p)"
    for row in rows:  # rank, predicted, measured, off, budget, fits, gradients off (after "(stage rank p)")
        assert abs(float(row[8].rstrip("%"))) <= 1.0 and row[11] == "yes" and float(row[12]) < 1e-5, row


def test_a_scenario_names_its_pipeline_by_degrees_and_plan_reads_them(tmp_path) -> None:
    """pp, pp_schedule and pp_microbatches in a scenario file (beside parallel, world_size, tp), as
    torchtitan's config names them: ``memfit plan --scenario FILE`` plans its ranks without --pp;
    profile and sweep, which take one model, say so; wrong fields are refused with the file's name."""
    from memfit.scenarios import load_scenario
    from tests.conftest import run_cli

    path = tmp_path / "piped.toml"
    path.write_text('model = "memfit.hf:llama"\nrequires = "transformers"\ntarget = "cpu"\nparallel = "fsdp"\n'
                    'world_size = 2\npp = 2\npp_schedule = "GPipe"\npp_microbatches = 2\n'
                    "[args]\nbatch = 4\nseq = 64\nn_layer = 4\nhidden = 64\nn_head = 4\nvocab = 512\n")
    sc = load_scenario(str(path))
    assert (sc.pp, sc.pp_schedule, sc.pp_microbatches, sc.parallel, sc.world_size) == (2, "GPipe", 2, "fsdp", 2)
    ran = run_cli("plan", "--scenario", str(path), "--budget", "95%", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "2 ranks of a GPipe pipeline, each stage on fsdp on 2 ranks (4 ranks in all), 2 micro-batches" in ran.stderr
    assert (tmp_path / "schedule.rank1.json").is_file()
    ran = run_cli("sweep", "--scenario", str(path), cwd=tmp_path)
    assert ran.returncode == 2 and "is a pipeline of 2 ranks" in ran.stderr
    for field, says in (("pp = 1", "'pp' must be an integer of at least 2"),
                        ('pp_schedule = "1F1B"', "give pp too")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'model = "memfit.hf:llama"\n{field}\n')
        with pytest.raises(MemfitError, match=says):
            load_scenario(str(bad))


def test_mixed_precision_stages_are_estimated_with_the_gap_measured_on_gloo_said(tmp_path) -> None:
    """fsdp-bf16 stages measured 4.7 to 6.9% above their estimate on gloo (hf-llama, PP 2 x FSDP 2; the
    cause is not found): the plan says so, where fsdp stages are within 1.3%."""
    from tests.conftest import run_cli

    ran = run_cli("plan", "--scenario", "hf-llama", "--pp", "2", "--parallel", "fsdp-bf16", "--world-size", "2",
                  "--target", "cpu", "--budget", "95%", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "memfit: warning: fsdp-bf16 stages are estimated, but on gloo CPU ranks they measured up to 7%" in ran.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without the GPU it was estimated for")
def test_ranks_estimated_for_a_gpu_are_not_validated_without_one(tmp_path) -> None:
    from tests.conftest import run_cli

    ran = run_cli("plan", "--scenario", "hf-llama", "--pp", "2", "--target", "h100", "--budget", "95%", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    ran = run_cli("validate", "--schedule", "schedule.rank1.json", cwd=tmp_path)
    assert ran.returncode == 2 and "estimated for h100 without one" in ran.stderr and "Traceback" not in ran.stderr


@pytest.mark.slow  # 4 to 8 gloo ranks each: 40 s to 2.5 min on 2 cores
@pytest.mark.parametrize(("kind", "world", "tp", "sp", "schedule"), [
    ("tp", 2, 2, True, "1F1B"),  # PP 2 x TP 2 with sequence parallelism: sequence shards between the stages
    ("fsdp", 4, 2, True, "1F1B"),  # PP 2 x FSDP 2 x TP 2, torchtitan's 3-D mesh, on 8 ranks
    ("fsdp", 2, 1, False, "Interleaved1F1B"),  # two FSDP2 stages a rank
])
def test_sharded_stages_estimate_what_their_ranks_measure(kind: str, world: int, tp: int, sp: bool,
                                                          schedule: str) -> None:
    """estimate_stages on fake ranks against every rank of the mesh (tests/pipeline_models.run_mesh_rank:
    a user's loop under torch's schedule, memfit only sharding the stages), nothing and every layer
    checkpointed: within 1.5% (gloo and the CPU checkpoints' RNG state, 5,056 B per region in
    flight, are not in the fake ranks' step); gradients the unparallelized model's."""
    import dataclasses

    import memfit
    from memfit.formats.layout import layout_of
    from memfit.steps.stages import estimate_stages
    from tests.pipeline_models import built, cut, loss_fn, run_mesh_rank

    n_stages = 4 if schedule == "Interleaved1F1B" else 2

    def build() -> tuple:
        model, vocab = built("llama", 4, 64)
        idx = torch.randint(0, vocab, (8, 64))
        return cut("llama", model, n_stages), idx, torch.randint(0, vocab, (8, 64))

    est = estimate_stages(build, loss_fn, target="cpu", schedule=schedule, microbatches=4, units="layers.*",
                          parallel=kind, world_size=world, tp=tp, sequence_parallel=sp)
    _, ref = plain_grads(n_layer=4, kind="llama")
    for policy in (KEEP, FULL):
        plans = [dataclasses.replace(memfit.plan(p, predict(p, {}).peak_bytes),
                                     policies={u.name: policy for u in p.units}) for p in est]
        ranks = spawn_ranks(run_mesh_rank, 2 * world, "cpu", schedule, n_stages, 4, layout_of(kind, world, tp, sp),
                            plans)["ranks"]
        for got in ranks:
            predicted = predict(est[got["pp"]], plans[got["pp"]].policies).peak_bytes
            assert abs(predicted - got["peak"]) <= 0.015 * got["peak"], (policy, got["rank"], predicted, got["peak"])
            for name, grad in got["grads"].items():
                want = ref[plain_name("llama", name)]
                assert float((torch.from_numpy(grad) - want).abs().max()) <= 1e-5 * float(want.abs().max()), name


@pytest.mark.parametrize(("flags", "said"), [
    (["--pp", "2", "--parallel", "fsdp"], "estimated, not measured here: give --target"),
    (["--pp", "2", "--parallel", "ddp", "--target", "cpu"], "not ddp"),
    (["--pp", "2", "--parallel", "fsdp", "--tp", "2", "--world-size", "4", "--clip-grad-norm", "1", "--target", "cpu"],
     "needs --sequence-parallel"),
    (["--pp", "1"], "2 stages or more"),
    (["--pp", "2", "--pp-schedule", "ZBVZeroBubble"], "whose backward is whole"),
    (["--pp", "2", "--pp-schedule", "2F2B"], "Unknown schedule name"),
    (["--pp", "2", "--scenario", "nanogpt"], "no input_ids"),
    (["--pp", "2", "--pp-microbatches", "3"], "does not split into 3 micro-batches"),
])
def test_pipeline_flags_it_cannot_plan_exit_2_with_what_to_do(tmp_path, flags: list[str], said: str) -> None:
    from tests.conftest import run_cli

    args = ["plan", "--budget", "1GB", *flags]
    if "--scenario" not in flags:
        args += ["--scenario", "hf-llama"]
    ran = run_cli(*args, cwd=tmp_path)
    assert ran.returncode == 2 and said in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
    assert not list(tmp_path.iterdir())
