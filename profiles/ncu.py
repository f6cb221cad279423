"""Profile one named kernel with Nsight Compute and record its metrics.

    python -m profiles.ncu --kernel _split_kernel [--out DIR] [--sections S ...] [--name NAME] [-- COMMAND]

Runs `ncu --clock-control none` on the command (by default the quick decode benchmark), keeps one launch of
the kernel after a warm-up, and writes ncu_<name or kernel>.json with the metrics as ncu reports them: DRAM
throughput by default; with --sections (e.g. SpeedOfLight ComputeWorkloadAnalysis WarpStateStats) the summary
metrics of those sections (SM busy, issue slots, warp cycles per instruction; not the stall breakdown, which
--metrics names one by one).
"""
import argparse
import csv
import io
import subprocess
import sys

from profiles.common import RESULTS, environment, print_table, write_result

METRICS = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__bytes_read.sum.per_second", "dram__bytes_read.sum",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed"]


def run_ncu(kernel: str, command: list[str], skip: int, sections: list[str] | None = None,
            metrics: list[str] | None = None) -> list[dict]:
    what = [a for s in sections for a in ("--section", s)] if sections else []
    if metrics or not sections:
        what += ["--metrics", ",".join(metrics or METRICS)]
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{kernel}", "--launch-skip", str(skip),
           "--launch-count", "1", *what, "--csv", *command]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ncu failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = proc.stdout[proc.stdout.find('"ID"'):]
    return [{"kernel": r["Kernel Name"][:60], "metric": r["Metric Name"], "unit": r["Metric Unit"],
             "value": r["Metric Value"]} for r in csv.DictReader(io.StringIO(lines))]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="_split_kernel", help="regex of the kernel name")
    ap.add_argument("--skip", type=int, default=20, help="launches of the kernel to skip (warm-up)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--sections", nargs="+", help="ncu sections to collect instead of the DRAM metrics")
    ap.add_argument("--metrics", type=lambda s: s.split(","),
                    help="comma-separated metrics (with --sections: in addition), e.g. the warp stall ratios "
                         "smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio")
    ap.add_argument("--name", help="result name (ncu_<name>.json); default: the kernel regex")
    args = ap.parse_args(own)
    command = command or [sys.executable, "-m", "profiles.bench_decode", "--quick"]
    rows = run_ncu(args.kernel, command, args.skip, args.sections, args.metrics)
    print_table(rows, ["kernel", "metric", "unit", "value"])
    name = args.name or args.kernel.strip("_")
    path = write_result(f"ncu_{name}", {"env": environment(), "profiled_command": " ".join(command), "metrics": rows},
                        args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
