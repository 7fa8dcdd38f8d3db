"""A segment plan under FSDP2 (2 gloo ranks on the CPU): FSDP2's per-module hooks all-gather
each unit's parameters, which worked only when every unit keeps its own __call__."""

import numpy as np
import pytest
import torch.distributed as dist

import memfit
from memfit.policy import FULL, KEEP, Policies, Segment
from memfit.steps.parallel import spawn_ranks

SEGMENT = Segment("h.1", "h.3")
PLANS = [{}, {"h.0": FULL, "h.1": SEGMENT, "h.2": SEGMENT, "h.3": SEGMENT}]


def _rank(device: str, policies: Policies):  # type: ignore[no-untyped-def]
    """One of two gloo ranks (memfit.steps.parallel.spawn_ranks): the plan applied before sharding."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memfit.runtime.apply import set_policies
    from memfit.zoo import gpt

    mesh = init_device_mesh(device, (2,))
    model, batch = gpt(batch=2, seq=16, vocab=128, d_model=32, n_head=2, n_layer=4, dropout=0.0, seed=0)
    set_policies(model, {f"h.{i}": policies.get(f"h.{i}", KEEP) for i in range(4)})  # before sharding
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = memfit.default_loss(model(**batch))
    loss.backward()
    return loss.item(), {n: p.grad.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}


def _run(policies: dict[str, str]):  # type: ignore[no-untyped-def]
    return spawn_ranks(_rank, 2, "cpu", policies)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_segment_plan_under_fsdp2_gives_the_plain_gradients():
    plain_loss, plain = _run(PLANS[0])
    loss, grads = _run(PLANS[1])
    assert loss == plain_loss
    assert grads.keys() == plain.keys()
    assert all(np.array_equal(grads[k], plain[k]) for k in plain)


def _rank_shapes(device: str):  # type: ignore[no-untyped-def]
    """A schedule for two lengths applied after sharding, as examples/train_fsdp.py applies one,
    trained on both lengths in turn beside a plain sharded copy."""
    import copy
    import dataclasses

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memfit.formats.schedule import Schedule, model_fingerprint
    from memfit.measure.inputs import Inputs
    from memfit.runtime.apply import is_checkpointed
    from memfit.zoo import gpt

    mesh = init_device_mesh(device, (2,))
    model, batch = gpt(batch=2, seq=16, vocab=128, d_model=32, n_head=2, n_layer=4, dropout=0.0, seed=0)
    short = {k: v[:, :8].contiguous() for k, v in batch.items()}
    names = [f"h.{i}" for i in range(4)]
    plans = [Schedule({n: KEEP for n in names}, 2**40, 0, 0.0, 0.0, "test", "none", "none", 0.0,
                      model_fingerprint(model, names), input_shapes=Inputs.of(x).describe(), source={"seq_len": n})
             for x, n in ((short, 8), (batch, 16))]
    plans[1].policies = {"h.0": FULL, "h.1": SEGMENT, "h.2": SEGMENT, "h.3": SEGMENT}
    schedule = dataclasses.replace(plans[1], shapes=plans)
    plain = copy.deepcopy(model)
    for m in (model, plain):
        for block in m.h:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    memfit.apply(model, schedule)
    out = []
    for x in (batch, short, batch, short):
        losses = []
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            loss = memfit.default_loss(m(**x))
            loss.backward()
            losses.append(loss.item())
        same = all(torch.equal(p.grad.full_tensor(), q.grad.full_tensor())
                   for p, q in zip(plain.parameters(), model.parameters(), strict=True))
        out.append((losses[0] == losses[1], same, [is_checkpointed(b) for b in model.h]))
    return out


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_a_schedule_for_two_lengths_switches_plans_under_fsdp2():
    steps = spawn_ranks(_rank_shapes, 2, "cpu")
    assert [tuple(s[:2]) for s in steps] == [(True, True)] * 4  # losses and gradients the plain ones
    assert [s[2] for s in steps] == [[True] * 4, [False] * 4] * 2  # the long length's plan, then the short's
