"""Tensor parallelism, with and without sequence parallelism, on a model the user parallelized
with ``parallelize_module`` before memfit sees it (issue 41): Hugging Face's Llama and GPT-NeoX
from configs on 2 gloo ranks. Each rank profiles its own step (its shards, the collectives' buffers,
what sequence parallelism shards), rank 0's plan is broadcast (a region's recomputation re-runs
its collectives, so every rank must checkpoint the same units), and the user's loop then
measures the predicted peak and trains as one process does. ``--parallel tp`` shards a Hugging
Face model by its config's own plan, measured on gloo ranks and estimated on fake ones."""

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist

from memfit.steps.parallel import spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")
UNITS = [f"model.layers.{i}" for i in range(4)]
# the 2%. The CPU meter hears no free made on gloo's worker threads; it places one after
# the block's last use (memfit.measure.memory). Before it did, 2 of 16 rank peaks in 8 runs of
# TP 2 + SP were 3.4% and 4.1% off, and CI once saw 5.5%; 10 runs since: 17 of 20 to the byte, the
# others 0.38% (two) and 0.76% off (python benchmarks/rank_fidelity.py)
TOLERANCE = 0.02


def _tp_plans(sequence_parallel: bool) -> tuple[dict, dict]:
    """(model-level, per-layer) plans as torchtitan writes them for Llama, with Hugging Face's names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    products = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel()}
    if not sequence_parallel:
        return {}, {**products, "self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    # activations between the products sharded along the sequence; the norms run on the shards
    model = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                   use_local_output=False),
             "model.norm": SequenceParallel(),
             "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    layer = {**products,
             "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
             "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                             desired_input_kwarg_layouts={"hidden_states": Replicate()}),
             "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
             "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    return model, layer


def _llama():
    from memfit import hf

    # intermediate 384 and 2 KV heads: every sharded dimension divides by the 2 ranks
    return hf.llama(batch=2, seq=64, n_layer=4, hidden=128, n_head=4, vocab=512, intermediate=384)


def _neox_plans() -> tuple[dict, dict]:
    """GPT-NeoX (Pythia) under TP with sequence parallelism, as a user writes it from the config's
    own plan (fused q/k/v column-wise: its layout is head by head) and Llama's norms and inputs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    to_whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    model = {"gpt_neox.embed_in": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False),
             "gpt_neox.final_layer_norm": SequenceParallel(),
             "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    layer = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
             "attention": to_whole, "attention.query_key_value": ColwiseParallel(),
             "attention.dense": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
             "mlp": to_whole, "mlp.dense_h_to_4h": ColwiseParallel(),
             "mlp.dense_4h_to_h": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    return model, layer


def _neox():
    from memfit import hf

    return hf.gpt_neox(batch=2, seq=64, n_layer=4, hidden=128, n_head=4, vocab=512)


# name -> (model and batch, its blocks, its (model-level, per-layer) plans with or without SP)
MODELS = {"llama": (_llama, UNITS, _tp_plans),
          "gpt-neox": (_neox, [f"gpt_neox.layers.{i}" for i in range(4)], lambda sp: _neox_plans())}


def _step(model, opt, batch) -> float:
    """The user's step: zero_grad, forward with labels, backward, AdamW."""
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    return float(loss.detach())


