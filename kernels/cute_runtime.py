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
