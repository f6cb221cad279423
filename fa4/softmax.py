"""FA4's two softmax ideas as Triton helpers: software exp2 on the FMA units and the conditional rescale.

Software exp2 (`exp2_poly`): x = j + f with j = floor(x) and f in [0, 1); 2^f by a degree-3 polynomial
(Horner, 3 FMAs), then j is added to the float's exponent bits (a bitcast and an integer add). The
coefficients minimise the maximum relative error on [0, 1] with c0 = 1 fixed (Lawson's iteration, rounded to
fp32): the measured maximum relative error is 8.6e-5 (~2^-13.5), below the rounding of P to bf16 (2^-9) or
fp16 (2^-11) before the PV matmul. Inputs below -126 give exactly 0 (so masked -inf scores contribute
nothing); inputs must be <= 127 (scores minus a running max are <= the rescale threshold).

`exp2_mixed` applies it to a power-of-two fraction of a tile's columns (1/8, 1/4, 1/2 or all) and the hardware
MUFU ex2 to the rest. The split is by interleaved columns (reshape (M, N) -> (M, N/2, 2), tl.split), which
matches the MMA accumulator layout where each thread holds pairs of adjacent columns, so the first level needs
no data movement; deeper levels do. Seen in sm_90a compiles on a CPU (d128, 128x64 tile): fraction 1/2 has 4
layout conversions (all-hardware: 6) and halves the ex2.approx count; 1/8 has 12 and ~50 more registers
(spills at d256 128x64 and d64 128x64/4 warps). Which fraction pays is for the GPU to say.

Conditional rescaling (`needs_rescale`): the running max is replaced only when some row of the tile would
grow it by more than the threshold (log2 units); else the old max is kept, P = 2^(S - m) stays <= 2^threshold,
and the O rescale is skipped. The decision is tile-uniform (FA4 makes it warp-uniform), so it is a real
branch around the O multiply; its cross-row reduction costs two bar.syncs a tile on sm_90 (13 against 7 in a
d128 128x128 compile), which is why threshold 0 (fa4/triton_forward.py) takes the classic per-row path with no
decision at all. The final normalisation divides by the true row sum, so results are exact.
"""
import triton
import triton.language as tl

# 2^f ~= C0 + f * (C1 + f * (C2 + f * C3)) on [0, 1), max relative error 8.6e-5
EXP2_C0 = tl.constexpr(1.0)
EXP2_C1 = tl.constexpr(0.6951168179512024)
EXP2_C2 = tl.constexpr(0.22764484584331512)
EXP2_C3 = tl.constexpr(0.07706717401742935)
EXP2_POLY_MAX_REL_ERR = 8.6e-5
POLY_FRACTIONS = (0.0, 0.125, 0.25, 0.5, 1.0)  # the fractions exp2_mixed realises (interleaved halving)


@triton.jit
def exp2_poly(x):
    """2^x for fp32 x <= 127 on the FMA/ALU units; x < -126 (and -inf) gives 0."""
    xc = tl.maximum(x, -127.0)
    j = tl.floor(xc)
    f = xc - j  # [0, 1)
    p = EXP2_C0 + f * (EXP2_C1 + f * (EXP2_C2 + f * EXP2_C3))  # 2^f in [1, 2)
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)  # add j to the exponent field
    return tl.where(xc >= -126.0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # x: (M, N) -> even columns (M, N/2), odd columns (M, N/2)
    return tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))


@triton.jit
def _interleave(a, b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # a, b: (M, N/2) -> (M, N) with a in the even columns
    return tl.reshape(tl.join(a, b), (BLOCK_M, BLOCK_N))


@triton.jit
def exp2_mixed(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POLY_LEVEL: tl.constexpr):
    """2^x of an (M, N) tile: exp2_poly on 1/2^(POLY_LEVEL-1) of the columns (POLY_LEVEL 1: all, 2: 1/2,
    3: 1/4, 4: 1/8), hardware exp2 on the rest; POLY_LEVEL 0: all hardware."""
    if POLY_LEVEL == 0:
        out = tl.exp2(x)
    elif POLY_LEVEL == 1:
        out = exp2_poly(x)
    else:
        a, b = _halves(x, BLOCK_M, BLOCK_N)  # (M, N/2) each
        if POLY_LEVEL == 2:
            a = exp2_poly(a)
        else:
            a0, a1 = _halves(a, BLOCK_M, BLOCK_N // 2)  # (M, N/4) each
            if POLY_LEVEL == 3:
                a0 = exp2_poly(a0)
            else:
                a00, a01 = _halves(a0, BLOCK_M, BLOCK_N // 4)  # (M, N/8) each
                a0 = _interleave(exp2_poly(a00), tl.exp2(a01), BLOCK_M, BLOCK_N // 4)
            a = _interleave(a0, tl.exp2(a1), BLOCK_M, BLOCK_N // 2)
        out = _interleave(a, tl.exp2(b), BLOCK_M, BLOCK_N)
    return out


def poly_level(fraction: float) -> int:
    """POLY_LEVEL of exp2_mixed for a fraction in POLY_FRACTIONS."""
    if fraction not in POLY_FRACTIONS:
        raise ValueError(f"poly_exp2_fraction must be one of {POLY_FRACTIONS}, got {fraction!r}")
    return {0.0: 0, 1.0: 1, 0.5: 2, 0.25: 3, 0.125: 4}[fraction]


@triton.jit
def needs_rescale(m_i, m_cand, THRESHOLD: tl.constexpr):
    """m_i: (M,) running max, m_cand: (M,) the max with this tile's scores, both log2 units -> whether some row
    grows by more than THRESHOLD (a reduction across the tile's rows: on sm_90 two bar.syncs a tile)."""
    return tl.max(m_cand - m_i, 0) > THRESHOLD
