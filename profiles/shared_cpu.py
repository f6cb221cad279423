"""A host-bound machine on a fast one: this process's threads pinned to one CPU that `hogs` busy processes share,
so the host gets about 1 / (hogs + 1) of a core while the GPU is unchanged (bench_serving --host-hogs). It also
waits for the scheduler to hand the CPU back after each wait for the GPU, which a slow but idle host does not: it
overstates a slow host (profiles/FINDINGS.md, serving)."""
import contextlib
import os
import subprocess
import sys


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


@contextlib.contextmanager
def shared_cpu(hogs: int):
    """Inside: every thread of this process (and those it starts) on one CPU, with `hogs` busy-looping processes
    on the same CPU. hogs = 0 changes nothing."""
    if hogs < 0:
        raise ValueError(f"hogs must be >= 0, got {hogs}")
    if hogs == 0:
        yield
        return
    cpu = min(os.sched_getaffinity(0))
    before = {tid: os.sched_getaffinity(tid) for tid in _threads()}
    procs = []
    try:
        for tid in before:
            os.sched_setaffinity(tid, {cpu})
        for _ in range(hogs):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
            os.sched_setaffinity(procs[-1].pid, {cpu})
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for tid in _threads():  # threads started inside inherit the one CPU: give them the main thread's set
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, before[os.getpid()]))