def _whole(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _one_plan(prof):
    """Rank 0's plan halfway between its floor and its unplanned peak, on every rank (a region's
    recomputation re-runs its collectives: ranks with other plans would wait on each other)."""
    import memfit

    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    shared = [memfit.plan(prof, (lo + hi) // 2) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0], lo, hi


def _train_beside(model, plain, mine: dict, whole: dict):
    """Two AdamW steps of the scheduled model on its batch and of the plain one on the whole
    batch (the first makes the optimizer's state), the second scheduled one measured: both
    losses, that step's exact CPU peak, and the largest gradient difference (relative)."""
    from memfit.measure.memory import measured

    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    losses = [[_step(model, opts[0], mine)], [_step(plain, opts[1], whole)]]
    opts[0].zero_grad(set_to_none=True)
    state = [v for s in opts[0].state.values() for v in s.values() if torch.is_tensor(v)]
    loss, peak, _ = measured(lambda: _step(model, opts[0], mine),
                             lambda: [*model.parameters(), *model.buffers(), *state,
                                      *(v for v in mine.values() if torch.is_tensor(v))])
    losses[0].append(loss)
    losses[1].append(_step(plain, opts[1], whole))
    ref = dict(plain.named_parameters())
    error = max(float((_whole(p.grad) - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp_min(1e-12))
                for n, p in model.named_parameters())
    return losses, peak, error


def _rank(device: str, sequence_parallel: bool, model_name: str = "llama") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import memfit

    build, units, plans = MODELS[model_name]
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plain, batch = build()
    model = copy.deepcopy(plain)
    top, layer = plans(sequence_parallel)
    if top:
        parallelize_module(model, mesh, top)
    for name in units:
        parallelize_module(model.get_submodule(name), mesh, layer)
    prof = memfit.profile(model, batch, units=units, optimizer="adamw", repeat=1)
    sched, lo, hi = _one_plan(prof)
    memfit.apply(model, sched)  # refuses a schedule for another model: the fingerprint is every rank's
    losses, peak, error = _train_beside(model, plain, batch, batch)
    out = {"predicted": sched.predicted_peak_bytes, "measured": peak, "budget": sched.budget_bytes,
           "floor": lo, "plain": hi, "checkpointed": sched.checkpointed, "losses": losses[0], "ref_losses": losses[1],
           "grad_error": error}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (memfit.predict(prof, sched.policies).peak_bytes, peak))  # its own profile
    out["ranks"] = per_rank
    return out


# plain TP 2 is also what --parallel tp and the fit test below run: in the slow set, to keep the suite short.
# GPT-NeoX (Pythia) from its config: a GPT whose blocks add attention and MLP in parallel to the residual
@pytest.mark.parametrize(("model_name", "sequence_parallel"),
                         [pytest.param("llama", False, marks=pytest.mark.slow), ("llama", True), ("gpt-neox", True)],
                         ids=["llama-tp2", "llama-tp2-sp", "gpt-neox-tp2-sp"])
def test_a_user_parallelized_model_plans_per_rank_and_trains_as_one_process(model_name, sequence_parallel):
    got = spawn_ranks(_rank, 2, "cpu", sequence_parallel, model_name)
    assert got["floor"] < got["budget"] < got["plain"] and 0 < len(got["checkpointed"]) < len(MODELS[model_name][1])
    for predicted, measured in got["ranks"]:  # every rank's own peak, under the one plan
        assert abs(predicted - measured) <= TOLERANCE * predicted, got["ranks"]
    assert got["predicted"] <= got["budget"]
    assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5)
    # float tolerance: the sharded products reduce in another order, and AdamW's first step moves a
    # weight by lr whatever the size of its gradient (a near-zero one of the other sign moves it the
    # other way; test_mesh.py); on an AMD EPYC host GPT-NeoX's second-step gradients differ by
    # 1.7e-4, every run, where Intel hosts gave under 1e-4
    assert got["grad_error"] < 1e-3


def _fit_rank(device: str, cache: str) -> dict:
    """memfit.fit called on every rank, as a training script does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import memfit

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model, batch = _llama()
    for name in UNITS:
        parallelize_module(model.get_submodule(name), mesh, _tp_plans(False)[1])
    step = memfit.TrainStep(optimizer="adamw")
    prof = memfit.profile(model, batch, units=UNITS, step=step, repeat=1)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    # budgets that differ by rank ("auto" reads each GPU's free memory): alone, rank 1 would plan nothing
    budget = (lo + hi) // 2 if dist.get_rank() == 0 else 2 * hi
    out: dict = {"policies": [], "refused": []}
    for _ in range(2):  # the second run: rank 0 reads the cache, the others get its plan
        sched = memfit.fit(model, batch, budget, units=UNITS, step=step, repeat=1, cache_dir=cache)
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, memfit.policy.spelt(sched.policies))
        out["policies"].append(seen)
    try:  # below the floor: every rank hears it, none waits for a plan
        memfit.fit(model, batch, lo // 2, units=UNITS, step=step, repeat=1, cache_dir=cache)
    except memfit.MemfitError as exc:
        out["refused"] = [None] * dist.get_world_size()
        dist.all_gather_object(out["refused"], type(exc).__name__)
    return out


def test_fit_on_every_rank_applies_rank_0s_plan_everywhere(tmp_path):
    got = spawn_ranks(_fit_rank, 2, "cpu", str(tmp_path / "cache"))
    first, cached = got["policies"]
    assert first[0] == first[1] == cached[0] == cached[1]
    assert any(p != "none" for p in first[0].values())
    assert got["refused"] == ["InfeasibleBudgetError", "MemfitError"]


def _fsdp_tp_rank(device: str, model_name: str = "llama", sequence_parallel: bool = False) -> dict:
    """FSDP2 over the data-parallel dimension of a 2 x 2 mesh, TP over the other, as torchtitan
    composes them: each data-parallel group trains on its own half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import memfit

    build, units, plans = MODELS[model_name]
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    plain, batch = build()
    dp = mesh["dp"].get_local_rank()
    mine = {k: v[dp:dp + 1] if torch.is_tensor(v) else v for k, v in batch.items()}
    model = copy.deepcopy(plain)
    top, layer = plans(sequence_parallel)
    if top:
        parallelize_module(model, mesh["tp"], top)
    for name in units:
        parallelize_module(model.get_submodule(name), mesh["tp"], layer)
        fully_shard(model.get_submodule(name), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    prof = memfit.profile(model, mine, units=units, optimizer="adamw", repeat=1)
    sched, _, _ = _one_plan(prof)
    memfit.apply(model, sched)
    _, peak, error = _train_beside(model, plain, mine, batch)  # one process: the whole batch, the halves' mean
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (memfit.predict(prof, sched.policies).peak_bytes, peak))
    return {"ranks": per_rank, "checkpointed": sched.checkpointed, "grad_error": error}


@pytest.mark.slow  # four ranks: some 20 s on 2 cores
@pytest.mark.parametrize(("model_name", "sequence_parallel"), [("llama", False), ("gpt-neox", True)],
                         ids=["llama-tp", "gpt-neox-tp-sp"])
def test_fsdp2_times_tp_on_four_ranks_plans_per_rank_and_trains_as_one_process(model_name, sequence_parallel):
    got = spawn_ranks(_fsdp_tp_rank, 4, "cpu", model_name, sequence_parallel)
    assert 0 < len(got["checkpointed"]) < len(MODELS[model_name][1])
    for predicted, measured in got["ranks"]:
        assert abs(predicted - measured) <= TOLERANCE * predicted, got["ranks"]
    assert got["grad_error"] < 1e-3  # as above


LLAMA = """  # a scenario: Hugging Face's Llama, whose config declares its tensor-parallel plan
description = "small Llama for tensor parallelism"
model = "memfit.hf:llama"
parallel = "tp"
[args]
batch = 2
seq = 64
n_layer = 4
hidden = 128
n_head = 4
vocab = 512
intermediate = 384
"""


def test_parallel_tp_shards_by_the_models_own_plan_measured_and_estimated(tmp_path):
    """``--parallel tp``: the ranks apply the Hugging Face config's ``base_model_tp_plan``
    (column-wise q, k, v and MLP inputs, row-wise outputs) with PyTorch's parallel styles; plans
    from rank 0's profile hold on the ranks, gradients are one process's, and estimate mode over
    the fake process group gives the same per-rank model state and peaks within 2%."""
    import memfit
    from memfit.policy import FULL
    from memfit.profiler.estimate import estimate
    from memfit.runtime.harness import measure_steps
    from memfit.scenarios import load_scenario
    from memfit.steps.parallel import measure_ranks, profile_ranks

    (tmp_path / "llama.toml").write_text(LLAMA)
    sc = load_scenario(str(tmp_path / "llama.toml"))
    prof = profile_ranks(sc, parallel="tp", world_size=2, repeat=1)
    assert prof.parallel == {"kind": "tp", "world_size": 2}
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, (lo + hi) // 2)
    assert sched.parallel == prof.parallel and 0 < len(sched.checkpointed) < len(UNITS)
    got = measure_ranks(sc, [sched.policies], parallel="tp", world_size=2)
    assert abs(got["peaks"][0] - sched.predicted_peak_bytes) <= TOLERANCE * sched.predicted_peak_bytes
    model, batch = sc.build("cpu")
    one = measure_steps(model, batch, step=sc.train_step, steps=3)
    assert got["losses"][0] == pytest.approx(one.losses, rel=1e-5)
    for name, grad in one.grads.items():
        assert np.abs(got["grads"][0][name] - grad.numpy()).max() <= 1e-4 * grad.abs().max().item(), name
    # the layers' products hold half their weights on each rank; the embedding and head are whole
    layer = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2) * 4
    rest = sum(p.numel() for p in model.parameters()) * 4 - layer
    assert prof.param_bytes == layer // 2 + rest
    est = estimate(lambda: sc.build("cpu"), target="cpu", parallel="tp", world_size=2, step=sc.train_step,
                   units=sc.units)
    assert est.param_bytes == prof.param_bytes
    for policies in ({}, dict.fromkeys(prof.unit_names, FULL)):
        measured, estimated = memfit.predict(prof, policies).peak_bytes, memfit.predict(est, policies).peak_bytes
        assert abs(estimated - measured) <= TOLERANCE * measured, (policies, estimated, measured)
    # for a GPU, where AdamW would take the foreach kernels, which refuse the mix of sharded
    # (DTensor) layers and whole embedding, norms and head: the single-tensor step, as it must run
    gpu = estimate(lambda: sc.build("cpu"), target="h100", parallel="tp", world_size=2, step=sc.train_step,
                   units=sc.units)
    assert gpu.param_bytes == prof.param_bytes and gpu.parallel == prof.parallel


def test_a_model_without_a_tensor_parallel_plan_is_refused_with_what_to_do():
    import memfit
    from memfit.measure.ranks import tp_plan
    from memfit.zoo import gpt

    with pytest.raises(memfit.MemfitError, match=r"does not declare .*parallelize_module yourself"):
        tp_plan(gpt(batch=1, seq=8, vocab=16, d_model=16, n_head=2, n_layer=1)[0], 2)
    model, _ = _llama()
    with pytest.raises(memfit.MemfitError, match="do not divide among 3 tensor-parallel ranks"):
        tp_plan(model, 3)
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, "layers.*.mlp.down_proj": "local_rowwise"}
    with pytest.raises(memfit.MemfitError, match="uses local_rowwise, which memfit does not apply"):
        tp_plan(model, 2)


