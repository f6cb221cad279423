"""Kernel stamps: %globaltimer readings taken inside the decode kernels, so that a step's timeline can be read from
its CUDA graph with programmatic dependent launch intact (CUPTI and Nsight serialise the kernels they time).

A stamped kernel takes a slot of eight int64 (`FIELDS`) and, from one thread a program, folds the GPU's global
nanosecond timer into it with atomic min / max / add:
  first_arrive, last_arrive  when its programs started (PDL: possibly long before the kernel before it ended);
  first_go, last_go          when their PDL wait returned: first_go is when the kernel before it completed;
  first_end, last_end        when its first and last programs finished;
  busy_sum, programs         the sum over programs of their own end - go, and how many programs stamped it
                             (busy_sum / programs: a program's mean time after its wait; last_end - first_go
                             beyond it is the wave's tail).
So in a chain of launches, the time from one stamped kernel's first_go to the next one's is what the kernels in
between cost on the critical path, whatever overlapped.

Host side: `record()` switches stamping on for the launches made inside it (a CUDA graph captured there keeps its
slots: each replay writes the same ones); launchers ask `slot(name, device)` for (a pointer tensor, on). `reset()`
before a replay, `read()` after it returns the slots that replay wrote, in launch order. Off (the default), every
kernel compiles without the stamps (STAMPS constexpr False) and `slot` hands back a dummy pointer.
"""
import contextlib

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.interpreter_compat import INTERPRET

FIELDS = ("first_arrive", "last_arrive", "first_go", "last_go", "first_end", "last_end", "busy_sum", "programs")
INT64_MAX = 2**63 - 1
_INIT = (INT64_MAX, 0, INT64_MAX, 0, INT64_MAX, 0, 0, 0)


class StampBuffer:
    """Slots of len(FIELDS) int64 on one device, handed out in launch order."""

    def __init__(self, device: torch.device, capacity: int = 16384):
        self.device = device
        self.init = torch.tensor(_INIT, dtype=torch.int64, device=device).repeat(capacity, 1)  # (capacity, FIELDS)
        self.slots = self.init.clone()
        self.names: list[str] = []
        self.bytes: list[int] = []  # what each launch streams (a GEMV's weights), 0 where not given

    def take(self, name: str, bytes: int = 0) -> torch.Tensor | None:
        if len(self.names) == self.slots.shape[0]:
            return None
        self.names.append(name)
        self.bytes.append(bytes)
        return self.slots[len(self.names) - 1]

    def reset(self) -> None:
        self.slots.copy_(self.init)

    def read(self) -> list[dict]:
        """The slots the last run wrote (a go stamp), in launch order: {'slot', 'name', 'bytes', FIELDS...}."""
        rows = self.slots[:len(self.names)].tolist()
        return [{"slot": i, "name": self.names[i], "bytes": self.bytes[i], **dict(zip(FIELDS, row))}
                for i, row in enumerate(rows) if row[3] > 0]


_ACTIVE: StampBuffer | None = None
_DUMMY: dict = {}


@contextlib.contextmanager
def record(device: torch.device, capacity: int = 16384):
    """Stamp the kernels launched inside; yields the StampBuffer (read it after later replays too)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, StampBuffer(device, capacity)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


def slot(name: str, device: torch.device, bytes: int = 0) -> tuple[torch.Tensor, bool]:
    """(the int64 slot a launch passes as its stamps pointer, whether to stamp): a dummy and False when off, full,
    on another device, or not compiled for a GPU (the CPU interpreter runs no asm). bytes: what the launch streams
    (a GEMV's weights), for a bandwidth beside its time."""
    on = _ACTIVE is not None and _ACTIVE.device == device and device.type == "cuda" and not INTERPRET
    taken = _ACTIVE.take(name, bytes) if on else None
    if taken is not None:
        return taken, True
    if device not in _DUMMY:
        _DUMMY[device] = torch.zeros(len(FIELDS), dtype=torch.int64, device=device)
    return _DUMMY[device], False


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def arrive(stamps_ptr, STAMPS: tl.constexpr):
    """At a program's start (before its PDL wait)."""
    if STAMPS:
        t = _now()
        tl.atomic_min(stamps_ptr, t, sem="relaxed")
        tl.atomic_max(stamps_ptr + 1, t, sem="relaxed")


@triton.jit
def go(stamps_ptr, STAMPS: tl.constexpr):
    """Right after the program's PDL wait returned; returns the time (0 when off) for `end`."""
    t = tl.full([], 0, tl.int64)
    if STAMPS:
        t = _now()
        tl.atomic_min(stamps_ptr + 2, t, sem="relaxed")
        tl.atomic_max(stamps_ptr + 3, t, sem="relaxed")
    return t


@triton.jit
def end(stamps_ptr, t_go, STAMPS: tl.constexpr):
    """At the program's end (after its last store); t_go: what `go` returned."""
    if STAMPS:
        t = _now()
        tl.atomic_min(stamps_ptr + 4, t, sem="relaxed")
        tl.atomic_max(stamps_ptr + 5, t, sem="relaxed")
        tl.atomic_add(stamps_ptr + 6, t - t_go, sem="relaxed")
        tl.atomic_add(stamps_ptr + 7, 1, sem="relaxed")


@triton.jit
def wait(stamps_ptr, STAMPS: tl.constexpr, PDL: tl.constexpr):
    """pdl.wait_for_producer between an arrival and a go stamp (the arrival: when the program reached its wait, which
    is its start unless it loads something first); returns go's time, for `end` where the kernel stamps one."""
    arrive(stamps_ptr, STAMPS)
    pdl.wait_for_producer(PDL)
    return go(stamps_ptr, STAMPS)
