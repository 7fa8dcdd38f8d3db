"""measure/fake.py's roofline clock: ops that only change metadata (views, detach, prim.device)
cost nothing, as on a GPU where they launch no kernel; ops that read or write data cost what
the device's roofline says, in-place ones included."""

import torch

from memfit.devices import device_spec
from memfit.measure.fake import RooflineClock
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
