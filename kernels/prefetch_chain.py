"""The L2 prefetch chain of decode steps: which weight a GEMV prefetches into L2 as its programs finish.

A batch-1 decode step streams its weights through ~100 GEMVs, with norms and the mixers' kernels between them.
Between two weight streams DRAM idles through the first GEMV's tail, the kernels in between and the second
GEMV's ramp. With a chain, the programs of each GEMV end by prefetching the first `prefetch_bytes()` of the next
GEMV's weight (the last GEMV: the first one's, for the next step), so DRAM keeps streaming across the gap and the
next GEMV starts from L2.

The chain maps a weight (by data pointer) to the weight that follows it. serving.model_runner records the order
of one decode step's GEMVs (`recording`) and sets it (`set_chain`) before capturing its CUDA graphs. Prefetching
reads only live weights (the chain holds them) and writes nothing, so a stale or wrong chain costs bandwidth,
never correctness. QWEN_PREFETCH_MB (default 12) sets the bytes; 0 turns the chain off.
No Triton here: the serving loop imports this module on any machine.
"""
import contextlib
import os

import torch

_CHAIN: dict[int, torch.Tensor] = {}
_RECORDED: list | None = None


def prefetch_bytes() -> int:
    return int(float(os.environ.get("QWEN_PREFETCH_MB", "12")) * 2**20)


def following(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight whose start the GEMV on `weight` prefetches, or None. Records `weight` inside `recording`."""
    if _RECORDED is not None:
        _RECORDED.append(weight)
    return _CHAIN.get(weight.data_ptr())


@contextlib.contextmanager
def recording():
    """Collect the weights of the GEMVs launched inside the block, in launch order (the yielded list)."""
    global _RECORDED
    _RECORDED, outer = [], _RECORDED
    try:
        yield _RECORDED
    finally:
        _RECORDED = outer


def set_chain(weights: list[torch.Tensor]) -> None:
    """Each GEMV on weights[i] prefetches the start of weights[i + 1], the last one weights[0]'s (empty: off)."""
    _CHAIN.clear()
    if prefetch_bytes() <= 0:
        return
    for weight, nxt in zip(weights, weights[1:] + weights[:1]):
        _CHAIN[weight.data_ptr()] = nxt
