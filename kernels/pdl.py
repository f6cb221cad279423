"""Programmatic dependent launch (PDL, sm_90+): a kernel may start while the one before it on the stream finishes.

A kernel launched with `launch_pdl=True` can be scheduled once every program of the previous kernel has called
`release_dependents` (or exited). Until it calls `wait_for_producer` it must read only what no earlier kernel
writes (weights) and write nothing; after the wait, everything the previous kernel wrote is visible. Inside a
decode CUDA graph this hides each launch and each kernel's ramp behind its predecessor's tail: a GEMV streams its
first weight tile while the norm before it still runs.

Before its wait a kernel may also pull what it will read into L2 (`prefetch_l2`): a split-KV decode program
prefetches its first key tile, whose cached keys no kernel of the step writes.

`enabled(device)` says whether to launch with PDL: a CUDA device of compute capability 9.0 or newer, not the CPU
interpreter, and not switched off by the active kernels.tuning.KernelTuning (pdl=False; QWEN_PDL=0 sets that
at import). Kernels take
it as the constexpr PDL; without it both helpers compile to nothing.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import registry
from kernels.interpreter_compat import INTERPRET


@functools.cache
def capable(index: int) -> bool:
    """Whether CUDA device `index` is sm_90 or newer (PDL, TMA, wgmma)."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or INTERPRET or not registry.tuning().pdl:
        return False
    return capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """The keyword arguments a kernel with a PDL constexpr is launched with on `device`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Block until the previous kernel on the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel on the stream be scheduled (it still waits for this one before reading its output)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask, NBYTES: tl.constexpr):
    """Ask L2 for the NBYTES (a multiple of 16) at each of ptrs (16-byte aligned) where mask holds: one bulk prefetch
    (cp.async.bulk.prefetch.L2, sm_90) per element, nothing in registers or shared memory, nothing to wait for."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, mask.to(tl.int32), tl.full(ptrs.shape, NBYTES, tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)
