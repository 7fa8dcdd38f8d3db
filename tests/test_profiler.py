"""The profiler's figures are measured facts: byte counts checked by hand and by MemTracker."""

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit.formats.profile import profile_from_dict
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss, training_step
from memfit.policy import FULL, KEEP
from memfit.profiler.saved import unit_facts
from memfit.runtime.harness import measure_steps
from memfit.units import find_units

from .conftest import kw_net, plain_state, tiny_gpt


def test_cpu_meter_agrees_with_memtracker():
    """Two independent ways of counting live CPU tensors give the same step peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, batch = tiny_gpt()
    ours = measure_steps(model, batch).peak_bytes
    state = StepState(memfit.TrainStep(), model)
    inp = Inputs.of(batch)
    torch.manual_seed(0)
    state.zero_grad()
    training_step(model, inp, default_loss, state)
    state.zero_grad()
    tracker = MemTracker()
    tracker.track_external(model, state.optimizer, *inp.tensors())
    with tracker:
        training_step(model, inp, default_loss, state)
    assert ours == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_cpu_meter_counts_no_free_of_a_block_made_before_it():
    """The allocator keeps a block's size while a profiler runs and forgets to drop it when none
    does: a block later made at that address (no profiler) was freed at the old size. That read a
    contrastive step's profile 44 KiB low at random in CI; the meter counts only frees of blocks
    it saw made."""
    from memfit.measure.memory import memory_recorder

    cpu = torch.device("cpu")
    stale = None
    for _ in range(20):  # find a block at the address of one made while a profiler ran
        with memory_recorder(cpu):
            # each freed block sits above a guard still held, so it cannot merge with a free
            # block below it (the profiler frees its own buffers on stopping) and start lower
            pairs = [(torch.empty(1000), torch.empty(1000)) for _ in range(8)]
        guards = [guard for guard, _ in pairs]
        addresses = {first.data_ptr() for _, first in pairs}
        del pairs
        held = [torch.empty(n) for n in range(999, 99, -7)]
        stale = next((t for t in held if t.data_ptr() in addresses), None)
        del held
        if stale is not None:
            break
    assert stale is not None and stale.numel() != 1000
    recorder = memory_recorder(cpu)
    with recorder:
        recorder.on_mark("start")
        del stale
        kept = torch.empty(10)
        recorder.on_mark("end")
    assert [(m.level, m.peak) for m in recorder.marks()] == [(0, 0), (40, 40)]
    assert kept.numel() == 10 and len(guards) == 8


def test_cpu_meter_counts_the_frees_of_the_tensors_it_is_told_are_alive():
    """A step function's gradients, made before the recording (the allocator reports no free of
    them), go at its zero_grad: their bytes leave the level there, as on a GPU."""
    from memfit.measure.memory import measured

    grads = [torch.zeros(1000), torch.zeros(500)]
    kept = torch.zeros(250)

    def step() -> torch.Tensor:
        grads.clear()  # zero_grad(set_to_none=True)
        return torch.zeros(100)

    out, peak, _ = measured(step, lambda: [*grads, kept])
    # 7000 bytes static, 6000 of them freed, then 400 made: the peak is where the step started
    assert out.numel() == 100 and peak == 7000 and not grads
    out, peak, _ = measured(lambda: torch.zeros(2000), lambda: [kept])  # nothing freed: static + rise
    assert peak == 1000 + 8000


def test_cpu_meter_hears_blocks_a_collective_frees_on_another_thread():
    """The profiler hears no free made on a thread it does not run in, and gloo's collectives free
    their input's copy on a worker thread, at random after the call returned: that read a 2-rank
    FSDP profile 10 MiB high in CI. A block made inside a ``c10d::`` op and never heard to go went
    when the op returned; a block made elsewhere went when a new one took its address."""
    import threading

    from memfit.measure.memory import memory_recorder

    def free_elsewhere(box: list[torch.Tensor]) -> None:
        worker = threading.Thread(target=box.clear)
        worker.start()
        worker.join()

    recorder = memory_recorder(torch.device("cpu"))
    with recorder:
        recorder.on_mark("start")
        box = [torch.empty(1000)]
        with torch.profiler.record_function("c10d::stand_in"):  # as gloo's reduce-scatter: a copy
            box.append(box[0].clone())
        free_elsewhere([box.pop()])
        recorder.on_mark("after the collective")
        box.clear()
        recorder.on_mark("end")
    assert [(m.label, m.level, m.peak) for m in recorder.marks()] == [
        ("start", 0, 0), ("after the collective", 4000, 8000), ("end", 0, 4000)]


def test_cpu_meter_drops_a_block_freed_unheard_when_its_address_is_taken_again():
    """A block made outside a collective and freed on another thread went, at the latest, when a
    new block took its address: the level counts the new block once, not both. (Events written
    out: which address the allocator hands out next is its own affair.)"""
    from memfit.measure.memory import _ALLOC, _FREE, _MARK, marks_of

    def mark(t: int, label: str) -> tuple[int, int, int, int, str, int]:
        return (t, _MARK, 0, 0, label, 0)

    events = [mark(0, "start"), (1, _ALLOC, 0xA0, 4000, "", 0), mark(2, "freed elsewhere"),  # no free heard
              (3, _ALLOC, 0xB0, 1000, "", 0), (4, _ALLOC, 0xA0, 2000, "", 0), mark(5, "end"),
              (6, _FREE, 0xA0, -2000, "", 0), (7, _FREE, 0xB0, -1000, "", 0), mark(8, "done")]
    assert [(m.label, m.level, m.peak) for m in marks_of(events, {})] == [
        ("start", 0, 0), ("freed elsewhere", 4000, 4000), ("end", 3000, 5000), ("done", 0, 3000)]


NEEDS_GLOO = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _reduce_scatter_levels(device: str, rounds: int) -> list[int]:
    """Rank code: the meter's level after each of ``rounds`` reduce-scatters of a fresh tensor."""
    import torch.distributed as dist

    from memfit.measure.memory import memory_recorder

    out = torch.empty(1 << 18)
    recorder = memory_recorder(torch.device(device))
    with recorder:
        recorder.on_mark("start")
        for i in range(rounds):
            x = torch.randn((1 << 19) + i)
            dist.reduce_scatter_single(out, x[: 1 << 19])
            del x
            recorder.on_mark(f"round {i}")
    return [m.level for m in recorder.marks()]


