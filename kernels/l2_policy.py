"""L2 residency for small state that a decode step reads and rewrites while gigabytes of weights stream past.

A batch-1 decode step streams its weights (~3.8 GB for 2B) through the 50 MB L2 once, so every line the step keeps
between two steps is evicted before it is read again: the GDN decode's fp32 states (64 KiB a head, 1 MiB a 2B / 0.8B
layer) are read from DRAM and written back to it every step, the write-backs landing as dirty evictions among the
weight reads. Loads and stores with the L2 evict_last hint (Triton's eviction_policy) keep them resident, up to the
context's persisting L2 limit, which `reserve` raises (cuCtxSetLimit CU_LIMIT_PERSISTING_L2_CACHE_SIZE, capped by the
device's maximum).
"""
import functools

import torch


@functools.cache
def max_persisting_bytes(index: int) -> int:
    import cuda.bindings.driver as cu
    err, value = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, index)
    return int(value) if err == cu.CUresult.CUDA_SUCCESS else 0


_RESERVED: dict = {}  # device index -> bytes asked for so far


def reserve(device: torch.device, nbytes: int) -> int:
    """Raise the current context's persisting L2 limit on `device` to at least nbytes (capped by the device's
    maximum); returns the limit asked for. A no-op off CUDA."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = min(max(nbytes, _RESERVED.get(index, 0)), max_persisting_bytes(index))
    if want > _RESERVED.get(index, 0):
        import cuda.bindings.driver as cu
        torch.cuda.init()
        with torch.cuda.device(index):
            (err,) = cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, want)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE, {want}) failed: {err}")
        _RESERVED[index] = want
    return _RESERVED.get(index, 0)
