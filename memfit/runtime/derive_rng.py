"""Dropout's draws made again in the backward (``derive:products`` and deeper): the noise's
recipe (``Fill``), the generator's state it starts from (``RngAt``, taken by the pack hook of
runtime/derive_forward.py), and the check that the draw made again ends where the forward's did
(``digest``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from memfit.errors import MemfitError


@dataclass(slots=True, frozen=True)
class RngAt:
    """A template's argument: the generator's state as it was once ``packs`` tensors of the
    forward had been packed (0: as the forward began), taken then by the pack hook; no seeded op
    ran between that point and the fill that takes it (derive_watch checks it while learning)."""

    packs: int


@dataclass(slots=True, frozen=True)
class Fill:
    """How a dropout's noise was made, to be made again from the generator's state before it:
    the CPU's composite dropout (``empty_like``, then ``ops`` in place: ``bernoulli_``, ``div_``;
    the product saves the noise) or, with ``fused`` (its probability), the fused ``native_dropout``
    a GPU runs, whose mask its backward saves: run again on a buffer of the input's layout and
    alignment (the kernel's vector width follows the pointers), whose values the mask does not
    depend on. The same layout and draws under that state give the same bits; the generator is
    set back afterwards, so the backward's own draws are not moved. ``after``: the digest of the
    state the forward's pack hook found when the noise was packed, right after its draw; a draw
    made again that ends elsewhere started from another state (something drew in between, in a
    forward that took another path than the learned one, or another thread), and is refused rather
    than given to the backward."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ops: tuple[tuple[Any, tuple[Any, ...]], ...] = ()  # (in-place op, its arguments after the tensor)
    fused: float | None = None
    offset: int = 0  # the fused dropout's input's, in elements

    def __call__(self, state: torch.Tensor, after: int | None = None) -> torch.Tensor:
        now = rng_state(self.device)
        set_rng_state(self.device, state)
        try:
            if self.fused is None:
                t = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
                for op, args in self.ops:
                    op(t, *args)
            else:
                span = 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
                buf = torch.empty(self.offset + span, dtype=self.dtype, device=self.device)
                t = torch.native_dropout(buf.as_strided(self.size, self.stride, self.offset), self.fused, True)[1]
            if after is not None and digest(self.device) != after:
                raise MemfitError(
                    "a dropout mask that memfit re-makes in the backward would differ from the forward's: something "
                    "drew from the random generator between the last saved tensor and the dropout (a random op in "
                    "only some forwards, or another thread); plan this unit with derive, not derive:products or deeper")
            return t
        finally:
            set_rng_state(self.device, now)


CPU_STATE_BYTES = torch.get_rng_state().numel()  # 5,056; a CUDA generator's state is 16 bytes on the host


def rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for ``device`` (the CPU's: 5,056 bytes; CUDA's: 16)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def digest(device: torch.device) -> int:
    """The generator's state now, as a number to compare (no tensor kept for it). Read through its
    pointer: a tensor op here would pass through the dispatch modes above (the watch, estimate
    mode's fake tensors, which refuse a real tensor); the state is a host tensor, CUDA's too."""
    state = rng_state(device)
    return hash(ctypes.string_at(state.data_ptr(), state.numel()))


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
