"""Planning per rank under FSDP2 or DDP: the profile is measured in one of N processes that run
the real thing (PyTorch's ``fully_shard`` per unit and on the root, or ``DistributedDataParallel``).

Measuring beats modelling here: a rank's memory holds its shards of parameters, gradients and
optimizer state, the unit parameters FSDP2 all-gathers (and prefetches) in forward and again in
backward, the reduce-scatter buffers, DDP's gradient buckets; all of it is in the per-rank
profile's phases, so the plan is per rank and ``predict`` holds for it (tests/test_parallel.py).
The processes run on the CPU with gloo here, or one per GPU with NCCL.

Under FSDP2 a rank's peak moves from step to step by up to one unit's gathered parameters (the
collectives free their buffers when they finish, on their own threads or streams):
``planning.peak.fsdp_headroom`` says how much to leave (plans keep it free).

Apply the schedule to the model after ``fully_shard`` (or to ``ddp.module``), as the profile was
measured: memfit's regions then open after FSDP2's all-gather hooks, and unit names are the plain
model's (examples/train_fsdp.py). Applied before ``fully_shard`` the gradients are the same, but
the gathered parameters land inside the regions and the peak moves (+7% measured on the test GPT).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.formats.layout import ParallelLayout, describe_layout, layout_of
from memfit.formats.profile import Profile, profile_from_dict
from memfit.measure.ranks import check_clipping, held_by_wrapper, shard
from memfit.policy import KEEP, Policies

TIMEOUT_S = 600


def profile_ranks(scenario: Any, *, parallel: str, world_size: int, tp: int = 1, sequence_parallel: bool = False,
                  repeat: int = 5, granularity: str = "module", device: str = "cpu") -> Profile:
    """The profile of one rank of ``world_size`` running ``scenario`` (a ``memfit.scenarios.Scenario``)
    under ``parallel`` (``tp``: a 2-D mesh with FSDP2, measure/ranks.make_mesh); unit names are the
    plain model's. Spawns the ranks (gloo on the CPU, NCCL on GPUs) and waits at most ``TIMEOUT_S``."""
    layout = layout_of(parallel, world_size, tp, sequence_parallel)
    got = _spawn(_profile_rank, scenario, layout, device, {"repeat": repeat, "granularity": granularity})
    for category, message in got["warnings"]:  # rank 0's, said once, here (every rank would print its own)
        warnings.warn(message, category, stacklevel=2)
    return profile_from_dict(got["profile"], "rank 0's profile")


