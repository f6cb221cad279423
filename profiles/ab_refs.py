"""The CuTe attention forward of several git refs, timed side by side in one process with flash-attn-4.

    python -m profiles.ab_refs prepare main try/cute-row-rescale     # here: a copy of fa4/ per ref, in ab_refs/
    python -m profiles.ab_refs run [--cases 0,1,2,3] [--iters 40]    # on the GPU (carry ab_refs): every copy

A code change to the kernel (not a config knob, which `bench_prefill --cute-variants` covers) is measured against
its base without two processes: each ref's fa4/ becomes its own package (fa4_<ref>, imports renamed), so each has
its own compile cache and its kernels are timed interleaved with flash-attn-4 in the same process, call by call
(profiles.common.interleaved_us: a best of 3 rounds of 200 ms each moves by 5-15% from round to round,
profiles/FINDINGS.md); vs_fa4 is the median of the iterations' paired ratios.
`prepare` needs git (the GPU machine gets the working tree without it); ab_refs/ is ignored by git, so pass it in
the device run's carry.
Only fa4/ is taken from the ref: kernels/ (the compile cache, the split-KV kernel) and the rest come from the working
tree that runs, so a ref that changes them is not what gets timed.
"""
import argparse
import functools
import importlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from profiles.common import ITERS

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "ab_refs"
IMPORT = re.compile(r"^(\s*(?:from|import)\s+)fa4\b", re.M)  # from fa4[.x] import / import fa4[.x] [as y]


def package_name(ref: str) -> str:
    return "fa4_" + re.sub(r"\W", "_", ref)


def prepare(refs: list[str], folder: Path = FOLDER) -> None:
    """folder/<package>/ = the ref's fa4/ package, its own imports of fa4 renamed to the copy's name."""
    shutil.rmtree(folder, ignore_errors=True)
    for ref in refs:
        name = package_name(ref)
        archive = subprocess.run(["git", "archive", ref, "fa4"], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder / "tmp", filter="data")
        (folder / "tmp" / "fa4").rename(folder / name)
        for path in (folder / name).rglob("*.py"):
            path.write_text(IMPORT.sub(rf"\g<1>{name}", path.read_text()))
        print(f"{ref} -> {folder.name}/{name}")
    (folder / "tmp").rmdir()


def run(cases: list[int], iters: int) -> list[dict]:
    from profiles.bench_prefill import ATTN_CASES, attention_flops, attention_inputs
    from profiles.common import interleaved_us, paired_ratio, peer_attention, print_table, quantile
    sys.path.insert(0, str(FOLDER))
    names = sorted(p.name for p in FOLDER.iterdir() if p.is_dir())
    if not names:
        raise SystemExit("nothing in ab_refs/: run `python -m profiles.ab_refs prepare REF...` first")
    entries = {n: importlib.import_module(f"{n}.cute.entry") for n in names}
    rows = []
    for case in cases:
        b, s, h, kv, d, causal = ATTN_CASES[case]
        q, k, v = attention_inputs(b, s, h, kv, d)
        calls = {n: functools.partial(e.cute_attention, q, k, v, causal=causal, softmax_scale=d ** -0.5)
                 for n, e in entries.items()}
        calls["fa4"] = peer_attention("fa4", q, k, v, causal)
        first = lambda out: (out[0] if isinstance(out, tuple) else out).float()  # noqa: E731
        peer = first(calls["fa4"]())
        errors = {n: ((first(calls[n]()) - peer).norm() / peer.norm()).item() for n in names}
        flops = attention_flops(b, s, h, d, causal)
        times = interleaved_us(calls, iters)
        for n in calls:
            ratio = paired_ratio(times, n, "fa4")
            rows.append({"case": f"B{b} S{s} {h}/{kv} d{d}{' causal' if causal else ''}", "code": n,
                         "TFLOPs": flops / quantile(times[n], 0.5) / 1e6, "vs_fa4": ratio["median"],
                         "vs_fa4_p10_p90": f"{ratio['p10']:.3f}-{ratio['p90']:.3f}",
                         "rel_err_vs_fa4": errors.get(n, 0.0)})
        print_table(rows[-len(calls):], ["case", "code", "TFLOPs", "vs_fa4", "vs_fa4_p10_p90", "rel_err_vs_fa4"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("prepare", help="a copy of fa4/ per git ref, in ab_refs/").add_argument("refs", nargs="+")
    timing = sub.add_parser("run", help="time every prepared copy and flash-attn-4 (GPU)")
    timing.add_argument("--cases", default="0,1,2,3", help="indices into profiles.bench_prefill.ATTN_CASES")
    timing.add_argument("--iters", type=int, default=ITERS, help="interleaved iterations a case")
    timing.add_argument("--out", help="write ab_refs.json into this folder")
    args = ap.parse_args(argv)
    if args.what == "prepare":
        prepare(args.refs)
        return None
    rows = run([int(c) for c in args.cases.split(",")], args.iters)
    if args.out:
        from profiles.common import environment, write_result
        write_result("ab_refs", {"env": environment(), "rows": rows}, args.out)
    return rows


if __name__ == "__main__":
    main()
