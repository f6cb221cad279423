"""Greedy tokens that reach the host without a copy: the token ring.

A fed decode step's argmax (kernels.argmax with reference.DecodeAdvance.token_ring) stores each row's token in
pinned host memory as well, at [p % RING_ROWS, row] for a row at position p, so that the host reads the step's
tokens once the step's event has passed, with no device-to-host copy on the stream between two decode graphs.
Why: that copy cost ~12 us a step (engine steps against bare replays of the same graph at 0.8B and 2B:
profiles/FINDINGS.md, decode step): the argmax's end to the copy's start, the copy, and the copy's end to the next
graph's first kernel.

A step overwrites what a step R positions earlier left in a row's slot. The engine reads a decode step's tokens
before it launches the step after next, so R = 2 would do; before each launch the ring still reads any landing
that the launch would overwrite and that nobody has read (`before_launch`), so that no order of steps loses one.
"""
from typing import NamedTuple

import numpy as np
import torch

RING_ROWS = 4


class LandedTokens:
    """One decode step's tokens in the ring: row r at [positions[r] % RING_ROWS, r]. read() waits for the step (the
    event recorded after its launch) and reads them, once."""

    def __init__(self, ring: "TokenRing", positions: list[int]):
        self._ring = ring
        self.cells = [(p % RING_ROWS, r) for r, p in enumerate(positions)]
        self._event = None
        if ring.on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._values: list[int] | None = None

    def read(self) -> list[int]:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            rows, cols = zip(*self.cells) if self.cells else ((), ())
            self._values = self._ring.slots.numpy()[np.array(rows, dtype=np.int64),
                                                    np.array(cols, dtype=np.int64)].tolist()
            self._ring.forget(self)
            self._ring.num_read += 1
        return self._values


class TokenRing:
    """(RING_ROWS, max_batch) int64 in pinned host memory (plain memory on the CPU) that decode steps' argmax
    writes, and the landings in it not read yet."""

    def __init__(self, max_batch: int, device: torch.device):
        self.on_cuda = device.type == "cuda"  # the steps run there: a landing waits for its step's event
        self.slots = torch.zeros((RING_ROWS, max_batch), dtype=torch.int64, pin_memory=self.on_cuda)
        self._unread: dict[tuple[int, int], LandedTokens] = {}  # (ring row, batch row) -> its landing, unread
        self.num_read = 0

    def view(self, bs: int) -> torch.Tensor:
        # (RING_ROWS, bs): what a decode step of bs rows (padding included) hands its argmax
        return self.slots[:, :bs]

    def before_launch(self, positions: list[int]) -> None:
        """A decode step whose row r sits at positions[r] is about to be launched: read every landing it would
        overwrite that is not read yet (it waits for that landing's step, which is older than this one)."""
        for r, p in enumerate(positions):
            landed = self._unread.get((p % RING_ROWS, r))
            if landed is not None:
                landed.read()

    def land(self, positions: list[int]) -> LandedTokens:
        """Right after a decode step's launch: where its rows' tokens land (row r at position positions[r])."""
        landed = LandedTokens(self, positions)
        for cell in landed.cells:
            self._unread[cell] = landed
        return landed

    def forget(self, landed: LandedTokens) -> None:
        for cell in landed.cells:
            if self._unread.get(cell) is landed:
                del self._unread[cell]


class GreedyTokens(NamedTuple):
    """A decode step's argmax: on the device (B,) int64, and where they land on the host (None: not in a ring)."""
    on_device: torch.Tensor
    landed: LandedTokens | None = None