def test_a_vocabulary_parallel_embedding_in_a_config_plan_reads_the_token_ids_whole():
    """GPT-NeoX's plan shards its input embedding by vocabulary ("embedding_rowwise"): PyTorch's
    RowwiseParallel on an nn.Embedding, told its input is replicated (by default it reads an input
    sharded on its last dimension, as a Linear's, and all-gathers the token ids: the sequence came
    out twice as long). ``memfit plan --parallel tp`` then plans and validates GPT-NeoX on 2 gloo
    ranks, every rank's peak to the byte (by hand, scenario memfit.hf:gpt_neox)."""
    import memfit
    from memfit.measure.ranks import tp_plan

    model, _ = _neox()
    plan = tp_plan(model, 2)
    embed = plan["gpt_neox.embed_in"]
    assert type(embed).__name__ == "RowwiseParallel" and [type(p).__name__ for p in embed.input_layouts] == [
        "Replicate"]
    assert [type(p).__name__ for p in plan["gpt_neox.layers.*.attention.dense"].input_layouts] == ["Shard"]
    with pytest.raises(memfit.MemfitError, match=r"gpt_neox\.embed_in's 510 vocabulary rows do not divide among 4"):
        tp_plan(_neox_of_vocab(510), 4)


def _neox_of_vocab(vocab: int):
    from memfit import hf

    return hf.gpt_neox(batch=1, seq=8, n_layer=1, hidden=16, n_head=2, vocab=vocab)[0]
