"""Gated DeltaNet decode step in CuTe-DSL for sm_90: the same math as kernels/gdn_decode.py, with the layout chosen.

Why a second kernel. The Triton kernel spreads each (dk, dv) state over its warps by rows (Triton's layout for the
row-major state: a thread holds 32 rows x 4 adjacent columns), so every sum over dk (S^T k, S^T q, both l2norms)
crosses the warps through shared memory: 19 barriers after the PDL wait, and 6.8 us a layer after it in the 2B step
(profiles/FINDINGS.md). Here a program (one key head of one sequence; Hv == Hk) of W warps keeps that
state layout (thread (w, l) holds rows w, w + W, ... and columns 4l..4l+3: 16-byte loads of the row-major state)
and arranges the rest so that two barriers remain:
  - warps 0, 1, 2 convolve q, k and v (lane l: channels 4l..4l+3, rounded to bf16 after silu) and shift their
    windows; the three parts meet in shared memory behind the first barrier (a warp holds one part's windows and
    weights, not three: at 8 warps a thread fits 128 registers);
  - every warp then takes the l2norms, k . q and later the output norm by warp shuffles, and S^T k, S^T q from the
    state as loaded, side by side (the norms scale the sums afterwards): u = beta (v - decay S^T k),
    o = decay S^T q + (k . q) u, S = decay S + k u^T; the warps' partial sums meet behind the second barrier.
What no kernel of the step writes (the slot, states, conv windows and weights) is loaded before the PDL wait, as the
Triton kernel's EARLY path does; q, k, v, z, a and b right after it. Rounding as kernels/gdn_decode.py (conv
outputs, o and the normed o in bf16); the sums' order differs (fp32 rounding only).

Supported: bf16 activations and weights (A_log and dt_bias bf16 or fp32), fp32 states, dk = dv = 128, 4 conv taps,
one value head a key head (0.8B, 2B; 9B's two value heads a key head stay on the Triton kernel). `supports` says
whether a call can run here. Compiled once per GdnDecodeConfig; compiling needs no GPU (CUTE_DSL_ARCH=sm_90a).
"""
import dataclasses
import functools
import operator

import torch

from kernels import pdl, stamps
from kernels.cute_runtime import CompileCache, cu_stream, device_stamps, dsl_available

HEAD_DIM = 128  # dk = dv
TAPS = 4  # conv kernel width: 3 stored taps and the new token
LANE_COLS = 4  # channels (and state columns) a lane owns: one 16-byte fp32 vector
STAMP_FIELDS = len(stamps.FIELDS)
GATE_DTYPES = {torch.bfloat16: "BFloat16", torch.float32: "Float32"}  # A_log, dt_bias
# at most half an SM's registers, so that a GEMV CTA of the step (the out-proj chain's: ~16k registers) fits beside a
# program while it runs (the chain launches at its PDL wait and fills its weight ring during it): at 8 warps 128 a
# thread (32 bytes of spill), at 4 warps 248. The shared-memory carveout stays at its maximum, as the GEMVs beside it
# need (and the bound then needs no device query)
MIN_BLOCKS = 2
PART_BARRIER = 1  # named barrier of the partial sums' exchange (0 is __syncthreads)


@dataclasses.dataclass(frozen=True)
class GdnDecodeConfig:
    warps: int = 8  # W: a thread holds HEAD_DIM / W state rows x 4 columns
    slots_int64: bool = True  # state_slots' dtype
    gate_dtype: str = "BFloat16"  # A_log's and dt_bias' ("BFloat16" or "Float32")
    pdl: bool = True
    stamps: bool = False

    def validate(self) -> "GdnDecodeConfig":
        if self.warps not in (4, 8, 16):
            raise ValueError(f"warps must be 4, 8 or 16, got {self.warps}")
        if self.gate_dtype not in GATE_DTYPES.values():
            raise ValueError(f"gate_dtype must be one of {sorted(GATE_DTYPES.values())}, got {self.gate_dtype!r}")
        return self


