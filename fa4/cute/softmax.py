"""Online softmax of one consumer warpgroup, in CuTe-DSL, with FA4's two ideas.

Scores arrive as the fp32 wgmma accumulator of a 64 x tile_n tile. Seen as (rows, cols) per thread
(`acc_mn_view`), each thread holds 2 rows; the 4 threads of a quad share a row, so a row reduction is two
butterfly shuffles (`quad_reduce_max`, `quad_reduce_sum`). The running max `row_max` is kept in raw score
units; exponents are exp2(s * scale_log2 - row_max * scale_log2), one FFMA plus one exp2 per element.

Conditional rescale (FA4): after a tile's row max is known, a warp replaces its running max (and rescales
its O rows and row sums) only when some row's max grew by more than `rescale_threshold` in log2 units. The
decision is warp-uniform (vote.any): a warp owns 16 whole rows of O, so its branch skips the O multiply
for the whole warp. Otherwise P = 2^(s - m_old) <= 2^threshold, which bf16 P and fp32 sums absorb; the final
division by the true row sum keeps the result exact. Threshold 0 is the classic online softmax.

Software exp2 (FA4): `exp2_poly` computes 2^x on the FMA/ALU pipes (x = j + f, Horner degree-3 for 2^f,
j added to the exponent bits), with the coefficients of fa4/softmax.py (max relative error 8.6e-5). A static
choice of columns (`poly_exp2_fraction` of each thread's columns, spread evenly) uses it; the rest use
MUFU ex2. Unlike Triton, CuTe unrolls the per-thread columns, so the split costs no data movement.

Rows with no visible key so far have row_max -inf: their offset is taken as 0 so that exp2(-inf) = 0
(never -inf - -inf), and the final 1/row_sum is replaced by 0, so such rows give 0.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fa4.softmax import EXP2_C0, EXP2_C1, EXP2_C2, EXP2_C3

LOG2_E = math.log2(math.e)
_C0, _C1, _C2, _C3 = (float(c.value) for c in (EXP2_C0, EXP2_C1, EXP2_C2, EXP2_C3))


@dsl_user_op
def _f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _bits_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def exp2_poly(x: Float32) -> Float32:
    """2^x on the FMA/ALU units for x <= 127; x < -126 (and -inf) gives 0."""
    xc = cute.arch.fmax(x, Float32(-127.0))
    j = cute.math.floor(xc)
    f = xc - j  # [0, 1)
    p = Float32(_C0) + f * (Float32(_C1) + f * (Float32(_C2) + f * Float32(_C3)))  # 2^f in [1, 2)
    bits = _f32_bits(p) + (Int32(j) << 23)
    out = _bits_f32(bits)
    if xc < Float32(-126.0):
        out = Float32(0.0)
    return out


def poly_columns(num_cols: int, fraction: float) -> frozenset:
    """The per-thread column indices (static) whose exp2 is the polynomial: every (1/fraction)-th column."""
    if fraction <= 0.0:
        return frozenset()
    step = round(1.0 / fraction)
    return frozenset(range(0, num_cols, step))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """A wgmma accumulator fragment ((2, 2, V), MMA_M, MMA_N) seen as (rows, cols) of this thread:
    rows = (the 2 row halves, MMA_M), cols = (the 2 adjacent columns, V column groups, MMA_N)."""
    shape, stride = acc.layout.shape, acc.layout.stride
    rows = ((shape[0][1], shape[1]), (stride[0][1], stride[1]))
    cols = ((shape[0][0], shape[0][2], shape[2]), (stride[0][0], stride[0][2], stride[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


@cute.jit
def quad_reduce_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def quad_reduce_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def _add(a, b):
    return a + b


def tree_reduce(values: list, op):
    """op over a thread's values as a balanced tree (unrolled at trace time): log2(n) dependent steps instead of a
    chain of n - 1. The serial chains of a row's max and sum were ~2 x 31 dependent ALU steps of latency a tile at
    d128, inside the softmax that must hide under the other warpgroup's GEMMs."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def make_state(num_rows: int):
    """(row_max, row_sum, row_scale) register tensors of one thread's rows: -inf, 0 and 1."""
    row_max = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
    row_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
    row_scale = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    row_scale.fill(1.0)
    return row_max, row_sum, row_scale


