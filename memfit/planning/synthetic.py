"""Synthetic chain profiles: random but physically consistent, for solver tests and benchmarks."""

from __future__ import annotations

import random

from memfit.formats.profile import OptionCost, Phase, Profile, UnitProfile
from memfit.policy import FULL, KEEP, Children


def random_profile(n: int, seed: int, *, chain: bool = True, scale: int = 1, fine: int = 0,
                   frees: bool = False, late: bool = False, tail: bool = False, holds: bool = False,
                   keeps: bool = False) -> Profile:
    """A synthetic chain profile with integer bytes (times ``scale``), for solver checks against
    brute force and for timing the solvers. As in a real step, each unit's net change (its
    gradients) is the same whether it is checkpointed. ``fine`` finer options per unit
    (``child:c0`` …), each keeping between what ``full`` and ``none`` keep, at a cost between
    theirs. ``frees``: checkpointing a unit lets the remainder after it free part of its output
    (``freed_after_bytes``, as ``x = x + block(x)`` does), which its kept backward would free; in a
    chain only the last unit's output can go so (the others are the next units' inputs). ``late``:
    checkpointed, each unit but the last keeps one more output until the next unit's forward has
    run (``freed_later_bytes``, as GPT-Neo's attention probabilities), which its kept backward
    saves. ``tail``: the last unit's finer options lower the peak of the remainder right after its
    forward, the head's and the loss's (``after_peak_bytes``, as its ``derive``'s tail does), and
    no gap lies between them. ``holds``: each unit's first finer option keeps no tensor made
    outside the units (``holds_outside`` False, as ``derive``), and the remainders peak higher in
    the checkpointed step (``ckpt_peak_bytes``, as where checkpoints keep a mask the blocks share).
    ``keeps``: checkpointed, each unit but the first keeps its input, which the plain step frees in
    the remainder after it (``freed_after_bytes`` negative, as BERT's blocks under autocast), and
    frees it with its backward."""
    r = random.Random(seed)
    rr = random.Random(seed + 2 * 10**6)
    rf = random.Random(seed + 10**6)  # its own stream: profiles without finer options stay as they were
    rl = random.Random(seed + 3 * 10**6)  # the same for late frees
    rk = random.Random(seed + 6 * 10**6)  # and for inputs a checkpoint keeps
    units, phases = [], [Phase("pre", None, "remainder", r.randint(0, 50), r.randint(0, 50), r.randint(50, 60))]
    for i in range(n):
        a = r.randint(10, 100)
        s = r.randint(1, a)
        grads = r.randint(0, 10)
        units.append(
            UnitProfile(
                f"u{i}", r.uniform(0.001, 0.01), 0.01, s, a, grads,
                {
                    KEEP: OptionCost(a + r.randint(0, 30), a, r.randint(0, 40), grads - a, 0.0),
                    FULL: OptionCost(s + r.randint(0, 30), s, a + r.randint(0, 40), grads - s,
                                       r.randint(1, 1000) * 1e-6),
                },
                output_bytes=r.randint(1, s),
            )
        )
        full = units[-1].options[FULL]
        if frees and (i == n - 1 or not chain):  # in a chain, outputs live on as the next inputs
            full.freed_after_bytes = rr.randint(0, s)
            full.bwd_end_bytes += full.freed_after_bytes
        if keeps and i > 0:
            full.freed_after_bytes = -rk.randint(1, units[-2].output_bytes)
            full.bwd_end_bytes += full.freed_after_bytes
        if late and i < n - 1:
            full.freed_later_bytes = rl.randint(0, a - s)
            full.stored_bytes += full.freed_later_bytes
            full.fwd_peak_bytes += full.freed_later_bytes
        for m in range(fine):
            kept = rf.randint(s, a)
            freed = rr.randint(0, full.freed_after_bytes)
            units[-1].options[Children.of(f"c{m}")] = OptionCost(
                kept + rf.randint(0, 30), kept, rf.randint(0, a - kept + 40), grads - kept + freed,
                full.recompute_s * rf.uniform(0.1, 1.0), freed_after_bytes=freed)
        phases.append(Phase(f"forward u{i}", i, "forward"))
        phases.append(Phase(f"gap{i}", None, "remainder", r.randint(0, 5), 0, 0))
    phases.append(Phase("head", None, "remainder", r.randint(0, 80), r.randint(-10, 10), r.randint(-10, 10)))
    if tail:
        del phases[-2]
        rt = random.Random(seed + 4 * 10**6)
        for k, o in units[-1].options.items():
            if k not in (KEEP, FULL):
                o.after_peak_bytes = -rt.randint(0, phases[-1].peak_bytes)
    for i in reversed(range(n)):
        phases.append(Phase(f"backward u{i}", i, "backward"))
    phases.append(Phase("step", None, "remainder", r.randint(0, 80), 0, 0))
    phases[0].ckpt_end_bytes = max(phases[0].ckpt_end_bytes, phases[0].end_bytes)
    if holds:
        rh = random.Random(seed + 5 * 10**6)
        for u in units:
            first = next((o for k, o in u.options.items() if k not in (KEEP, FULL)), None)
            if first is not None:
                first.holds_outside = False
        for ph in phases:
            if ph.unit is None:
                ph.ckpt_peak_bytes = ph.peak_bytes + rh.randint(0, 30)
    if scale != 1:
        for ph in phases:
            ph.peak_bytes, ph.end_bytes, ph.ckpt_end_bytes = (v * scale for v in (ph.peak_bytes, ph.end_bytes,
                                                                                  ph.ckpt_end_bytes))
            if ph.ckpt_peak_bytes is not None:
                ph.ckpt_peak_bytes *= scale
        for u in units:
            u.input_bytes, u.saved_bytes, u.output_bytes = (v * scale for v in (u.input_bytes, u.saved_bytes,
                                                                                u.output_bytes))
            for o in u.options.values():
                (o.fwd_peak_bytes, o.stored_bytes, o.bwd_peak_bytes, o.bwd_end_bytes, o.freed_after_bytes,
                 o.freed_later_bytes) = (v * scale for v in (o.fwd_peak_bytes, o.stored_bytes, o.bwd_peak_bytes,
                                                             o.bwd_end_bytes, o.freed_after_bytes, o.freed_later_bytes))
    return Profile("Synthetic", "cpu", "adamw", "", 100 * scale, 0, 0, 0, 0, 0, 0.1, units, phases,
                   {"model_class": "Synthetic", "units": [u.name for u in units], "params_sha256": "0"},
                   chain=chain)
