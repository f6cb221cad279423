"""profiles/ptx_wgmma.py on a small hand-written PTX (CPU): equal QK^T groups agree whatever the register numbers and
the order of the instructions that read the accumulator; another descriptor or a permuted accumulator does not."""
from profiles import ptx_wgmma as W

PTX = """
\tmov.b32 \t%r1, __dynamic_shmem__0;
\tadd.s32 \t%r2, %r1, 1024;
\tshr.u32 \t%r3, %r2, 4;
\tand.b32 \t%r4, %r3, 16383;
\tor.b32 \t%r5, %r4, 65536;
\tmov.b32 \t%r6, 1073741888;
\tmov.b64 \t%rd1, {%r5, %r6};
\tadd.s64 \t%rd2, %rd1, OFFSET;
\twgmma.fence.sync.aligned;
{
.reg .pred p;
setp.ne.b32 p, 0, 0;
wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {ACC}, %rd1, %rd2, p, 1,  1, 0, 0;
}
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned \t0;
READS
"""
READS = ["\tmax.f32 \t%r20, %r10, %r11;", "\tcvt.rn.bf16x2.f32 \t%r21, %r11, %r10;", "\tst.shared.b32 \t[%r1], %r21;"]


def ptx(acc="%r10, %r11, %r12, %r13", offset=2, reads=READS):
    return PTX.replace("ACC", acc).replace("OFFSET", str(offset)).replace("READS", "\n".join(reads))


def test_equal_groups_agree_across_numbering_and_order():
    renamed = [r.replace("%r10", "%r40").replace("%r11", "%r41") for r in (READS[1], READS[0], READS[2])]
    problems, pairs = W.compare(ptx(), ptx(acc="%r40, %r41, %r12, %r13", reads=renamed))
    assert problems == [] and pairs == [(0, 0)]
    (row,) = W.summary(ptx())
    assert row["a0"] == 0x4000004000010040 and row["b0"] == 0x4000004000010042  # base 0: Q at 1024 bytes, +2 units


def test_another_descriptor_or_accumulator_order_differs():
    problems, _ = W.compare(ptx(), ptx(offset=4))
    assert problems and "k-block 0 b" in problems[0]
    problems, _ = W.compare(ptx(), ptx(acc="%r11, %r10, %r12, %r13"))  # the struct's first two elements swapped
    assert problems and "what reads the accumulator" in problems[0]