def supports(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, num_k_heads) -> bool:
    """Whether a checked call (gdn_decode._check_args passed) can run on this kernel."""
    _, hv, dk, dv = recurrent_states.shape
    tensors = (qkv, z, b, a, conv_w, norm_w)
    return (dsl_available() and qkv.device.type == "cuda" and pdl.enabled(qkv.device) and _sm90(qkv.device.index)
            and hv == num_k_heads
            and dk == dv == HEAD_DIM and conv_w.shape[1] == TAPS and all(t.dtype == torch.bfloat16 for t in tensors)
            and A_log.dtype == dt_bias.dtype and A_log.dtype in GATE_DTYPES
            and qkv.stride(0) % LANE_COLS == 0 and z.stride(0) % LANE_COLS == 0
            and all(t.data_ptr() % 16 == 0 for t in (qkv, z, conv_w, norm_w, conv_states, recurrent_states)))


@functools.cache
def _sm90(index: int | None) -> bool:
    """Whether CUDA device `index` (None: the current one) is sm_90 (asked once: eager decode asks every layer)."""
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.cache
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64
    try:
        from cutlass.memory import SmemAllocator
    except ImportError:  # pragma: no cover
        from cutlass.utils import SmemAllocator
    stamp, stamp_end = device_stamps()
    D, C3 = HEAD_DIM, TAPS - 1

    class GdnDecodeSm90:
        def __init__(self, cfg: GdnDecodeConfig):
            self.cfg = cfg

        @cute.jit
        def __call__(self, qkv_ptr: cute.Pointer, z_ptr: cute.Pointer, b_ptr: cute.Pointer, a_ptr: cute.Pointer,
                     conv_w_ptr: cute.Pointer, a_log_ptr: cute.Pointer, dt_bias_ptr: cute.Pointer,
                     norm_w_ptr: cute.Pointer, conv_ptr: cute.Pointer, state_ptr: cute.Pointer,
                     slots_ptr: cute.Pointer, out_ptr: cute.Pointer, stamps_ptr: cute.Pointer | None, batch: Int32,
                     heads: Int32, num_slots: Int32, stride_qkv: Int32, stride_z: Int32, stride_b: Int32,
                     stride_a: Int32, scale: Float32, eps: Float32, stream: cuda.CUstream):
            """qkv (B, C) with C = 3 heads x 128 channels [q | k | v] a head; z (B, heads x 128), b, a (B, heads):
            rows at their strides (views of one projection); conv_w (C, 4); A_log, dt_bias (heads,); norm_w
            (128,); conv_states (slots, C, 3) and recurrent_states (slots, heads, 128, 128) fp32, updated in place
            at state_slots (B,); out (B, heads x 128)."""
            cfg = self.cfg
            c = 3 * heads * D
            qkv_stride = cute.assume(stride_qkv, divby=LANE_COLS)
            z_stride = cute.assume(stride_z, divby=LANE_COLS)
            mQKV = cute.make_tensor(qkv_ptr, cute.make_layout((batch, c), stride=(qkv_stride, 1)))
            mZ = cute.make_tensor(z_ptr, cute.make_layout((batch, heads * D), stride=(z_stride, 1)))
            mB = cute.make_tensor(b_ptr, cute.make_layout((batch, heads), stride=(stride_b, 1)))
            mA = cute.make_tensor(a_ptr, cute.make_layout((batch, heads), stride=(stride_a, 1)))
            mConvW = cute.make_tensor(conv_w_ptr, cute.make_layout((c, TAPS), stride=(TAPS, 1)))
            mALog = cute.make_tensor(a_log_ptr, cute.make_layout(heads))
            mDtBias = cute.make_tensor(dt_bias_ptr, cute.make_layout(heads))
            mNormW = cute.make_tensor(norm_w_ptr, cute.make_layout(D))
            # a slot's windows as one row, so that a lane's 4 channels x 3 taps are 12 contiguous values (8-byte loads)
            mConv = cute.make_tensor(conv_ptr, cute.make_layout((num_slots, c * C3),
                                                                stride=(cute.assume(c * C3, divby=LANE_COLS), 1)))
            mState = cute.make_tensor(state_ptr, cute.make_layout((num_slots * heads, D, D), stride=(D * D, D, 1)))
            mSlots = cute.make_tensor(slots_ptr, cute.make_layout(batch))
            mOut = cute.make_tensor(out_ptr, cute.make_layout((batch, heads * D), stride=(heads * D, 1)))
            mStamps = None
            if cutlass.const_expr(cfg.stamps):
                mStamps = cute.make_tensor(stamps_ptr, cute.make_layout(STAMP_FIELDS))

            @cute.struct
            class SharedStorage:
                qkv: cute.struct.Align[cute.struct.MemRange[Float32, 3 * D], 16]  # the conv's q | k | v
                part: cute.struct.Align[cute.struct.MemRange[Float32, 2 * cfg.warps * D], 16]  # a | b partials

            self.shared_storage = SharedStorage
            self.kernel(mQKV, mZ, mB, mA, mConvW, mALog, mDtBias, mNormW, mConv, mState, mSlots, mOut, mStamps,
                        heads, scale, eps).launch(grid=[heads, batch, 1], block=[32 * cfg.warps, 1, 1],
                                                  stream=stream, use_pdl=cfg.pdl, min_blocks_per_mp=MIN_BLOCKS,
                                                  preferred_smem_carveout=100)

        @cute.kernel
        def kernel(self, mQKV: cute.Tensor, mZ: cute.Tensor, mB: cute.Tensor, mA: cute.Tensor, mConvW: cute.Tensor,
                   mALog: cute.Tensor, mDtBias: cute.Tensor, mNormW: cute.Tensor, mConv: cute.Tensor,
                   mState: cute.Tensor, mSlots: cute.Tensor, mOut: cute.Tensor, mStamps: cute.Tensor | None,
                   heads: Int32, scale: Float32, eps: Float32):
            cfg = self.cfg
            warps = cfg.warps
            rows = D // warps  # state rows a thread holds: w, w + warps, ...
            tidx, _, _ = cute.arch.thread_idx()
            if cutlass.const_expr(cfg.stamps):
                if tidx == 0:
                    stamp(mStamps, 0, 1)  # arrival
            head, seq, _ = cute.arch.block_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            storage = SmemAllocator().allocate(self.shared_storage)
            sQKV = storage.qkv.get_tensor(cute.make_layout((3, D), stride=(D, 1)))
            sPart = storage.part.get_tensor(cute.make_layout((2, warps, D), stride=(warps * D, D, 1)))
            # warp p < 3 convolves part p (q, k, v) of this head, lane l its channels 4l..4l+3: their channel block
            conv_warp = warp < 3
            block = (warp * heads + head) * (D // LANE_COLS) + lane

            # ---- before the PDL wait: what no kernel of the step writes
            slot = Int64(mSlots[seq])
            n = slot * heads + head
            state = []  # rows x (4,) fp32: rows warp + warps i, columns 4l..4l+3
            for i in cutlass.range_constexpr(rows):
                state.append(cute.local_tile(mState[n, warp + warps * i, None], (LANE_COLS,), (lane,)).load())
            old = cute.make_rmem_tensor(cute.make_layout(LANE_COLS * C3), BFloat16)  # 4 channels x 3 taps
            conv_w = cute.make_rmem_tensor(cute.make_layout((LANE_COLS, TAPS), stride=(TAPS, 1)), BFloat16)
            x = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), BFloat16)
            if conv_warp:
                old.store(cute.local_tile(mConv[slot, None], (LANE_COLS * C3,), (block,)).load())
                conv_w.store(cute.local_tile(mConvW, (LANE_COLS, TAPS), (block, 0)).load())
            a_log = Float32(mALog[head])
            dt_bias = Float32(mDtBias[head])
            norm_w = cute.local_tile(mNormW, (LANE_COLS,), (lane,)).load()

            if cutlass.const_expr(cfg.pdl):
                cute.arch.griddepcontrol_wait()  # q, k, v, z, a, b come from the in-projection
                cute.arch.griddepcontrol_launch_dependents()
            t_go = Int64(0)
            if cutlass.const_expr(cfg.stamps):
                if tidx == 0:
                    t_go = stamp(mStamps, 2, 3)
            z = cute.local_tile(mZ[seq, None], (LANE_COLS,), (head * (D // LANE_COLS) + lane,)).load()
            a = Float32(mA[seq, head])
            b = Float32(mB[seq, head])
            if conv_warp:  # the conv, silu rounded to bf16; then the window's shift: taps 1, 2 and the new token
                x.store(cute.local_tile(mQKV[seq, None], (LANE_COLS,), (block,)).load())
                taps = cute.make_tensor(old.iterator, cute.make_layout((LANE_COLS, C3), stride=(C3, 1)))
                cute.local_tile(sQKV[warp, None], (LANE_COLS,), (lane,)).store(self.conv(x.load(), taps, conv_w))
                shifted = cute.make_rmem_tensor(cute.make_layout((LANE_COLS, C3), stride=(C3, 1)), BFloat16)
                for j in cutlass.range_constexpr(LANE_COLS):
                    shifted[j, 0] = taps[j, 1]
                    shifted[j, 1] = taps[j, 2]
                    shifted[j, 2] = x[j]
                cute.local_tile(mConv[slot, None], (LANE_COLS * C3,), (block,)).store(
                    cute.make_tensor(shifted.iterator, cute.make_layout(LANE_COLS * C3)).load())
            softplus_x = a + dt_bias
            softplus = cute.math.log(1.0 + cute.math.exp(cutlass.min(softplus_x, Float32(20.0))))
            if softplus_x > 20.0:  # torch's softplus threshold
                softplus = softplus_x
            decay = cute.math.exp(-cute.math.exp(a_log) * softplus)
            beta = 1.0 / (1.0 + cute.math.exp(-b))
            cute.arch.barrier(barrier_id=PART_BARRIER, number_of_threads=32 * warps)

            # ---- every warp: the l2norms and k . q (shuffles), then S^T k and S^T q of the state as loaded (the
            # thread's rows, unnormalised: the norms scale the sums), the warps' partials meeting in shared memory
            q = cute.local_tile(sQKV[0, None], (LANE_COLS,), (lane,)).load()
            k = cute.local_tile(sQKV[1, None], (LANE_COLS,), (lane,)).load()
            v = cute.local_tile(sQKV[2, None], (LANE_COLS,), (lane,)).load()
            q_scale = cute.math.rsqrt(self.warp_sum(q * q) + 1e-6) * scale
            k_scale = cute.math.rsqrt(self.warp_sum(k * k) + 1e-6)
            kq = self.warp_sum(k * q) * (q_scale * k_scale)
            part_a = state[0] * sQKV[1, warp]
            part_b = state[0] * sQKV[0, warp]
            for i in cutlass.range_constexpr(1, rows):
                part_a = part_a + state[i] * sQKV[1, warp + warps * i]
                part_b = part_b + state[i] * sQKV[0, warp + warps * i]
            cute.local_tile(sPart[0, warp, None], (LANE_COLS,), (lane,)).store(part_a)
            cute.local_tile(sPart[1, warp, None], (LANE_COLS,), (lane,)).store(part_b)
            cute.arch.barrier(barrier_id=PART_BARRIER, number_of_threads=32 * warps)
            sk = cute.local_tile(sPart[0, 0, None], (LANE_COLS,), (lane,)).load()
            sq = cute.local_tile(sPart[1, 0, None], (LANE_COLS,), (lane,)).load()
            for w in cutlass.range_constexpr(1, warps):
                sk = sk + cute.local_tile(sPart[0, w, None], (LANE_COLS,), (lane,)).load()
                sq = sq + cute.local_tile(sPart[1, w, None], (LANE_COLS,), (lane,)).load()
            u = beta * (v - decay * k_scale * sk)  # (4,): columns 4l..4l+3
            o = decay * q_scale * sq + kq * u

            # ---- the new state, the gated norm, the output
            for i in cutlass.range_constexpr(rows):
                k_row = sQKV[1, warp + warps * i] * k_scale
                cute.local_tile(mState[n, warp + warps * i, None], (LANE_COLS,), (lane,)).store(
                    state[i] * decay + k_row * u)
            o = o.to(BFloat16).to(Float32)
            rstd = cute.math.rsqrt(self.warp_sum(o * o) / D + eps)
            y = (o * rstd).to(BFloat16)
            wy = (norm_w.to(Float32) * y.to(Float32)).to(BFloat16)
            zf = z.to(Float32)
            out = wy.to(Float32) * (zf / (1.0 + cute.math.exp(-zf)))
            if warp == 0:
                cute.local_tile(mOut[seq, None], (LANE_COLS,), (head * (D // LANE_COLS) + lane,)).store(
                    out.to(BFloat16))
            if cutlass.const_expr(cfg.stamps):
                cute.arch.barrier(barrier_id=PART_BARRIER, number_of_threads=32 * warps)
                if tidx == 0:
                    stamp_end(mStamps, t_go)

        @cute.jit
        def conv(self, x, old: cute.Tensor, w: cute.Tensor):
            """silu(sum over the taps of window x weight), rounded to bf16, fp32: (4,) channels; old (4, 3) bf16 taps,
            w (4, 4) bf16, x (4,) bf16 the new token's."""
            y = x.to(Float32) * w[None, C3].load().to(Float32)
            for t in cutlass.range_constexpr(C3):
                y = y + old[None, t].load().to(Float32) * w[None, t].load().to(Float32)
            return (y / (1.0 + cute.math.exp(-y))).to(BFloat16).to(Float32)

        @cute.jit
        def warp_sum(self, v) -> Float32:
            """The sum of a (4,) vector over the warp's 32 lanes, in every lane."""
            return cute.arch.warp_reduction(v.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), operator.add)

    return GdnDecodeSm90


def _ptr(dtype_name: str, align: int = 16, address: int = 0):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    return make_ptr(getattr(cutlass, dtype_name), address, cute.AddressSpace.gmem, assumed_align=align)


def compile_config(cfg: GdnDecodeConfig, keep_ptx: bool = False):
    """The compiled kernel of cfg (placeholder pointers and stream: no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    cfg.validate()
    bf16, bf16_2, gate = _ptr("BFloat16"), _ptr("BFloat16", 2), _ptr(cfg.gate_dtype, 2)
    one = cutlass.Int32(1)
    return cute.compile(_kernel_class()(cfg), bf16, bf16, bf16_2, bf16_2, bf16, gate, gate, bf16, bf16,
                        _ptr("Float32"), _ptr("Int64" if cfg.slots_int64 else "Int32", 8 if cfg.slots_int64 else 4),
                        bf16, _ptr("Int64", 8) if cfg.stamps else None, one, one, one, one, one, one, one,
                        cutlass.Float32(1.0), cutlass.Float32(1e-6), make_fake_stream(),
                        options="--keep-ptx" if keep_ptx else None)


_CACHE = CompileCache(compile_config)
WARPS = 8


def launch(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states, state_slots, eps, out):
    """kernels.gdn_decode.gdn_decode_step on this kernel, for a call `supports` accepts (arguments checked there):
    returns out (B, Hv, dv)."""
    import cutlass

    bsz, hv, dv = z.shape
    device = qkv.device
    stamp, stamping = stamps.slot("gdn_decode", device)
    cfg = GdnDecodeConfig(warps=WARPS, slots_int64=state_slots.dtype == torch.int64,
                          gate_dtype=GATE_DTYPES[A_log.dtype], pdl=True, stamps=stamping)

    def ptr(t, name="BFloat16", align=16):
        return _ptr(name, align, t.data_ptr())

    args = (ptr(qkv), ptr(z), ptr(b, align=2), ptr(a, align=2), ptr(conv_w), ptr(A_log, cfg.gate_dtype, 2),
            ptr(dt_bias, cfg.gate_dtype, 2), ptr(norm_w), ptr(conv_states), ptr(recurrent_states, "Float32"),
            ptr(state_slots, "Int64" if cfg.slots_int64 else "Int32", 8 if cfg.slots_int64 else 4), ptr(out),
            ptr(stamp, "Int64", 8) if stamping else None, cutlass.Int32(bsz), cutlass.Int32(hv),
            cutlass.Int32(recurrent_states.shape[0]), cutlass.Int32(qkv.stride(0)), cutlass.Int32(z.stride(0)),
            cutlass.Int32(b.stride(0)), cutlass.Int32(a.stride(0)), cutlass.Float32(recurrent_states.shape[2] ** -0.5),
            cutlass.Float32(eps), cu_stream(torch.cuda.current_stream(device).cuda_stream))
    if device.index in (None, torch.cuda.current_device()):
        _CACHE.get(cfg)(*args)
    else:  # the launch goes to the current device's context
        with torch.cuda.device(device):
            _CACHE.get(cfg)(*args)
    return out
