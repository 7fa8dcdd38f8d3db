"""profiler/saved.py on its own: bytes saved for backward counted for the unit that produced them
(parameters and the step's inputs not at all), bytes in and out of each unit, and whether the
units form a chain."""

import torch
from torch import nn

from memfit.measure.inputs import Inputs
from memfit.profiler.saved import unit_facts

B, D = 8, 32
ACT = B * D * 4  # one float32 activation


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.blocks[0](x)
        b = self.blocks[1](a)
        return self.blocks[2](a + b)  # the last block's input is not the one before's output


def _facts(model: nn.Module, names: list[str]):
    return unit_facts(model, names, Inputs.of(torch.randn(B, D)), lambda out: out.sum())


def test_linear_chain_saved_inputs_outputs():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU())
    facts = _facts(model, ["0", "1", "2", "3"])
    # the first Linear saves the step's own input (counted for no unit); each ReLU saves its
    # output, which the next Linear saves too: one storage, counted once, for the ReLU that made it
    assert facts.saved == [0, ACT, 0, ACT]
    assert facts.inputs == [ACT] * 4 and facts.outputs == [ACT] * 4
    assert facts.chain
    assert facts.keeps_output == [False, True, False, False]  # the last has no next unit to take it


def test_a_skip_connection_is_no_chain():
    facts = _facts(Residual(), ["blocks.0", "blocks.1", "blocks.2"])
    assert not facts.chain
    assert facts.inputs == [ACT] * 3
