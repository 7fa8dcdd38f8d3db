"""measure/fake.py's roofline clock: ops that only change metadata (views, detach, prim.device)
cost nothing, as on a GPU where they launch no kernel; ops that read or write data cost what
the device's roofline says, in-place ones included."""

import torch

from memfit.devices import device_spec
from memfit.measure.fake import RooflineClock
from memfit.policy import KEEP
from memfit.torch_private import FakeTensorMode

H100 = device_spec("h100")


def _seconds(run) -> float:  # type: ignore[no-untyped-def]
    clock = RooflineClock(H100)
    with clock:
        clock.on_mark("start")
        run()
        clock.on_mark("end")
    marks = clock.marks()
    return marks[-1].time_s - marks[0].time_s


def test_metadata_only_ops_cost_nothing():
    with FakeTensorMode():
        x = torch.empty(1024, 1024)
        assert _seconds(lambda: (x.view(-1), x.t(), x.transpose(0, 1), x.detach(), x[:, :10],
                                 x.unsqueeze(0).expand(4, -1, -1), torch.ops.prim.device.default(x))) == 0.0


def test_data_ops_cost_their_roofline_in_place_too():
    with FakeTensorMode():
        x = torch.empty(1024, 1024)
        nbytes = x.numel() * 4
        assert _seconds(lambda: x.add_(1.0)) == H100.seconds(0.0, 2 * nbytes, torch.float32)  # read and written
        assert _seconds(lambda: x + 1.0) == H100.seconds(0.0, 2 * nbytes, torch.float32)
        flops = 2.0 * 1024**3
        assert _seconds(lambda: x @ x) == H100.seconds(flops, 3 * nbytes, torch.float32)


def test_dropout_masks_take_one_byte_per_element_on_cuda_targets():
    """CUDA's fused native_dropout keeps its mask as bool (one byte per element); the CPU's
    kernel, which fake tensors run, makes it in the input's dtype. A CUDA target counts the
    former: live after dropout of a float32 [1024, 1024], the output (4 MiB) and the mask (1 MiB
    on CUDA, 4 MiB on the CPU)."""
    from memfit.measure.fake import FakeMemoryRecorder

    for target, mask_bytes in (("h100", 2**20), ("cpu", 4 * 2**20)):
        with FakeTensorMode():
            x = torch.empty(1024, 1024, requires_grad=True)
            recorder = FakeMemoryRecorder(device_spec(target))
            with recorder:
                recorder.on_mark("start")
                y = torch.nn.functional.dropout(x, 0.1, training=True)
                recorder.on_mark("end")
            assert recorder.marks()[-1].level - recorder.marks()[0].level == 4 * 2**20 + mask_bytes, target
            del y


def test_a_units_saved_bytes_count_masks_as_the_target_keeps_them():
    """What a unit saves for backward (the report's "saves" column, and its check that an option
    keeps no more than that) counts dropout's masks as the step's meter does: a byte per element
    for a CUDA target. A GPT block with dropout then saves exactly what its unplanned forward
    keeps (4,341,760 B here; 4,734,976 when its masks were counted in float32), on the CPU too."""
    from memfit import zoo
    from memfit.profiler.estimate import estimate

    def build():
        return zoo.gpt(batch=4, seq=128, vocab=512, d_model=128, n_head=4, n_layer=2, dropout=0.1)

    for target in ("h100", "cpu"):
        unit = estimate(build, target=target).units[0]
        assert unit.saved_bytes == unit.options[KEEP].stored_bytes, target
