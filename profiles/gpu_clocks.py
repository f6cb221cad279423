"""The SM clock and board power while something runs: nvidia-smi sampled in the background.

Why: near the power cap the card's clock depends on the kernel, so two kernels that take the same cycles can differ
in time. A paired benchmark (profiles.common.interleaved_us) alternates the kernels within milliseconds, so they
share one clock; a kernel run alone back to back for seconds settles at its own. `ClockSampler.mean(t0, t1)`
averages the samples between two time.time() stamps.
"""
import shutil
import subprocess
import threading
import time


class ClockSampler:
    """with ClockSampler(period_ms) as clocks: ... clocks.mean(t0, t1) -> (SM MHz, watts) or (None, None) without
    nvidia-smi (the CPU machine)."""

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.samples: list[tuple[float, float, float]] = []  # (time.time(), SM MHz, W)
        self._proc = None

    def __enter__(self) -> "ClockSampler":
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,"
                                           "nounits", "-i", "0", "-lms", str(self.period_ms)],
                                          stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" or a header
                continue
            self.samples.append((time.time(), mhz, watts))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def mean(self, t0: float, t1: float) -> tuple[float | None, float | None]:
        got = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not got:
            return None, None
        return sum(m for m, _ in got) / len(got), sum(w for _, w in got) / len(got)
