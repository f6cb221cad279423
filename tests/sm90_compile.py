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


def triton_sm90(fn, const: dict, arg_type, num_warps: int, num_stages: int) -> dict:
    """fn (a @triton.jit kernel) with the constexprs `const` and each other argument typed by arg_type(name) (every
    pointer and stride but the page table's row stride taken as 16-byte divisible): shared memory bytes, ptxas's
    registers and spilled bytes, and the TTGIR's wgmma and cp.async counts."""
    sig = {n: "constexpr" if n in const else arg_type(n) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or (n.startswith("stride") and n != "stride_ptb")}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    info = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                          text=True).stderr
    os.unlink(f.name)
    ttgir = k.asm["ttgir"]
    return dict(smem=k.metadata.shared, regs=int(re.search(r"Used (\d+) registers", info).group(1)),
                spill=int(re.search(r"(\d+) bytes spill stores", info).group(1)),
                wgmma=ttgir.count("warp_group_dot "), cp_async=ttgir.count("async_copy_global_to_local"))


def ptx_counts(ptx: str, patterns: dict[str, str]) -> dict[str, int]:
    """How often each pattern stands in a kernel's PTX, by name: what the compile tests check of a CuTe kernel."""
    return {name: ptx.count(text) for name, text in patterns.items()}
