"""The CuTe forward's steady-state loop in SASS, ours beside flash-attn-4's, compiled on the CPU for sm_90a.

    python -m profiles.sass_loop --cases 0,2            # ours (this tree's fa4/) and flash-attn-4, per case
    python -m profiles.sass_loop --cases 0 --refs       # and every copy in ab_refs/ (profiles.ab_refs prepare REF...)
    python -m profiles.sass_loop --cases 0 --no-peer --set hoisted_qk_desc=True   # ours with config overrides

No GPU. Ours compiles through fa4.cute.compile_cache (the config `flash_attention` picks for the case); flash-attn-4
compiles through its own interface in torch's fake-tensor mode (FLASH_ATTENTION_ARCH=sm_90, its documented CPU-only
path; `pip install flash-attn-4==4.0.0b36` with its dependencies, the version of the project's peer figures). Both
cubins come from the DSL's own ptxas; Triton's nvdisasm disassembles them. The loop is the innermost one that issues
a tile's QK^T (wgmma, A from shared memory) and PV (A from registers, B transposed) and holds the exps.

Per kernel it prints the loop's instruction mix and the order of its events: the K/V pipeline waits (`wait`), the
ping-pong barriers (`bar`, `arv`), the wgmma issue and its waits (`depbar<=N`), the row shuffles (`shfl`), the
rescale vote, the stage releases (`rel`), and how many of the exps come before the wait for the previous PV. This is
the static side of an ncu source view: it shows what a loop change did to the schedule before GPU time is spent on
timing it (`profiles.ab_refs run`). Counts are of the loop's text, branches not taken included (the mask block on
an unmasked tile, the rare rescale): they are not executed counts.
"""
import argparse
import ast
import collections
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")
MIX = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "BRA")


def parse_sass(text: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm text -> (instructions in order, without address and ';'; label -> index of its next instruction)."""
    instrs, labels = [], {}
    for line in text.splitlines():
        label = LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        instr = INSTR.search(line)
        if instr:
            instrs.append(instr.group(2))
    return instrs, labels


def opcode(instr: str) -> str:
    """The opcode with its modifiers (`WARPGROUP.DEPBAR.LE`), predicate guard dropped."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0]


def is_qk(instr: str) -> bool:
    return opcode(instr).startswith("HGMMA") and "tnspB" not in instr


def is_pv(instr: str) -> bool:
    return opcode(instr).startswith("HGMMA") and "tnspB" in instr


def steady_loop(instrs: list[str], labels: dict[str, int]) -> list[str]:
    """The smallest loop (a backward branch's target .. the branch) that holds QK^T and PV wgmmas and exps."""
    best = None
    for end, instr in enumerate(instrs):
        target = BRANCH.search(instr)
        start = labels.get(target.group(1), end + 1) if target else end + 1
        if start > end:
            continue
        body = instrs[start:end + 1]
        if (any(map(is_qk, body)) and any(map(is_pv, body)) and any(opcode(i).startswith("MUFU") for i in body)
                and (best is None or len(body) < len(best))):
            best = body
    if best is None:
        raise ValueError("no loop holds both GEMMs and the exps")
    return best


def event(instr: str) -> str | None:
    """A short name for the loop's synchronisation and ordering points, None for the rest."""
    op = opcode(instr)
    if "TRYWAIT" in op:
        return "wait"
    if op.startswith("SYNCS.ARRIVE"):
        return "rel"
    if op.startswith("BAR.SYNC"):
        return "bar"
    if op.startswith("BAR.ARV"):
        return "arv"
    if op.startswith("WARPGROUP.DEPBAR"):
        return f"depbar<={int(instr.split(',')[-1], 0)}"
    if op.startswith("SHFL"):
        return "shfl"
    if op.startswith("VOTE"):
        return "vote"
    if op.startswith("HGMMA"):
        return "pv" if is_pv(instr) else "qk"
    return None


def loop_summary(body: list[str]) -> dict:
    """Instruction mix, the exps before the wait for the previous PV (the first `depbar<=0`), and the event order
    (runs of the same event folded: `qk x8`)."""
    ops = collections.Counter(opcode(i).split(".")[0] for i in body)
    pv_wait = next((k for k, i in enumerate(body) if event(i) == "depbar<=0"), len(body))
    exps_before = sum(opcode(i).startswith("MUFU") for i in body[:pv_wait])
    events = []
    for k, instr in enumerate(body):
        name = event(instr)
        if name is None:
            continue
        if events and events[-1][1] == name and name in ("qk", "pv"):
            events[-1][2] += 1
        else:
            events.append([k, name, 1])
    order = " ".join(f"{k}:{name}" + (f" x{n}" if n > 1 else "") for k, name, n in events)
    return {"instructions": len(body), **{op: ops[op] for op in MIX}, "uniform": sum(
        n for op, n in ops.items() if op.startswith("U")), "exps_before_pv_wait": exps_before, "events": order}


def nvdisasm() -> Path:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise SystemExit(f"nvdisasm not found at {path} (it ships with Triton's NVIDIA backend)")
    return path


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm()), "-c", f.name], capture_output=True, text=True, check=True).stdout


