"""profiles.gpu_clocks: the mean SM clock and power between two stamps, from the samples inside the window only."""
import time

from profiles.gpu_clocks import ClockSampler


def test_mean_takes_the_samples_inside_the_window():
    clocks = ClockSampler()
    clocks.samples = [(1.0, 1000.0, 500.0), (2.0, 1400.0, 600.0), (3.0, 1600.0, 700.0), (4.0, 1980.0, 300.0)]
    assert clocks.mean(1.5, 3.0) == (1500.0, 650.0)
    assert clocks.mean(5.0, 6.0) == (None, None)


def test_sampler_without_samples_reads_none():
    # on the CPU machine there is no nvidia-smi: the context still works and reads no clock
    with ClockSampler(period_ms=20) as clocks:
        t0 = time.time()
    if not clocks.samples:
        assert clocks.mean(t0 - 1, time.time()) == (None, None)