@NEEDS_GLOO
def test_cpu_meter_level_returns_after_every_gloo_reduce_scatter():
    """On 2 real gloo ranks, a tenth of the copies went unheard before (the level climbed 2 MiB
    at each); every round now ends where it started."""
    from memfit.steps.parallel import spawn_ranks

    assert spawn_ranks(_reduce_scatter_levels, 2, "cpu", 60) == [0] * 61


def _functional_levels(device: str, rounds: int) -> list[int]:
    """Rank code: the meter's level after each of ``rounds`` functional all-gathers and all-reduces
    (DTensor's redistributions) of a fresh tensor, their outputs used and dropped at once."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from memfit.measure.memory import memory_recorder

    recorder = memory_recorder(torch.device(device))
    with recorder:
        recorder.on_mark("start")
        for i in range(rounds):
            x = torch.randn((1 << 16) + 64 * i)
            y = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
            z = funcol.all_reduce(y * 2, "sum", dist.group.WORLD)
            del x, y
            float(z.sum())
            del z
            recorder.on_mark(f"round {i}")
    return [m.level for m in recorder.marks()]


@NEEDS_GLOO
def test_cpu_meter_level_returns_after_every_functional_collective():
    """A functional collective's work holds its input and output until gloo's worker thread lets
    it go, which may be after the caller dropped them: the free then goes unheard. Before the
    meter placed such frees after the block's last use, the level climbed by 0.25 to 1.8 MiB in
    each of 3 runs of these 60 rounds (it counted each block until its address was taken again);
    each round now ends where it started."""
    from memfit.steps.parallel import spawn_ranks

    assert spawn_ranks(_functional_levels, 2, "cpu", 60) == [0] * 61


def test_cpu_meter_places_an_unheard_free_after_the_blocks_last_use():
    """Events written out: a block whose free went unheard went at the end of the last op that took
    it as an input (before a new block took its address); one made inside a collective, or used,
    and never heard to go went then too, unless a tensor alive at the recording's end is on it."""
    from memfit.measure.memory import _ALLOC, _FREE, _MARK, _with_unseen_frees, marks_of

    def mark(t: int, label: str) -> tuple[int, int, int, int, str, int]:
        return (t, _MARK, 0, 0, label, 0)

    events = [mark(0, "start"), (1, _ALLOC, 0xA0, 4000, "", 0), mark(3, "used"),  # last used 2..4
              mark(5, "after its use"), (6, _ALLOC, 0xB0, 1000, "", 7),  # a collective's output
              (8, _ALLOC, 0xC0, 500, "", 9), mark(11, "end"), (12, _FREE, 0xC0, -500, "", 0),
              (13, _ALLOC, 0xA0, 2000, "", 0), (14, _FREE, 0xA0, -2000, "", 0), mark(15, "done")]
    uses = {0xA0: [(2, 4)], 0xB0: [(9, 10)]}
    got = marks_of(_with_unseen_frees(events, uses, live=set()), {})
    assert [(m.label, m.level, m.peak) for m in got] == [
        ("start", 0, 0), ("used", 4000, 4000), ("after its use", 0, 4000), ("end", 500, 1500),
        ("done", 0, 2000)]
    # the collective's output is still alive at the end (a gradient, say): it stays counted
    got = marks_of(_with_unseen_frees(events, uses, live={0xB0}), {})
    assert [(m.label, m.level) for m in got][-2:] == [("end", 1500), ("done", 1000)]
    # a block made outside a collective, used, never heard to go and not alive: gone after its use
    events = [mark(0, "start"), (1, _ALLOC, 0xD0, 3000, "", 0), mark(4, "used"), mark(6, "end")]
    for live, level in ((set(), 0), ({0xD0}, 3000)):
        got = marks_of(_with_unseen_frees(events, {0xD0: [(2, 5)]}, live), {})
        assert [(m.label, m.level) for m in got] == [("start", 0), ("used", 3000), ("end", level)]