@cute.jit
def _move_max(row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, row_new: cute.Tensor,
              scale_log2: Float32):
    """The rows' running max becomes row_new: row_scale holds each row's factor for O and row_sum is scaled by it."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        m_new = row_new[r]
        factor = cute.math.exp2((row_max[r] - m_new) * scale_log2, fastmath=True)  # 0 when the old max is -inf
        if m_new == -Float32.inf:
            factor = Float32(1.0)
        row_scale[r] = factor
        row_sum[r] = row_sum[r] * factor
        row_max[r] = m_new


@cute.jit
def online_softmax_update(row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, acc_s: cute.Tensor,
                          scale_log2: Float32, threshold: cutlass.Constexpr, poly_fraction: cutlass.Constexpr):
    """Turns the scores in acc_s (a QK^T accumulator) into unnormalised probabilities, in place, and updates
    the running max and sum. Returns whether this warp moved its max; then row_scale holds the factors that
    the O rows must be multiplied by (`rescale_o`) before the next PV accumulates. Reads no O, so it may run
    while the previous PV matmul is in flight.
    Threshold 0: no vote, the max moves every tile and the caller rescales O every tile (need is a constant True).
    Else a branch moves the max before the exps. Moving it by selects instead (only O's rescale branching) timed no
    faster, and threshold 0 without the vote (flash-attn-4's loop) slower: skipping O's 64 multiplies a tile is worth
    its branch here (profiles/FINDINGS.md, CuTe forward)."""
    s_mn = acc_mn_view(acc_s)
    num_rows = cute.size(s_mn, mode=[0])
    num_cols = cute.size(s_mn, mode=[1])
    row_new = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
    grow = -Float32.inf
    for r in cutlass.range_constexpr(num_rows):
        m = tree_reduce([s_mn[r, c] for c in range(num_cols)], cute.arch.fmax)
        m = cute.arch.fmax(quad_reduce_max(m), row_max[r])
        row_new[r] = m
        # growth in log2 units; -inf - -inf (no key yet) is NaN and compares false: nothing to rescale
        grow = cute.arch.fmax(grow, (m - row_max[r]) * scale_log2)
    if cutlass.const_expr(threshold == 0.0):
        need = True
        _move_max(row_max, row_sum, row_scale, row_new, scale_log2)
    else:
        need = cute.arch.vote_any_sync(grow > Float32(threshold))
        if need:
            _move_max(row_max, row_sum, row_scale, row_new, scale_log2)
    poly = poly_columns(num_cols, poly_fraction)
    tile_sum = cute.make_rmem_tensor(cute.make_layout(num_rows), Float32)
    for r in cutlass.range_constexpr(num_rows):
        m = row_max[r]
        if m == -Float32.inf:
            m = Float32(0.0)
        neg_m = -m * scale_log2
        for c in cutlass.range_constexpr(num_cols):
            x = s_mn[r, c] * scale_log2 + neg_m
            p = Float32(0.0)
            if cutlass.const_expr(c in poly):
                p = exp2_poly(x)
            else:
                p = cute.math.exp2(x, fastmath=True)
            s_mn[r, c] = p
        tile_sum[r] = tree_reduce([s_mn[r, c] for c in range(num_cols)], _add)
    for r in cutlass.range_constexpr(num_rows):
        row_sum[r] = row_sum[r] + tile_sum[r]
    return need


@dsl_user_op
def _bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """One register of two bf16, rounded to nearest: lo in the low half (the lower column)."""
    return Int32(llvm.inline_asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                                 "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def store_p(acc_s: cute.Tensor, p_as_s: cute.Tensor):
    """P = acc_s's probabilities in bf16, into the PV A fragment p_as_s (seen with acc_s's layout: compact, adjacent
    columns in adjacent registers). The conversions are asm with side effects, so the compiler keeps them here.
    As plain conversions it sank them past the next QK^T's issue, to their use by the next PV: the old scores then
    stayed live beside the new ones (spills at tile_n 176, ptxas-injected wgmma fences at every tile size)."""
    words = cute.recast_tensor(p_as_s, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _bf16x2(acc_s[2 * i], acc_s[2 * i + 1])


@cute.jit
def rescale_o(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """O rows *= row_scale (after `online_softmax_update` returned True)."""
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            o_mn[r, c] = o_mn[r, c] * row_scale[r]


@cute.jit
def online_softmax_finalize(row_sum: cute.Tensor, acc_o: cute.Tensor):
    """acc_o rows /= their full row sums (quad-reduced here); rows that saw no key become 0."""
    o_mn = acc_mn_view(acc_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        total = quad_reduce_sum(row_sum[r])
        inv = Float32(0.0)
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
        for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            o_mn[r, c] = o_mn[r, c] * inv
