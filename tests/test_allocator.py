"""The caching allocator's model (measure/allocator.py): PyTorch's rules, checked on sequences
whose reserved bytes follow from them, and what estimate mode records with it."""

import memfit
from memfit.measure.allocator import CachingAllocator, MiB, replay, round_size, segment_size
from memfit.policy import FULL, KEEP


def test_requests_round_and_segments_are_sized_as_pytorchs_allocator_does():
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    # small (up to 1 MiB): 2 MiB segments; large under 10 MiB: 20 MiB; else rounded to 2 MiB
    assert [segment_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 1)] == [
        2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]


def test_blocks_are_reused_best_fit_split_and_merged():
    a = CachingAllocator()
    for k in range(4):  # four 0.5 MiB tensors share one 2 MiB small segment
        a.malloc(k, MiB // 2)
    assert (a.reserved, a.allocated) == (2 * MiB, 2 * MiB)
    a.malloc("x", 100)  # the small segment is full: another
    assert a.reserved == 4 * MiB
    a.malloc("big", 3 * MiB)  # a 20 MiB segment, split: 17 MiB stay free
    a.malloc("big2", 15 * MiB)  # best fit: the 17 MiB remainder, no new segment
    assert a.reserved == 24 * MiB
    a.free("big")
    a.malloc("mid", 2 * MiB)  # best fit: the 2 MiB that big2 left at the segment's end, not the freed 3 MiB
    assert a.reserved == 24 * MiB and a.allocated == 2 * MiB + 512 + 15 * MiB + 2 * MiB
    for k in ("mid", "big2"):
        a.free(k)
    a.malloc("whole", 20 * MiB)  # the three free blocks merged back into one of 20 MiB: reused
    assert a.reserved == 24 * MiB
    a.malloc("more", 20 * MiB)  # nothing free that holds it: a new segment of exactly 20 MiB
    assert (a.reserved, a.peak_reserved) == (44 * MiB, 44 * MiB)


def test_fragmentation_reserves_more_than_is_allocated():
    """Large tensors freed in between are too small for a larger request: a new segment, though
    the allocated bytes never exceed either segment alone."""
    a = CachingAllocator()
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.malloc("c", 14 * MiB)
    assert a.peak_allocated == 26 * MiB and a.peak_reserved == 38 * MiB


def test_an_estimate_for_a_gpu_records_what_each_option_reserves(tmp_path):
    from memfit import zoo
    from memfit.profiler.estimate import estimate

    def build():
        return zoo.gpt(batch=8, seq=512, vocab=8192, d_model=512, n_head=8, n_layer=4, dropout=0.1)

    prof = estimate(build, target="h100")
    assert list(prof.reserved_peak_bytes) == list(prof.measured_peak_bytes) == [KEEP, FULL]
    for option, reserved in prof.reserved_peak_bytes.items():
        allocated = prof.measured_peak_bytes[option]
        assert allocated < reserved < 1.25 * allocated
    assert not estimate(build, target="cpu").reserved_peak_bytes  # the CPU caches nothing
    prof.save(tmp_path / "p.json")
    assert memfit.Profile.load(tmp_path / "p.json").reserved_peak_bytes == prof.reserved_peak_bytes


def test_an_estimate_that_also_runs_the_alternating_steps_keeps_each_options_reserved_peak():
    """A residual add outside the units makes the profiler run two more memory steps (even units
    checkpointed, then odd: profiler/phases.ALTERNATE) after one per option; the reserved peaks
    still go to the options (benchmarks/published.py's BERT rows had none before)."""
    from memfit.profiler.estimate import estimate

    from .models import residual_outside

    prof = estimate(lambda: residual_outside(batch=8, image=64), target="h100", units="blocks.*")
    assert any(u.options[FULL].freed_after_bytes for u in prof.units)  # what the alternating steps tell
    assert list(prof.reserved_peak_bytes) == list(prof.measured_peak_bytes) == [KEEP, FULL]
    for option, reserved in prof.reserved_peak_bytes.items():
        assert prof.measured_peak_bytes[option] <= reserved


def test_a_recorded_trace_replays_as_the_allocator_answered():
    """A trace as torch.cuda.memory._snapshot() records it (this one written out by hand from the
    rules: on a GPU, benchmarks/allocator_check.py replays real ones): the allocator's own
    segment events, which the replay ignores, are what the model reserves."""
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 20 * MiB},
        {"action": "alloc", "addr": 0, "size": 3 * MiB},
        {"action": "alloc", "addr": 3 * MiB, "size": 15 * MiB},  # the 17 MiB remainder, best fit
        {"action": "segment_alloc", "addr": 100 * MiB, "size": 2 * MiB},
        {"action": "alloc", "addr": 100 * MiB, "size": 1000},  # small: a 2 MiB segment of its own
        {"action": "free_requested", "addr": 0, "size": 3 * MiB},
        {"action": "free_completed", "addr": 0, "size": 3 * MiB},
        {"action": "alloc", "addr": 0, "size": 3 * MiB},  # the freed block again
        {"action": "segment_alloc", "addr": 200 * MiB, "size": 20 * MiB},
        {"action": "alloc", "addr": 200 * MiB, "size": 4 * MiB},  # nothing free holds it: a new segment
    ]
    model = replay(trace)
    segments = sum(e["size"] for e in trace if e["action"] == "segment_alloc")
    assert model.peak_reserved == segments == 42 * MiB
    assert model.peak_allocated == 3 * MiB + 15 * MiB + 1024 + 4 * MiB