def test_meters_hold_the_collector_off():
    """No collection inside a measured step frees an earlier step's cycles (CUDA's figures would see
    it, and the step would pay its time), however much the step allocates."""
    import gc
    import weakref

    from memfit.measure.memory import memory_recorder

    class Node:
        pass

    node = Node()
    node.me, node.t = node, torch.zeros(1000)
    alive = weakref.ref(node)
    del node
    assert gc.isenabled() and alive() is not None
    with memory_recorder(torch.device("cpu")):
        churn = [[i] for i in range(100_000)]  # far past the youngest generation's threshold
        assert alive() is not None and not gc.isenabled()
    del churn
    assert gc.isenabled()
    gc.collect()
    assert alive() is None


def test_saved_bytes_by_hand():
    """Linear(16,16)+ReLU units on a [4,16] input: each ReLU saves its output (256 bytes), made by
    its own unit; each Linear saves its input, made by the unit before (or the input: not counted)."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
    facts = unit_facts(model, ["0", "1", "2"], Inputs.of(torch.randn(4, 16)), default_loss)
    assert facts.saved == [256, 256, 256]
    assert facts.inputs == facts.outputs == [256, 256, 256]
    assert facts.chain


def test_static_bytes(gpt_profile):
    model, batch = tiny_gpt()
    params = sum(p.numel() * 4 for p in model.parameters())  # tied weights appear once
    assert gpt_profile.param_bytes == params
    assert gpt_profile.grad_bytes == params
    n_tensors = len(list(model.parameters()))
    assert gpt_profile.optimizer_state_bytes == 2 * params + 4 * n_tensors  # exp_avg, exp_avg_sq, step
    assert gpt_profile.input_bytes == sum(t.numel() * 8 for t in batch.values())
    assert gpt_profile.baseline_bytes == params + gpt_profile.optimizer_state_bytes + gpt_profile.input_bytes
    assert gpt_profile.unit_names == ["h.0", "h.1", "h.2", "h.3"]
    for u in gpt_profile.units:
        assert u.fwd_s > 0 and u.bwd_s > 0
        assert u.options[FULL].stored_bytes < u.options[KEEP].stored_bytes
        assert u.options[FULL].recompute_s == pytest.approx(u.fwd_s * gpt_profile.recompute_factor)
        assert 0.25 <= gpt_profile.recompute_factor <= 2.0
        assert u.options[KEEP].recompute_s == 0
        # a kept unit frees what it stored and leaves its gradients: the same net change either way
        none, full = u.options[KEEP], u.options[FULL]
        assert none.stored_bytes + none.bwd_end_bytes == full.stored_bytes + full.bwd_end_bytes


def test_profile_leaves_model_as_found():
    model, inputs = memfit.zoo.cnn(batch=4, image=16, widths=[8, 8, 16])
    model.eval()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    before = plain_state(model)
    memfit.profile(model, inputs, units="blocks.*", repeat=1, granularity="fine")
    assert not model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert plain_state(model) == before  # no region, hook or class swap left behind


def test_profile_kwargs_model_and_inputs_forms():
    model, inputs = kw_net()
    prof = memfit.profile(model, inputs, repeat=1, optimizer="sgd")
    assert len(prof.units) == 5 and prof.optimizer_state_bytes == 0
    assert "mask=float32[4,16,1]" in prof.input_shapes
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    for form in (torch.randn(2, 8), (torch.randn(2, 8),), {"input": torch.randn(2, 8)}):
        assert memfit.profile(seq, form, repeat=1, optimizer=None).unit_names == ["0", "1", "2"]


def test_unit_selection():
    model, _ = tiny_gpt()
    assert find_units(model, "auto") == ["h.0", "h.1", "h.2", "h.3"]
    assert find_units(model, "h.*") == ["h.0", "h.1", "h.2", "h.3"]
    assert find_units(model, ["h.0", "h.[23]"]) == ["h.0", "h.2", "h.3"]
    with pytest.raises(memfit.UnitSelectionError, match="no module matches"):
        find_units(model, "layers.*")
    with pytest.raises(memfit.UnitSelectionError, match="nest"):
        find_units(model, ["h.0", "h.0.attn"])
    with pytest.raises(memfit.UnitSelectionError, match="found no"):
        find_units(nn.Linear(2, 2), "auto")


def test_units_off_the_gradient_path_are_refused():
    class Side(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.main = nn.Linear(4, 4)

        def forward(self, x):
            with torch.no_grad():
                for b in self.blocks:
                    b(x)
            return self.main(x)

    with pytest.raises(memfit.MemfitError, match="backward"):
        memfit.profile(Side(), torch.randn(2, 4), repeat=1)


def test_recompute_calibrated_to_measured_all_checkpointed_overhead():
    """The recompute times add up so that predicting 'every unit checkpointed' gives the median
    ratio of adjacent plain and all-checkpointed steps, and units share it by forward time."""
    from memfit.measure.timing import alternate, ratio_uncertainty
    from memfit.profiler.costs import overhead, recompute_factor
    from memfit.runtime.marks import Stretch

    def run(fwd: list[float], bwd: list[float], rest: float) -> list[Stretch]:
        marks = [Stretch(f"fwd:{i}", 0, 0, t) for i, t in enumerate(fwd)]
        marks += [Stretch(f"bwd:{i}", 0, 0, t) for i, t in enumerate(bwd)]
        return [*marks, Stretch("step", 0, 0, rest)]

    # machine speed drifts by 2x between rounds; within a pair the all-checkpointed step costs 1.3x
    plain = [run([1.0 * s, 3.0 * s], [2.0 * s, 6.0 * s], 2.0 * s) for s in (1.0, 2.0, 1.0, 2.0, 1.5)]
    full = [run([1.0 * s, 3.0 * s], [3.05 * s, 9.15 * s], 2.0 * s) for s in (1.0, 2.0, 1.0, 2.0, 1.5)]
    steps = [[sum(s.seconds for s in r) for r in runs] for runs in (plain, full)]
    factor, uncertainty = recompute_factor(plain, overhead(plain, full, ratio_uncertainty(*steps)))
    step, forward = 14.0 * 1.5, 4.0 * 1.5  # medians
    assert factor * forward / step == pytest.approx(0.3)
    assert uncertainty == pytest.approx(0.0)  # every round's ratio was the same: the drift cancels

    # alternate: each configuration twice in a row, the second counted; the order reverses
    order: list[int] = []
    a, b = alternate(lambda k: order.append(k) or len(order), 2, 2)
    assert order == [0, 0, 1, 1, 1, 1, 0, 0]
    assert (a, b) == ([2, 8], [4, 6])


def test_keep_freed_cpu_memory_keeps_freed_blocks():
    """200 MiB of activation-sized blocks (8 MiB each) allocated and freed: by default glibc
    hands them back to the kernel at once (the next step faults every page in again); after
    keep_freed_cpu_memory() they stay with the process for reuse. Read from the resident set."""
    import subprocess
    import sys

    script = """
