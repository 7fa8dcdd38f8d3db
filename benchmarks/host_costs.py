"""The host's time per op that estimate mode charges (a device spec's ``launch_us``, ``hook_us`` and
``dispatch_us``; docs/devices.md), measured on the machine it runs on, printed as spec lines:

    python benchmarks/host_costs.py                 # ~1 min; 31 rounds
    python benchmarks/host_costs.py --rounds 61 --device cuda   # on a GPU's host

One block of a tiny GPT (d 32, 16 tokens: ops of a few µs, launch-bound), forward and backward,
one thread, in five configurations built at once and timed interleaved (``measure.timing.alternate``:
each timed repetition after an untimed one of its own, order reversed every round, GC held off),
by thread CPU time (wall time on CUDA, whose host waits on the device), medians over the rounds:

- ``plain`` and ``plain (A/A)``: the block as it is, twice: the second is the series' noise;
- ``hooks``: the block under identity ``saved_tensors_hooks`` (a Python call per saved tensor: what
  ``derive`` and checkpoint regions pay);
- ``checkpoint``: ``torch.utils.checkpoint`` (``use_reentrant=False``) around the block;
- ``SAC``: the same with PyTorch's selective checkpoint for memfit's ``gemm`` op set (two Python
  dispatch modes, forward and recomputation).

``launch_us`` is the plain step's time per ATen op (kernels included: an upper bound for a GPU's
launch); ``hook_us`` the hooks' extra time per saved tensor; ``dispatch_us`` SAC's extra over the
plain checkpoint per op its modes see (counted under a counting mode: the forward's ops and the
recomputation's, views included, by a mode above them).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from launch_bound import _Count  # the ATen ops a call runs
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from memfit import zoo
from memfit.measure.timing import alternate
from memfit.runtime.op_sets import OP_SETS, keep


class _Both:
    """Two contexts entered in order, left in reverse."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def _ops(run: Any) -> int:
    with _Count() as count:
        run()
    return count.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=31, help="interleaved rounds (default 31)")
    ap.add_argument("--reps", type=int, default=10, help="forward+backward passes per timed step (default 10)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = zoo.gpt(batch=2, seq=16, vocab=64, d_model=32, n_head=2, n_layer=2, dropout=0.0)
    block = model.h[0].to(args.device)
    x = torch.randn(2, 16, 32, device=args.device, requires_grad=True)
    policy = functools.partial(keep, OP_SETS["gemm"])
    saved = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    def plain() -> None:
        block(x).sum().backward()

    def hooks() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            block(x).sum().backward()

    def full() -> None:
        checkpoint(block, x, use_reentrant=False).sum().backward()

    def sac() -> None:
        checkpoint(block, x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(policy)).sum().backward()

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        block(x).sum().backward()
    plain_ops, sac_ops = _ops(plain), _ops(sac)
    seen = _Count()  # above SAC's modes: the ops they are handed, not what they call themselves

    def counted() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(policy)
        return _Both(forward, seen), _Both(recompute, seen)

    checkpoint(block, x, use_reentrant=False, context_fn=counted).sum().backward()
    configs = {"plain": plain, "plain (A/A)": plain, "hooks": hooks, "checkpoint": full, "SAC": sac}

    names = list(configs)
    cuda = args.device == "cuda"

    def timed(k: int) -> float:
        clock = time.perf_counter if cuda else time.thread_time  # a CUDA host waits on the device
        start = clock()
        for _ in range(args.reps):
            configs[names[k]]()
        if cuda:
            torch.cuda.synchronize()
        return (clock() - start) / args.reps

    rows = alternate(timed, len(names), args.rounds)
    med = {k: statistics.median(v) for k, v in zip(names, rows, strict=True)}
    print(f"{args.device}, {args.rounds} rounds: a GPT block's forward and backward, {plain_ops} ops, "
          f"{saved} saved tensors; {seen.n} ops pass SAC's modes (SAC step: {sac_ops} ops)")
    for k, v in med.items():
        print(f"  {k:12s} {v * 1e6:9.1f} µs  {(v / med['plain'] - 1) * 100:+6.1f}%")
    launch = med["plain"] / plain_ops
    hook = (med["hooks"] - med["plain"]) / saved
    dispatch = (med["SAC"] - med["checkpoint"]) / seen.n
    print("# device spec lines (docs/devices.md); the A/A row is the noise of each figure")
    print(f"launch_us = {launch * 1e6:.1f}\nhook_us = {hook * 1e6:.1f}\ndispatch_us = {dispatch * 1e6:.1f}")


if __name__ == "__main__":
    main()
