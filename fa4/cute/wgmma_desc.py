"""Hopper wgmma shared-memory matrix descriptors built by hand, and an SS wgmma issued with them.

`cute.gemm` lowers a fragment's descriptor at every call, from the shared-memory base, and the DSL's LLVM pipeline
does not hoist the loop-invariant part out of the attention loop (profiles/FINDINGS.md, CuTe forward). Here the low
word (start address, leading byte offset) of a buffer's descriptor is computed once, the high word is a
compile-time constant, and a ring stage or a k-block only adds to them.

Descriptor (PTX ISA, wgmma "matrix descriptor"), 64 bits:
  bits  0-13  start address >> 4 (shared memory, 16-byte units)   } low word
  bits 16-29  leading-dimension byte offset >> 4                   }
  bits 32-45  stride-dimension byte offset >> 4                    } high word
  bits 49-51  base offset (0: every buffer starts on a 1024-byte boundary, config.BUFFER_ALIGN)
  bits 62-63  swizzle mode: 1 = 128-byte (0 none, 2 64-byte, 3 32-byte: not used here)
Shared-memory addresses stay below 2^18 bytes (228 KiB), so start + offset never carries out of bits 0-13.

Only K-major operands with the 128-byte swizzle (both operands of S = Q K^T, sm90_utils' layouts): 8-row
core-matrix groups SBO = 1024 bytes apart along M / N; a k-block of 16 columns is 32 bytes on inside a swizzle row,
then the next swizzle atom (`kblock_offsets`, read from the layout: Q +2 / +4 / +6, +0x200...; K (128 rows)
+0x400...). The leading byte offset is not used by swizzled K-major layouts; it is 1 (16 bytes), as in the DSL's
own descriptors. profiles/ptx_wgmma.py checks the values against the PTX of the default path.
"""
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, nvvm

UNIT = 16  # bytes of one descriptor address unit
ADDRESS_MASK = (1 << 14) - 1  # the start address field
K_MAJOR_LBO = 1
CORE_ROWS = 8  # rows of a core matrix: the stride byte offset is the step between 8-row groups
SWIZZLE_128B = 1  # mode; the layout's Swizzle<3, 4, 3> (on byte addresses: 8 chunks of 16 bytes a row)


def _units(elements: int, dtype) -> int:
    size = elements * dtype.width // 8
    assert size % UNIT == 0, f"offset of {size} bytes is not a multiple of {UNIT}"
    return size // UNIT


def high_word(layout: cute.ComposedLayout, dtype) -> int:
    """The descriptor's high word for a K-major swizzled smem layout ((rows, k, stages), DSL atom layout): the
    stride byte offset (rows 0 -> 8) and the swizzle mode."""
    swizzle = layout.inner
    assert (swizzle.num_bits, swizzle.num_base, swizzle.num_shift) == (3, 4, 3), f"not the 128-byte swizzle: {swizzle}"
    sbo = _units(cute.crd2idx((CORE_ROWS, 0, 0), layout.outer), dtype)
    return sbo | SWIZZLE_128B << 30


def kblock_offsets(layout: cute.ComposedLayout, dtype, k_step: int) -> list[int]:
    """Start-address offsets (16-byte units) of the k-blocks (k_step columns each) of one stage of `layout`."""
    k = cute.size(layout.outer, mode=[1])
    return [_units(cute.crd2idx((0, kb * k_step, 0), layout.outer), dtype) for kb in range(k // k_step)]


def stage_offset(layout: cute.ComposedLayout, dtype) -> int:
    """Start-address offset (16-byte units) from one stage of `layout` to the next."""
    return _units(cute.crd2idx((0, 0, 1), layout.outer), dtype)


def low_word(smem_ptr: cute.Pointer) -> Int32:
    """The low word of a descriptor starting at smem_ptr: start address >> 4 and the leading byte offset."""
    return ((smem_ptr.toint() >> 4) & ADDRESS_MASK) | (K_MAJOR_LBO << 16)


def descriptor(low: Int32, high: int) -> Int64:
    """(high << 32) | low, packed by an inline `mov.b64` that LLVM cannot see through: offsets added to it stay
    64-bit adds of the hoisted value (ptxas: one UIADD3.64 each), where a visibly constant high word is split off
    again and rematerialised (a UMOV) before every wgmma."""
    return Int64(llvm.inline_asm(Int64.mlir_type, [Int32(low).ir_value(), Int32(high).ir_value()],
                                 "mov.b64 $0, {$1, $2};", "=l,r,r"))


class KMajorOperand:
    """The descriptors of a K-major smem operand (a tensor (rows, k[, stages]) of `layout`): k-block kb of stage s
    is (high << 32 | low0 + s * stage) + offsets[kb]. Built before the loops; `descriptors(s)` in them adds the
    stage to the hoisted low word and the k-block offsets to the packed descriptor."""

    def __init__(self, tensor: cute.Tensor, layout: cute.ComposedLayout, dtype, k_step: int):
        self.high = high_word(layout, dtype)
        self.offsets = kblock_offsets(layout, dtype, k_step)
        self.stage = stage_offset(layout, dtype)
        self.low0 = low_word(tensor.iterator)

    def descriptors(self, stage: Int32 | None = None) -> list[Int64]:
        """One descriptor a k-block: of the tensor itself, or of ring stage `stage`."""
        base = descriptor(self.low0 if stage is None else self.low0 + stage * self.stage, self.high)
        return [base + offset if offset else base for offset in self.offsets]


def wgmma_ss(acc: cute.Tensor, descs_a: list, descs_b: list, n: int, zero_init: bool):
    """acc (64 x n fp32 per warpgroup, the fragment of make_fragment_C) (+)= sum over k-blocks of A_k B_k^T: one
    m64n{n}k16 bf16 wgmma a k-block, A and B K-major in shared memory (descriptors descs_a[k], descs_b[k]). The
    accumulator goes in and out as one struct of i32 registers in the fragment's element order (what `cute.gemm`
    passes); the wgmmas chain the struct, so no register moves stand between them."""
    size = cute.size(acc)
    struct = ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * size) + ")>")
    value = llvm.mlir_undef(struct)
    for i in range(size):
        value = llvm.insertvalue(value, llvm.bitcast(Int32.mlir_type, acc[i].ir_value()), [i])
    shape = ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {n}, k = 16>")
    for kb, (desc_a, desc_b) in enumerate(zip(descs_a, descs_b, strict=True)):
        value = nvvm.wgmma_mma_async(
            struct, value, desc_a.ir_value(), desc_b.ir_value(), shape,
            nvvm.WGMMATypes.bf16, nvvm.WGMMATypes.bf16, nvvm.WGMMATypes.f32,
            nvvm.WGMMAScaleOut.zero if zero_init and kb == 0 else nvvm.WGMMAScaleOut.one,
            nvvm.WGMMAScaleIn.one, nvvm.WGMMAScaleIn.one, nvvm.MMALayout.row, nvvm.MMALayout.col)
    for i in range(size):
        acc[i] = Float32(llvm.bitcast(Float32.mlir_type, llvm.extractvalue(Int32.mlir_type, value, [i])))