import os, sys, torch, memfit
if sys.argv[1] == "keep":
    assert memfit.keep_freed_cpu_memory()
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
blocks = [torch.ones(2 << 20) for _ in range(25)]
held = rss() - before
del blocks
print(held >> 20, (rss() - before) >> 20)
"""
    held, after = {}, {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
        held[mode], after[mode] = map(int, out.stdout.split()[-2:])
    assert held["default"] >= 200 and held["keep"] >= 200
    assert after["default"] < 10  # returned to the kernel
    assert after["keep"] >= 195  # kept for the next step


def test_segment_members_priced_from_the_step_in_pairs(gpt_profile):
    """A segment's members before its last cost their own measured recompute (``member_s``), from
    a step of units checkpointed two by two: each pair's second unit at ``full``'s factor, the
    first at the factor left over; the last member and lone units cost ``full``'s. Checkpointing
    nanoGPT's blocks in pairs measured +27.7% against +25.4% for each alone, the same kernels
    (benchmarks/segments.py): a recompute right before its own backward leaves that backward its
    tensors in the cache."""
    import copy
    import math

    from memfit.planning.peak import predict
    from memfit.policy import Segment
    from memfit.profiler.costs import add_members, segments
    from memfit.runtime.marks import Stretch

    prof = copy.deepcopy(gpt_profile)
    names = prof.unit_names
    assert len(names) == 4 and prof.chain
    assert all(u.member_s is not None and u.member_s > 0 for u in gpt_profile.units)  # measured by profile()
    assert segments(names, 2) == {names[0]: Segment(names[0], names[1]), names[1]: Segment(names[0], names[1]),
                             names[2]: Segment(names[2], names[3]), names[3]: Segment(names[2], names[3])}
    assert list(segments(names[:3], 2).values())[2] == FULL  # an odd last unit alone

    for u in prof.units:
        u.fwd_s = 1.5  # the median round's (the machine's speed drifts by 2x between rounds)
    prof.recompute_factor = 0.75

    def run(scale: float, extra: float) -> list[Stretch]:
        return [*(Stretch(f"fwd:{i}", 0, 0, scale) for i in range(4)), Stretch("step", 0, 0, scale * (6.0 + extra))]

    # at speed 1: plain step 10 s; in pairs 2 x 0.75 (the second units) + 2 x 1.25 (the first) more
    speeds = (1.0, 2.0, 1.0, 2.0, 1.5)
    add_members(prof, segments(names, 2), [run(s, 0.0) for s in speeds], [run(s, 4.0) for s in speeds], math.nan, 1, 1)
    assert [u.member_s for u in prof.units] == pytest.approx([1.5 * 1.25] * 4)
    assert [u.member_uncertainty_s for u in prof.units] == [0.0] * 4  # too few rounds to tell
    for u in prof.units:
        u.options[FULL].recompute_s = 1.5 * 0.75
    both = {n: Segment(names[0], names[-1]) for n in names}  # three members before the last
    assert predict(prof, both).recompute_s == pytest.approx(1.5 * (3 * 1.25 + 0.75))
    for u in prof.units:
        u.member_s = None  # a profile from before members were measured: priced as full
    assert predict(prof, both).recompute_s == pytest.approx(1.5 * 4 * 0.75)

    back = profile_from_dict(gpt_profile.to_dict())  # written and read back whole
    assert [(u.member_s, u.member_uncertainty_s) for u in back.units] == \
        [(u.member_s, u.member_uncertainty_s) for u in gpt_profile.units]
