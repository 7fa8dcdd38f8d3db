"""A segment plan under FSDP2 (2 gloo ranks on the CPU): FSDP2's per-module hooks all-gather
each unit's parameters, which worked only when every unit keeps its own __call__."""

import socket

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import memfit

SEGMENT = "segment:h.1..h.3"
PLANS = [{}, {"h.0": "full", "h.1": SEGMENT, "h.2": SEGMENT, "h.3": SEGMENT}]


def _rank(rank: int, port: int, policies: dict[str, str], queue) -> None:  # type: ignore[no-untyped-def]
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memfit.runtime.apply import set_policies
    from memfit.zoo import gpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model, batch = gpt(batch=2, seq=16, vocab=128, d_model=32, n_head=2, n_layer=4, dropout=0.0, seed=0)
        set_policies(model, {f"h.{i}": policies.get(f"h.{i}", "none") for i in range(4)})  # before sharding
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = memfit.default_loss(model(**batch))
        loss.backward()
        grads = {n: p.grad.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}
        if rank == 0:
            queue.put((loss.item(), grads))
    finally:
        dist.destroy_process_group()


def _run(policies: dict[str, str]):  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, policies, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_segment_plan_under_fsdp2_gives_the_plain_gradients():
    plain_loss, plain = _run(PLANS[0])
    loss, grads = _run(PLANS[1])
    assert loss == plain_loss
    assert grads.keys() == plain.keys()
    assert all(np.array_equal(grads[k], plain[k]) for k in plain)
