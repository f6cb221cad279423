"""A Triton kernel compiled for sm_90a on the CPU, and what ptxas says of it: the compile tests' subprocess scripts
(conftest.compiled_script_output, where Triton's interpreter is off) import this."""
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
# What a 2B decode layer's out-proj chain CTA (kernels.tma_gemv) holds of an SM, at most: registers (52 a thread by
# sm_90a ptxas, allocated in 8s, 288 threads) and shared memory (the 128 KB ring, x's 12 KB and 1 KB for its
# barriers: tma_gemv's own bound). test_chain_compiles_for_sm90 checks that it still fits them;
# test_split_kernel_keeps_two_programs_an_sm whether the decode split's programs leave room for it.
CHAIN_CTA_REGS, CHAIN_CTA_SMEM = 56 * 288, 128 * 1024 + 2 * 6144 + 1024


def triton_sm90(fn, const: dict, arg_type, num_warps: int, num_stages: int) -> dict:
    """fn (a @triton.jit kernel) with the constexprs `const` and each other argument typed by arg_type(name) (every
    pointer and stride but the page table's row stride taken as 16-byte divisible): shared memory bytes, ptxas's
    registers and spilled bytes, the TTGIR's wgmma and cp.async counts, and the PTX."""
    sig = {n: "constexpr" if n in const else arg_type(n) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_ptb")}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    info = ptxas_sm90a(k.asm["ptx"])
    ttgir = k.asm["ttgir"]
    return dict(smem=k.metadata.shared, regs=info["regs"], spill=info["spill"],
                wgmma=ttgir.count("warp_group_dot "), cp_async=ttgir.count("async_copy_global_to_local"),
                ptx=k.asm["ptx"])


def cuda_ptxas() -> str:
    """The CUDA toolkit's ptxas (nvidia-cuda-nvcc): CuTe-DSL's PTX is newer than Triton's ptxas reads."""
    import nvidia.cuda_nvcc
    return os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin", "ptxas")


def ptxas_sm90a(ptx: str, ptxas: str = PTXAS) -> dict:
    """ptxas -v on a kernel's PTX for sm_90a: registers a thread, spilled bytes (None where it reports none) and how
    many wgmma fences it injected itself (warning C7519)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx.rstrip(chr(0)))
    info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                          text=True).stderr
    os.unlink(f.name)
    regs, spill = re.search(r"Used (\d+) registers", info), re.search(r"(\d+) bytes spill stores", info)
    return {"regs": int(regs.group(1)) if regs else None, "spill": int(spill.group(1)) if spill else None,
            "injected_fences": info.count("C7519"), "info": info}


def split_kernel_sm90(**overrides) -> dict:
    """kernels.paged_decode_attention's decode split kernel at the 2B attention shape (bf16 d256 GQA 4, one query,
    pages of 16, the first tile's L2 prefetch on, no stamps; overrides replace constexprs) through triton_sm90."""
    from kernels import paged_decode_attention as P
    tile = P.plan(1, 4, 256, 2)
    bf16 = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "gate_ptr")

    def arg_type(n: str) -> str:
        return ("*bf16" if n in bf16 else "*fp32" if n.startswith("ws_") else "*i64" if n == "stamps_ptr" else
                "*i32" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32")
    const = dict(Q_LEN=1, VARLEN=True, GROUP=4, HEAD_DIM=256, PAGE_SIZE=16, BLOCK_M=tile.block_m,
                 BLOCK_N=tile.block_n, DIRECT=False, HAS_GATE=True, DOT_PRECISION="tf32", PREFETCH=True,
                 STAMPS=False, PDL=True)
    return triton_sm90(P._split_kernel, {**const, **overrides}, arg_type, tile.num_warps, tile.num_stages)


def ptx_counts(ptx: str, patterns: dict[str, str]) -> dict[str, int]:
    """How often each pattern stands in a kernel's PTX, by name: what the compile tests check of a CuTe kernel."""
    return {name: ptx.count(text) for name, text in patterns.items()}


def parity_resets_in_loops(ptx: str) -> int:
    """How many zeroings (`mov.b32 %rN, 0;`) of an mbarrier wait's parity register stand inside a loop of the
    kernel's PTX (a later branch jumps back over them). A ring's pipeline state starts once and is carried from there
    on; a reset inside the loop over a CTA's blocks re-waits slot 0 at phase 0, as the DSL made of tma_gemv's
    consumer state when a helper advanced it without the loop assigning it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\$\w+):", line))}
    back_edges = [(labels[m.group(1)], i) for i, line in enumerate(lines)
                  if (m := re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)) and labels.get(m.group(1), i) < i]
    parities = set(re.findall(r"mbarrier\.try_wait\.parity[\w.]*\s+\w+,\s*\[[^\]]+\],\s*(%r\d+)", ptx))
    zeroings = [i for i, line in enumerate(lines)
                if (m := re.match(r"\s*mov\.b32\s+(%r\d+),\s*0;", line)) and m.group(1) in parities]
    return sum(any(top < i < bottom for top, bottom in back_edges) for i in zeroings)