def ours_cubin(package: str, case: tuple, overrides: dict | None = None) -> bytes:
    """The cubin of `package`'s CuTe forward (this tree's fa4, or a copy in ab_refs/) for a bench_prefill case, with
    `overrides` of its config's fields."""
    import cutlass.cute as cute
    config = importlib.import_module(f"{package}.cute.config")
    compile_cache = importlib.import_module(f"{package}.cute.compile_cache")
    kernel = importlib.import_module(f"{package}.cute.kernel")
    _, _, h, kv, d, causal = case
    cfg = config.choose_config(d, causal, h, kv, **(overrides or {})).validate()
    compiled = cute.compile(kernel.FlashAttentionForwardSm90(cfg), *compile_cache._example_args(cfg),
                            options="--keep-cubin")
    return compiled.__cubin__


def fa4_cubin(case: tuple) -> bytes:
    """flash-attn-4's sm90 forward for a bench_prefill case, compiled in fake-tensor mode (no GPU)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.interface import _flash_attn_fwd
    except ImportError as e:
        raise SystemExit(f"flash-attn-4 is not importable ({e}): pip install flash-attn-4==4.0.0b36") from e
    b, s, h, kv, d, causal = case
    _flash_attn_fwd.compile_cache.clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(b, s, kv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        flash_attn_func(q, k, v, causal=causal)
    (compiled,) = _flash_attn_fwd.compile_cache.cache.values()
    return compiled.__cubin__


def set_cpu_compile_env(dump_dir: str) -> None:
    """Before the DSL and flash-attn-4 are imported: compile for sm_90a without a GPU, keep cubins in dump_dir."""
    os.environ.update(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=dump_dir, QUACK_CACHE_ENABLED="0")


def parse_overrides(items: list[str]) -> dict:
    """["field=literal", ...] -> {field: value}."""
    overrides = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE")
        overrides[field] = ast.literal_eval(value)
    return overrides


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="0", help="indices into profiles.bench_prefill.ATTN_CASES (d128 / d256)")
    ap.add_argument("--refs", action="store_true", help="also every fa4 copy in ab_refs/ (profiles.ab_refs prepare)")
    ap.add_argument("--no-peer", action="store_true", help="ours only (no flash-attn-4 needed)")
    ap.add_argument("--out", help="write sass_loop.json into this folder")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of our config (a Python literal: hoisted_qk_desc=True, tile_n=176); "
                         "repeatable; not applied to the ab_refs copies")
    args = ap.parse_args(argv)
    overrides = parse_overrides(args.set)
    set_cpu_compile_env(tempfile.mkdtemp(prefix="sass_loop_"))
    from profiles.bench_prefill import ATTN_CASES
    from profiles.common import environment, print_table, write_result
    packages = ["fa4"]
    if args.refs:
        folder = ROOT / "ab_refs"
        sys.path.insert(0, str(folder))
        packages += sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []
    rows = []
    for case in (ATTN_CASES[int(c)] for c in args.cases.split(",")):
        b, s, h, kv, d, causal = case
        builds = {"ours" if p == "fa4" else p: functools.partial(ours_cubin, p, case, overrides if p == "fa4" else None)
                  for p in packages}
        if not args.no_peer:
            builds["flash-attn-4"] = functools.partial(fa4_cubin, case)
        for code, build in builds.items():
            body = steady_loop(*parse_sass(disassemble(build())))
            rows.append({"case": f"B{b} S{s} {h}/{kv} d{d}{' causal' if causal else ''}", "code": code,
                         **loop_summary(body)})
    print_table(rows, ["case", "code", "instructions", *MIX, "uniform", "exps_before_pv_wait"])
    for row in rows:
        print(f"{row['case']} {row['code']}: {row['events']}")
    if args.out:
        write_result("sass_loop", {"environment": environment(), "what": __doc__.split("\n")[0], "rows": rows},
                     args.out)
    return rows


if __name__ == "__main__":
    main()
