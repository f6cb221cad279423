"""Prometheus metrics of the server, written in the text exposition format by hand (no client library: the GPU
machine has none).

Counters and histograms are updated by serving.async_engine as requests arrive, produce tokens and end; gauges
are read from the engine's last snapshot (EngineStats) when /metrics is scraped. Every series is prefixed
`fa4_`. Latencies are in seconds.
"""
import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

PREFIX = "fa4_"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Counter:
    """A monotonically growing count, optionally split by one label."""

    def __init__(self, name: str, help_: str, label: str | None = None):
        self.name, self.help, self.label = PREFIX + name, help_, label
        self.values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def get(self, label_value: str = "") -> float:
        return self.values.get(label_value, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for value, amount in sorted(self.values.items()):
            labels = _labels({self.label: value}) if self.label else ""
            lines.append(f"{self.name}{labels} {_number(amount)}")
        return lines


class Histogram:
    """Observations in cumulative buckets (upper bounds, seconds), with their sum and count."""

    def __init__(self, name: str, help_: str, buckets: Iterable[float]):
        self.name, self.help = PREFIX + name, help_
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            lines.append(f"{self.name}_bucket{_labels({'le': _number(bound)})} {total}")
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


def gauge(name: str, help_: str, value: float, kind: str = "gauge") -> list[str]:
    """One unlabelled series whose value is read at scrape time (kind "counter" when it only grows)."""
    name = PREFIX + name
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]


@dataclass(frozen=True)
class EngineStats:
    """The engine's pools and queues, as of the end of the last step (or command) of the engine loop."""
    requests_waiting: int = 0  # submitted, not yet running (the queue that --max-queued bounds)
    requests_running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # pages a new request can take: never used, or cached and unreferenced
    kv_blocks_cached: int = 0  # unreferenced pages that hold a prefix-cache entry (a subset of the free ones)
    state_slots_total: int = 0  # running sequences' GDN state slots (max_num_seqs)
    state_snapshot_slots_total: int = 0  # the prefix cache's GDN snapshot slots (EngineConfig.snapshot_slots)
    state_slots_free: int = 0
    state_snapshots: int = 0  # published GDN snapshots of the prefix cache
    preemptions: int = 0
    draft_tokens: int = 0  # MTP drafts verified (speculative decoding), since start
    accepted_draft_tokens: int = 0  # of them, those the target kept


class ServingMetrics:
    """The server's counters and latency histograms."""

    def __init__(self):
        self.requests = Counter("requests_total", "Requests that ended, by finish reason "
                                "(stop, length, abort, error).", "finish_reason")
        self.rejected = Counter("requests_rejected_total", "Requests refused before generation, by reason "
                                "(queue_full, invalid, unauthorized, too_large).", "reason")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of requests that reached the engine.")
        self.cached_tokens = Counter("prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix "
                                     "cache (KV pages plus GDN state snapshot).")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.engine_failures = Counter("engine_step_failures_total", "Engine steps that raised.")
        self.ttft = Histogram("time_to_first_token_seconds", "From submission to the first generated token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Between consecutive generated tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = Histogram("request_latency_seconds", "From submission to the end of a request.", TTFT_BUCKETS)

    def observe_finish(self, reason: str, prompt_tokens: int, cached_tokens: int, latency: float) -> None:
        self.requests.inc(label_value=reason)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.e2e.observe(latency)

    def render(self, stats: EngineStats) -> str:
        prompt = self.prompt_tokens.get()
        hit_rate = self.cached_tokens.get() / prompt if prompt else 0.0
        lines = []
        for series in (self.requests, self.rejected, self.prompt_tokens, self.cached_tokens,
                       self.generation_tokens, self.engine_failures, self.ttft, self.itl, self.e2e):
            lines += series.render()
        lines += gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens over prompt tokens, since start.", hit_rate)
        lines += gauge("requests_waiting", "Requests queued for admission (the queue length).",
                       stats.requests_waiting)
        lines += gauge("requests_running", "Requests being generated.", stats.requests_running)
        lines += gauge("kv_blocks_total", "KV cache pages in the pool.", stats.kv_blocks_total)
        lines += gauge("kv_blocks_free", "KV cache pages not held by a request (free or evictable cache).",
                       stats.kv_blocks_free)
        lines += gauge("kv_blocks_cached", "Unreferenced KV pages holding prefix-cache entries.",
                       stats.kv_blocks_cached)
        lines += gauge("state_slots_total", "GDN state slots for running requests (max_num_seqs; the snapshot "
                       "slots are counted apart).", stats.state_slots_total)
        lines += gauge("state_snapshot_slots_total", "GDN state snapshot slots of the prefix cache.",
                       stats.state_snapshot_slots_total)
        lines += gauge("state_slots_free", "GDN state slots not held by a request.", stats.state_slots_free)
        lines += gauge("state_snapshots", "GDN state snapshots held by the prefix cache.", stats.state_snapshots)
        lines += gauge("preemptions_total", "Requests preempted for recomputation.", stats.preemptions, "counter")
        lines += gauge("spec_decode_draft_tokens_total", "MTP draft tokens verified (--speculative-tokens).",
                       stats.draft_tokens, "counter")
        lines += gauge("spec_decode_accepted_tokens_total", "MTP draft tokens the target kept.",
                       stats.accepted_draft_tokens, "counter")
        return "\n".join(lines) + "\n"
