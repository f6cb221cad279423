"""Shared benchmark plumbing: timing, the bandwidth ceilings of this run, the environment record, tables, JSON."""
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def bench_us(fn: Callable[[], object], *, graph: bool = False, rep_ms: int = 200) -> float:
    """Median time of fn() in microseconds, after warm-up; replayed from a CUDA graph when graph=True."""
    import triton.testing
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def round_order(names: list[str], r: int) -> list[str]:
    """The timing order of round r: rotated by r, so that no call is always timed first, or always right after
    the same one (a call always timed last read ~9% apart in two harnesses: profiles/FINDINGS.md, CuTe forward)."""
    r %= len(names)
    return names[r:] + names[:r]


@dataclass(frozen=True)
class Clock:
    """Time stamps on the device's timeline: stamp() marks the point of the stream, us(a, b) the microseconds
    between two marks (after sync()). CUDA events by default; tests pass a fake."""
    stamp: Callable[[], object]
    us: Callable[[object, object], float]
    sync: Callable[[], None]


def cuda_clock() -> Clock:
    def stamp():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return Clock(stamp, lambda a, b: 1e3 * a.elapsed_time(b), torch.cuda.synchronize)


ITERS = 40  # interleaved_us's iterations by default: a few seconds a case for the prefill attention calls


def interleaved_us(calls: dict[str, Callable[[], object]], iters: int = ITERS, warmup: int = 3,
                   clock: Clock | None = None) -> dict[str, list[float]]:
    """Microseconds of each call in each of `iters` iterations. An iteration runs every call once, back to back on
    the stream in round_order (rotated by iteration), with a time stamp between two calls, so that the calls
    compared run a few milliseconds apart under the same clock and heat: paired_ratio then cancels the card's
    drift, which moves a call's best-of-3 by 5-15% from round to round (profiles/FINDINGS.md, CuTe forward)."""
    clock = clock or cuda_clock()
    for call in calls.values():
        for _ in range(warmup):
            call()
    iterations = []
    for i in range(iters):
        names, marks = round_order(list(calls), i), [clock.stamp()]
        for name in names:
            calls[name]()
            marks.append(clock.stamp())
        iterations.append((names, marks))
    clock.sync()
    times = {name: [] for name in calls}
    for names, marks in iterations:
        for j, name in enumerate(names):
            times[name].append(clock.us(marks[j], marks[j + 1]))
    return times


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of values, linearly interpolated (q 0.5: the median)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def paired_ratio(times: dict[str, list[float]], name: str, peer: str) -> dict[str, float]:
    """The peer's time over name's, iteration by iteration (above 1: name is faster): median, p10 and p90."""
    ratios = [t_peer / t for t, t_peer in zip(times[name], times[peer])]
    return {"median": quantile(ratios, 0.5), "p10": quantile(ratios, 0.1), "p90": quantile(ratios, 0.9)}


def peer_attention(name: str, q, k, v, causal: bool) -> Callable[[], object]:
    """A call of a peer library's attention over dense (B, S, H, D) / (B, S_k, KV, D) tensors: "cudnn" or "fa2"
    (torch SDPA with that backend; its causal mask is top-left, so only right for S == S_k) or "fa4"
    (flash-attn-4's flash_attn_func)."""
    if name in ("cudnn", "fa2"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def run():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                        enable_gqa=q.shape[2] != k.shape[2])
        return run
    from flash_attn.cute import flash_attn_func
    return lambda: flash_attn_func(q, k, v, causal=causal)


def bandwidth_ceilings(gib: float = 4.0) -> dict[str, float]:
    """TB/s of a read-only pass (a sum over `gib` GiB) and of a device-to-device copy (read + write)."""
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    read_us = bench_us(lambda: torch.sum(x, dtype=torch.float32))
    copy_us = bench_us(lambda: y.copy_(x))
    nbytes = x.numel() * 2
    return {"read_TBps": nbytes / read_us / 1e6, "copy_TBps": 2 * nbytes / copy_us / 1e6}


def host_cpu() -> str:
    """The host's CPU model and its core count (serving figures depend on the host: a step's launches are host
    work)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores)"


def environment() -> dict:
    """The card, the host's CPU and the library versions of this run."""
    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "host_cpu": host_cpu()}
    for pkg in ("triton", "flash-attn-4", "flash-linear-attention", "fla-core", "nvidia-cutlass-dsl",
                "transformers"):
        env[pkg] = version(pkg)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(card=p.name, sms=p.multi_processor_count, memory_GiB=round(p.total_memory / 2**30, 1))
    return env


def print_table(rows: list[dict], columns: list[str], out=None) -> None:
    """An aligned text table of rows (dicts) over the given columns (to out, else the sys.stdout of the call);
    floats get 3 significant digits."""
    out = out or sys.stdout
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    out.write("  ".join(c.rjust(w) for c, w in zip(columns, widths)) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for row in cells:
        out.write("  ".join(v.rjust(w) for v, w in zip(row, widths)) + "\n")


def command_line() -> str:
    """How this process was started, as a user would type it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    entry = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([entry, *sys.argv[1:]])


def plot_series(path: Path, rows: list[dict], x: str, series: list[tuple[str, str]], xlabel: str, ylabel: str, *,
                log_y: bool = False, dashed: tuple[str, ...] = ()) -> None:
    """A small PNG: one line per (row key, label) of `series` against rows[x], on a log2 x axis; keys in `dashed`
    (bounds) are drawn dashed. Raises ImportError without matplotlib (the GPU machine has none: plot from the
    JSON later)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for key, label in series:
        pts = [(r[x], r[key]) for r in rows if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), marker=None if key in dashed else "o", linestyle="--" if key in dashed else "-",
                    label=label)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bars(path: Path, labels: list[str], rows: list[dict], series: list[tuple[str, str]], ylabel: str) -> None:
    """A small PNG of grouped bars: one group per row (its label), one bar per (row key, legend label) of
    `series`. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8), dpi=110)
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        ax.bar([g + i * width for g in range(len(rows))], [r.get(key) or 0.0 for r in rows], width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class TritonCompileLog:
    """Records each Triton kernel compiled while active (name and the wall time it took): a timed run that
    compiles is timing the compiler. Use as a context manager; `names` lists what compiled, in order."""

    def __init__(self):
        self.names: list[str] = []
        self.seconds = 0.0
        self._start = None

    def _before(self, *, fn, **_):
        import time
        self._start = (fn.name, time.perf_counter())
        return None  # None: compile as usual

    def _after(self, *, fn, **_):
        import time
        if self._start is not None and self._start[0] == fn.name:
            self.seconds += time.perf_counter() - self._start[1]
        self.names.append(fn.name)
        return None

    def __enter__(self):
        from triton import knobs
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc):
        from triton import knobs
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
        return False


def progress(row: dict) -> dict:
    """Print one finished row as a JSON line at once (a run cut short by a time limit still shows it); returns it."""
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def write_result(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """profiles/results/<name>.json (or out_dir/<name>.json), with the command that produced it."""
    out_dir = Path(out_dir) if out_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"command": command_line(), **payload}, indent=1))
    return path
