"""What the CuTe-DSL kernels (fa4/cute, kernels/tma_gemv.py) share on the host: whether the DSL is installed, a
compile cache, and stream objects.

A compiled kernel is keyed by its frozen config; the first call with a config compiles it (under a lock, once, also
when threads race) and later calls reuse it. Launches take a cuda-python stream object, cached per raw handle.
Neither needs nvidia-cutlass-dsl at import: the compile function and cuda-python are only touched on use.
"""
import functools
import importlib.util
import threading
from collections.abc import Callable


@functools.cache
def dsl_available() -> bool:
    """Whether nvidia-cutlass-dsl is installed (without importing it: its import fixes CUTE_DSL_ARCH); asked once,
    as the routing decisions ask on every call."""
    return importlib.util.find_spec("cutlass") is not None


class CompileCache:
    """config -> compiled kernel, compiled by compile_fn(config) on first use."""

    def __init__(self, compile_fn: Callable):
        self._compile, self._kernels, self._lock = compile_fn, {}, threading.Lock()

    def get(self, config):
        kernel = self._kernels.get(config)
        if kernel is None:
            with self._lock:
                kernel = self._kernels.get(config)
                if kernel is None:
                    kernel = self._kernels[config] = self._compile(config)
        return kernel

    def __len__(self) -> int:
        return len(self._kernels)


_STREAMS: dict = {}


def cu_stream(handle: int):
    """The cuda-python stream object of a raw stream handle (cached: one per stream)."""
    stream = _STREAMS.get(handle)
    if stream is None:
        from cuda.bindings import driver
        stream = _STREAMS[handle] = driver.CUstream(handle)
    return stream


@functools.cache
def device_stamps():
    """The CuTe kernels' kernels.stamps fields on the device, as cute.jit functions (built on first use, so that this
    module imports without the DSL): stamp(mStamps, first, last) folds %globaltimer into fields first (min) and last
    (max) and returns it; stamp_end(mStamps, t_go) stamps a program's end and adds its busy time and count."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int64

    @cute.jit
    def stamp(mStamps: cute.Tensor, first: cutlass.Constexpr, last: cutlass.Constexpr) -> Int64:
        t = Int64(cute.arch.globaltimer())
        cute.arch.atomic_min(mStamps.iterator + first, t, sem="relaxed", scope="gpu")
        cute.arch.atomic_max(mStamps.iterator + last, t, sem="relaxed", scope="gpu")
        return t

    @cute.jit
    def stamp_end(mStamps: cute.Tensor, t_go: Int64):
        t_end = stamp(mStamps, 4, 5)
        cute.arch.atomic_add(mStamps.iterator + 6, t_end - t_go, sem="relaxed", scope="gpu")
        cute.arch.atomic_add(mStamps.iterator + 7, Int64(1), sem="relaxed", scope="gpu")

    return stamp, stamp_end
