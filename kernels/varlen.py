"""Where sequence b's tokens lie in a flat batch, inside a Triton kernel: shared by every varlen kernel."""
import triton
import triton.language as tl


@triton.jit
def sequence_span(cu_seqlens_ptr, b, fixed_len, VARLEN: tl.constexpr):
    """(start, length) of sequence b: from cu_seqlens when VARLEN, else b * fixed_len and fixed_len."""
    if VARLEN:
        start = tl.load(cu_seqlens_ptr + b)
        length = tl.load(cu_seqlens_ptr + b + 1) - start
    else:
        start = b * fixed_len
        length = fixed_len
    return start, length
