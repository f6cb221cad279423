"""A CuTe-DSL map of fa4/cute/softmax.exp2_poly over a vector: the probe of the polynomial's error bound
(tests/test_attention_cute.py compiles it for sm_90a on the CPU and runs it on the GPU)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fa4.cute.softmax import exp2_poly

THREADS = 128


@cute.kernel
def _exp2_poly_kernel(x: cute.Tensor, y: cute.Tensor):
    bidx, _, _ = cute.arch.block_idx()
    tidx, _, _ = cute.arch.thread_idx()
    i = bidx * THREADS + tidx
    y[i] = exp2_poly(Float32(x[i]))


@cute.jit
def exp2_poly_map(x_ptr: cute.Pointer, y_ptr: cute.Pointer, n: Int32, stream):
    """y[i] = exp2_poly(x[i]) for n fp32 values (n a multiple of THREADS)."""
    x = cute.make_tensor(x_ptr, cute.make_layout(n))
    y = cute.make_tensor(y_ptr, cute.make_layout(n))
    _exp2_poly_kernel(x, y).launch(grid=[n // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)


def compile_probe(keep_ptx: bool = False):
    """The compiled map (no GPU needed: placeholder pointers and stream); keep_ptx: its `__ptx__` holds the PTX
    (a copy is written to $CUTE_DSL_DUMP_DIR or the working directory)."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr
    ptr = make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    return cute.compile(exp2_poly_map, ptr, ptr, Int32(THREADS), make_fake_stream(),
                        options="--keep-ptx" if keep_ptx else None)