def measure_ranks(scenario: Any, plans: list[Policies], *, parallel: str, world_size: int, tp: int = 1,
                  sequence_parallel: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Rank 0's measured peak for each plan (policies applied after sharding, as profiled), every
    rank's (``rank_peaks``), and rank 0's losses, gradients and buffers (full tensors) for each, to
    compare with one process."""
    layout = layout_of(parallel, world_size, tp, sequence_parallel)
    return _spawn(_measure_rank, scenario, layout, device, {"plans": plans})


def _spawn(target: Any, scenario: Any, layout: ParallelLayout, device: str, extra: dict[str, Any]) -> Any:
    check_clipping(layout, scenario.train_step.clip_grad_norm)
    return spawn_ranks(target, int(layout["world_size"]), device, scenario, layout, who=describe_layout(layout),
                       **extra)


def spawn_ranks(target: Any, world_size: int, device: str, *args: Any, who: str = "ranks", **kwargs: Any) -> Any:
    """``target(device, *args, **kwargs)`` on ``world_size`` spawned ranks of one process group
    (gloo on the CPU, NCCL on CUDA, ``device`` being each rank's ``cuda:<rank>`` or ``cpu``):
    rank 0's answer, or a MemfitError with the failing rank's traceback. ``target`` must be
    importable (spawned ranks import it), as must its arguments be picklable. Inside
    ``kept_ranks()`` the ranks outlive the call and take the next one's target."""
    if device.startswith("cuda") and torch.cuda.device_count() < world_size:
        raise MemfitError(f"{world_size} ranks need {world_size} GPUs; this machine has {torch.cuda.device_count()}")
    kept = _KEPT.get((world_size, device)) if _KEPT is not None else None
    if kept is not None and not kept.alive():  # a rank was killed from outside: its group cannot serve
        kept.stop(kill=True)
        kept = None
    ranks = kept if kept is not None else _Ranks(world_size, device)
    if _KEPT is not None:
        _KEPT[(world_size, device)] = ranks
    try:
        status, payload = ranks.call(target, args, kwargs, f"the {world_size} {who}")
    except BaseException:  # Ctrl-C, or a rank that died: the ranks' work is no longer wanted
        ranks.stop(kill=True)
        raise
    if status != "ok" or _KEPT is None:  # after a failure the ranks' state is not known: fresh ones next time
        ranks.stop(kill=status != "ok")
    if status == "mistake":
        raise MemfitError(payload)
    if status != "ok":
        raise MemfitError(f"a rank of the {who} failed: {payload}")
    return payload


_KEPT: dict[tuple[int, str], _Ranks] | None = None  # None: each call starts and stops its own ranks


@contextlib.contextmanager
def kept_ranks() -> Iterator[None]:
    """Within it ``spawn_ranks`` starts each world size's ranks once and gives them every later
    call's target in turn (a test suite, a notebook measuring one plan after another): a call then
    costs its work, not the ranks' start (1.7 s for 2 ranks on 2 CPU cores, 2.5 s more where they
    import transformers). A call that fails stops its ranks, whose state is then not known."""
    global _KEPT
    if _KEPT is not None:  # nested: the outer one keeps them
        yield
        return
    _KEPT = {}
    try:
        yield
    finally:
        kept, _KEPT = _KEPT, None
        for ranks in kept.values():
            ranks.stop()


class _Ranks:
    """``world_size`` spawned processes of one process group, each running the targets it is sent."""

    def __init__(self, world_size: int, device: str) -> None:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.lock = threading.Lock()
        self.answers = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, device, self.inboxes[r], self.answers))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], who: str) -> tuple[str, Any]:
        """Rank 0's (status, answer) once every rank has finished, or the first failing rank's; an
        error as soon as a rank dies without one (a script without the ``if __name__ ==
        "__main__":`` guard that spawning needs, say), or after ``TIMEOUT_S``."""
        with self.lock:  # two threads' calls would interleave their targets in the ranks' queues
            return self._call(target, args, kwargs, who)

    def _call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], who: str) -> tuple[str, Any]:
        import queue as queues
        import time

        for inbox in self.inboxes:
            inbox.put((target, args, kwargs))
        deadline, done, answer = time.monotonic() + TIMEOUT_S, 0, ("ok", None)
        while done < len(self.procs):
            if time.monotonic() > deadline:
                raise MemfitError(f"{who} gave no answer within {TIMEOUT_S} s")
            try:
                rank, status, payload = self.answers.get(timeout=1.0)
            except queues.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise MemfitError(f"{who}: a rank exited with code {dead[0]} before answering (in a script, "
                                      "start them under if __name__ == '__main__':)") from None
                continue
            if status != "ok":  # the others may wait in a collective for it: no use waiting for them
                return status, payload
            done += 1
            if rank == 0:
                answer = (status, payload)
        return answer

    def stop(self, *, kill: bool = False) -> None:
        for p, inbox in zip(self.procs, self.inboxes, strict=True):
            if kill:
                p.kill()
            else:
                inbox.put(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def _serve(rank: int, world_size: int, port: int, device: str, inbox: Any, answers: Any) -> None:
    import gc

    import torch.distributed as dist

    # Ctrl-C reaches the whole process group; the parent, which has the terminal, stops the ranks
    # (they would each print a KeyboardInterrupt traceback)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    try:
        while (job := inbox.get()) is not None:
            target, args, kwargs = job
            try:
                result = target(f"cuda:{rank}" if cuda else "cpu", *args, **kwargs)
                answers.put((rank, "ok", result if rank == 0 else None))
            except MemfitError as exc:  # a mistake to say as it is (a model without a tensor-parallel plan, say)
                answers.put((rank, "mistake", str(exc)))
            except Exception as exc:  # reported by the parent, which has the terminal
                answers.put((rank, "error", f"rank {rank}: {type(exc).__name__}: {exc}\n"
                                            f"{traceback.format_exc()[-2000:]}"))
            del job
            gc.collect()  # the last target's model and tensors, before the next one measures
    finally:
        dist.destroy_process_group()


def _built(scenario: Any, layout: ParallelLayout, device: str) -> tuple[nn.Module, nn.Module, Any, list[str]]:
    from memfit.units import find_units

    model, inputs = scenario.build(device)
    names = find_units(model, scenario.units)
    return model, shard(model, names, layout), inputs, names


def _wrapped_names(wrapped: nn.Module, model: nn.Module, names: list[str]) -> list[str]:
    return [f"module.{n}" for n in names] if wrapped is not model else names


def _profile_rank(device: str, scenario: Any, layout: ParallelLayout, *, repeat: int,
                  granularity: str) -> dict[str, Any]:
    from memfit.formats.schedule import model_fingerprint
    from memfit.profiler import profile

    model, wrapped, inputs, names = _built(scenario, layout, device)
    inner = _wrapped_names(wrapped, model, names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = profile(wrapped, inputs, units=inner, step=scenario.train_step, repeat=repeat, granularity=granularity)
    renames = sorted(zip(inner, names, strict=True), key=lambda p: -len(p[0]))  # module.h.10 before module.h.1

    def plain(text: str) -> str:  # in the plain model's unit names
        for wrapped_name, name in renames:
            text = text.replace(wrapped_name, name)
        return text

    said = [(w.category, plain(str(w.message))) for w in caught]  # for the parent to say
    for unit, name in zip(prof.units, names, strict=True):
        unit.name = name
    prof.phases = [dataclasses.replace(p, label=plain(p.label)) for p in prof.phases]
    prof.fingerprint = model_fingerprint(model, names)
    prof.model_class = prof.fingerprint["model_class"]
    prof.parallel = layout
    prof.baseline_bytes += held_by_wrapper(model, layout["kind"])
    prof.source = scenario.source()
    return {"profile": prof.to_dict(), "warnings": said}


def validate_ranks(scenario: Any, schedule: Any, *, device: str = "cpu") -> Any:
    """``runtime.validate.validate`` for a per-rank schedule: the ranks it was planned for run the
    plain and the scheduled step, each rank's peak is measured (the worst is the one judged), and
    rank 0's losses, gradients (full tensors) and buffers are compared (on a GPU against the plain
    step run twice, whose kernels need not repeat bit for bit). Not timed: ranks share this
    machine's cores, and a step's time on them is no one process's."""
    from memfit.runtime.harness import StepRun
    from memfit.steps.validate import Validation, agreement

    layout = schedule.parallel
    repeat = device.startswith("cuda")
    plans = [{}, {}, schedule.policies] if repeat else [{}, schedule.policies]
    got = measure_ranks(scenario, plans, parallel=layout["kind"], world_size=int(layout["world_size"]),
                        tp=int(layout.get("tp", 1)), sequence_parallel=bool(layout.get("sequence_parallel")),
                        device=device)
    runs = [StepRun(losses, {n: None if a is None else torch.from_numpy(a) for n, a in grads.items()},
                    {n: torch.from_numpy(a) for n, a in buffers.items()}, max(peaks))
            for losses, grads, buffers, peaks in zip(got["losses"], got["grads"], got["buffers"], got["rank_peaks"],
                                                     strict=True)]
    nan = float("nan")
    return Validation(
        budget_bytes=schedule.budget_bytes, predicted_peak_bytes=schedule.predicted_peak_bytes,
        measured_peak_bytes=runs[-1].peak_bytes, plain_peak_bytes=runs[0].peak_bytes,
        predicted_overhead=schedule.predicted_overhead, measured_overhead=nan, plain_step_s=nan, step_s=nan,
        edited=schedule.edited, rank_peaks=got["rank_peaks"][-1],
        **agreement(runs[0], runs[-1], runs[1] if repeat else None))


def _measure_rank(device: str, scenario: Any, layout: ParallelLayout, *, plans: list[Policies]) -> dict[str, Any]:
    from memfit.runtime.apply import set_policies
    from memfit.runtime.harness import measure_steps
    from memfit.units import find_units

    out: dict[str, Any] = {"peaks": [], "rank_peaks": [], "losses": [], "grads": [], "buffers": []}
    step = scenario.train_step
    for policies in plans:
        model, inputs = scenario.build(device)
        names = find_units(model, scenario.units)
        wrapped = shard(model, names, layout)
        set_policies(model, {n: policies.get(n, KEEP) for n in names})  # after sharding, as profiled
        # three steps: DDP rebuilds its buckets and FSDP2 initialises lazily in the first ones
        run = measure_steps(wrapped, inputs, step=step, steps=3)
        peak = run.peak_bytes + held_by_wrapper(model, layout["kind"])
        every = [0] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, peak)
        out["peaks"].append(peak)
        out["rank_peaks"].append(every)
        out["losses"].append(run.losses)
        out["grads"].append({n.removeprefix("module."): whole_numpy(g) for n, g in run.grads.items()})
        out["buffers"].append({n: whole_numpy(b) for n, b in model.named_buffers()})
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank of its mesh calls it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def whole_numpy(t: torch.Tensor | None) -> Any:
    """A gradient or buffer, whole (a DTensor's every shard), as numpy for the queue (bfloat16,
    which numpy lacks, widened to float32: exact)."""
    if t is None:
        return None
    full = whole(t).detach().cpu()
    return (full.float() if full.dtype == torch.bfloat16 else full).numpy().copy()
