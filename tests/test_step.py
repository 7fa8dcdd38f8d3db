"""measure/step.py on its own: the inputs' description, the default loss, the optimizers by name
and what lives across a step, as byte counts; a loss that is no scalar is refused in words."""

import pytest
import torch
from torch import nn

from memfit.errors import MemfitError
from memfit.measure.inputs import Inputs
from memfit.measure.step import StepState, default_loss, make_optimizer, static_bytes, training_step
from memfit.trainstep import TrainStep


def test_inputs_describe_nested_values():
    inputs = Inputs.of(((torch.zeros(8, 3, dtype=torch.int64), {"image": torch.zeros(2, 4)}), ))
    assert inputs.describe() == "0.0=int64[8,3], 0.1.image=float32[2,4]"
    assert Inputs.of({"mask": torch.zeros(1, 2), "use_cache": False}).describe() == "mask=float32[1,2], use_cache=bool"


def test_a_loss_that_is_no_scalar_is_refused_with_its_shape():
    model = nn.Linear(4, 4)
    with pytest.raises(MemfitError, match=r"one-element tensor, got float32\[2,4\]; pass loss_fn="):
        training_step(model, Inputs.of(torch.zeros(2, 4)), lambda out: out, StepState(TrainStep(None), model))


def test_static_bytes_count_weights_state_and_inputs_once():
    model = nn.Linear(16, 16)  # 16*16 + 16 floats
    x = torch.zeros(4, 16)
    state = StepState(TrainStep("adamw"), model)
    state.zero_grad()
    assert static_bytes(model, state, Inputs.of(x)) == (272 + 64) * 4  # no state before the first step
    training_step(model, Inputs.of(x), default_loss, state)
    state.zero_grad()
    # AdamW keeps two moments per parameter and a step counter per tensor (a 4-byte float each)
    assert static_bytes(model, state, Inputs.of(x)) == (272 + 64) * 4 + 2 * 272 * 4 + 2 * 4


def test_optimizers_by_name_never_move_the_weights():
    for name in ("adamw", "adamw-foreach", "adamw-fused", "adamw-single", "adam", "adam-fused", "sgd", "sgd-momentum",
                 "sgd-momentum-foreach", "adafactor"):
        model = nn.Linear(4, 4)
        before = [p.detach().clone() for p in model.parameters()]
        training_step(model, Inputs.of(torch.randn(3, 4)), default_loss, StepState(TrainStep(name), model))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), name
    with pytest.raises(MemfitError, match="unknown optimizer 'lion'"):
        make_optimizer("lion", [])
