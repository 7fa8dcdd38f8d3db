"""Models cut into pipeline stages as torchtitan cuts its own: each stage a copy of the model with
the layers of other stages removed, the embeddings on the first stage, the final norm and an untied
head on the last (tied weights cannot span two ranks). A GPT of memfit.zoo's blocks, and Hugging
Face's Llama from a config, whose stages run its decoder layers as LlamaModel.forward does (rotary
embeddings and the causal mask made on every stage)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from memfit.zoo import GPTBlock, NanoBlock


class PipelinedGPT(nn.Module):
    """``written_out``: nanoGPT's blocks (q.k^T, a mask buffer, softmax, .v as ops of their own),
    a model memfit was not shaped around, instead of SDPA's."""

    def __init__(self, vocab: int = 512, seq: int = 64, d_model: int = 64, n_head: int = 4, n_layer: int = 4,
                 written_out: bool = False) -> None:
        super().__init__()
        self.wte: nn.Module | None = nn.Embedding(vocab, d_model)
        self.wpe: nn.Module | None = nn.Embedding(seq, d_model)
        self.layers = nn.ModuleDict({str(i): NanoBlock(d_model, n_head, seq, 0.0) if written_out
                                     else GPTBlock(d_model, n_head, 0.0) for i in range(n_layer)})
        self.norm: nn.Module | None = nn.LayerNorm(d_model)
        self.output: nn.Module | None = nn.Linear(d_model, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None and self.wpe is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None and self.output is not None:
            x = self.output(self.norm(x))
        return x


def stages_of(model: PipelinedGPT, n: int) -> list[PipelinedGPT]:
    """``n`` stages of ``model``'s layers, split evenly, each a deep copy holding its share."""
    names = list(model.layers)
    per = len(names) // n
    out = []
    for s in range(n):
        stage = copy.deepcopy(model)
        keep = set(names[s * per:(s + 1) * per])
        for name in names:
            if name not in keep:
                del stage.layers[name]
        if s > 0:
            stage.wte = stage.wpe = None
        if s < n - 1:
            stage.norm = stage.output = None
        out.append(stage)
    return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def built(kind: str, n_layer: int, seq: int) -> tuple[nn.Module, int]:
    """The whole model of ``kind`` ("gpt", "nanogpt" or "llama") and its vocabulary, seeded."""
    torch.manual_seed(0)
    if kind in ("gpt", "nanogpt"):
        return PipelinedGPT(seq=seq, n_layer=n_layer, written_out=kind == "nanogpt"), 512
    from memfit.hf import llama

    model, _ = llama(n_layer=n_layer, hidden=64, n_head=4, vocab=512, seq=seq, tied=False)
    return model, 512


def cut(kind: str, model: nn.Module, n: int) -> list[nn.Module]:
    if kind in ("gpt", "nanogpt"):
        return stages_of(model, n)
    from memfit.hf import decoder_stages

    return decoder_stages(model, n)


def whole_logits(kind: str, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(idx) if kind in ("gpt", "nanogpt") else model(input_ids=idx).logits


def plain_name(kind: str, stage_name: str) -> str:
    """A stage parameter's name in the whole model (under a rank's ModuleDict of stages, less
    the stage's index)."""
    head, _, rest = stage_name.partition(".")
    if head.isdigit() and rest.startswith(("layers.", "wte.", "wpe.", "norm.", "output.", "embed_tokens.", "lm_head.")):
        stage_name = rest
    if kind in ("gpt", "nanogpt"):
        return stage_name
    head, _, rest = stage_name.partition(".")
    return stage_name if head == "lm_head" else f"model.{stage_name}"


def run_rank(device: str, schedule: str, n_stages: int, microbatches: int, plans: list, batch: int = 8,
             seq: int = 64, n_layer: int = 4, kind: str = "gpt") -> dict:
    """On each of ``n_stages`` gloo ranks, one stage of a model of ``kind`` under
    ``torch.distributed.pipelining``'s ``schedule``, with ``plans[rank]`` (a memfit Schedule, or
    None) applied to the stage: its gradients and loss after one step without the optimizer, then
    its measured peak (memfit's CPU meter, over the tensors alive at the step's start) in its
    third step, an optimizer's included. Every rank's answer, gathered on rank 0."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    import memfit
    from memfit.measure.memory import measured

    rank = dist.get_rank()
    model, vocab = built(kind, n_layer, seq)
    idx = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, seq))
    mods = cut(kind, model, n_stages)
    mine = [s for s in range(n_stages) if s % dist.get_world_size() == rank]  # two a rank when interleaved
    stage_mod = mods[rank] if len(mine) == 1 else nn.ModuleDict({str(s): mods[s] for s in mine})
    if plans[rank] is not None:
        memfit.apply(stage_mod, plans[rank])
    stages = [PipelineStage(mods[s], s, n_stages, torch.device(device)) for s in mine]
    sched = get_schedule_class(schedule)(stages[0] if len(mine) == 1 else stages, microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3)
    first, last = 0 in mine, n_stages - 1 in mine
    losses: list[torch.Tensor] = []

    def pipeline_step() -> None:
        losses.clear()
        kwargs = {"target": tgt, "losses": losses} if last else {}
        sched.step(*([idx] if first else []), return_outputs=False, **kwargs)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipeline_step()
        opt.step()

    def static() -> list[torch.Tensor]:
        held = [*stage_mod.parameters(), *stage_mod.buffers(), *[v for s in opt.state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor)]]
        for stage in stages:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                held += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
        return held + ([idx] if first else []) + ([tgt] if last else [])

    pipeline_step()
    grads = {n: p.grad.detach().clone() for n, p in stage_mod.named_parameters() if p.grad is not None}
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    step()
    _, peak, _ = measured(step, static)
    out = {"rank": rank, "peak": peak, "loss": loss, "grads": {n: g.numpy() for n, g in grads.items()}}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}


def plain_grads(batch: int = 8, seq: int = 64, n_layer: int = 4,
                kind: str = "gpt") -> tuple[float, dict[str, torch.Tensor]]:
    """The unparallelized model's loss and gradients on the whole batch of ``run_rank``."""
    model, vocab = built(kind, n_layer, seq)
    idx = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, seq))
    loss = loss_fn(whole_logits(kind, model, idx), tgt)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def stage_profiles(schedule: str, n_stages: int, microbatches: int, batch: int = 8, seq: int = 64,
                   n_layer: int = 4, repeat: int = 3, kind: str = "gpt") -> list:
    """Each rank's profile of the same run as ``run_rank``'s, measured in this one process."""
    from memfit.steps.stages import profile_stages

    model, vocab = built(kind, n_layer, seq)
    idx = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, seq))
    return profile_stages(cut(kind, model, n_stages), idx, tgt, loss_fn, schedule=schedule,
                          microbatches=microbatches, units="layers.*", repeat=repeat,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def run_mesh_rank(device: str, schedule: str, n_stages: int, microbatches: int, layout: dict, plans: list,
                  batch: int = 8, seq: int = 64, n_layer: int = 4) -> dict:
    """Hugging Face's Llama in ``n_stages`` pipeline stages, each stage held by ``layout``'s ranks
    (FSDP2 shards, tensor-parallel ranks, or both), sharded by memfit's own ``shard`` on the
    ``("dp_shard", "tp")`` part of a ``("pp", "dp_shard", "tp")`` mesh, as torchtitan builds its PP x
    FSDP x TP mesh; ``plans[pp rank]`` (a memfit Schedule, or None) applied after the sharding.
    Every rank runs the same batch (so the gradients reduced over the data-parallel shards are
    one process's). Each rank's first-step gradients, made whole, and its peak in the third step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.tensor import DTensor

    import memfit
    from memfit.measure.memory import measured
    from memfit.measure.ranks import pipeline_mesh, shard
    from memfit.units import find_units

    pp = dist.get_world_size() // int(layout["world_size"])
    mesh, within = pipeline_mesh(layout, pp, device)
    pp_rank = mesh["pp"].get_local_rank()
    model, vocab = built("llama", n_layer, seq)
    idx = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, seq))
    mods = cut("llama", model, n_stages)
    mine = [s for s in range(n_stages) if s % pp == pp_rank]
    for s in mine:
        shard(mods[s], find_units(mods[s], "layers.*"), layout, within, pipeline=True)
    stage_mod = mods[mine[0]] if len(mine) == 1 else nn.ModuleDict({str(s): mods[s] for s in mine})
    if plans[pp_rank] is not None:
        memfit.apply(stage_mod, plans[pp_rank])
    pipe = [PipelineStage(mods[s], s, n_stages, torch.device(device), group=mesh["pp"].get_group()) for s in mine]
    sched = get_schedule_class(schedule)(pipe[0] if len(mine) == 1 else pipe, microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3, foreach=False)
    first, last = 0 in mine, n_stages - 1 in mine

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        sched.step(*([idx] if first else []), return_outputs=False, **({"target": tgt} if last else {}))
        opt.step()

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def static() -> list[torch.Tensor]:
        held = [local(t) for t in [*stage_mod.parameters(), *stage_mod.buffers(),
                                   *[v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]]]
        for stage in pipe:
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                held += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
        return held + ([idx] if first else []) + ([tgt] if last else [])

    opt.zero_grad(set_to_none=True)
    sched.step(*([idx] if first else []), return_outputs=False, **({"target": tgt} if last else {}))
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone().numpy()
             for n, p in stage_mod.named_parameters() if p.grad is not None}
    step()
    _, peak, _ = measured(step, static)
    out = {"rank": dist.get_rank(), "pp": pp_rank, "peak": peak, "grads": grads}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    return {"ranks": gathered}
