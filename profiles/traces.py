"""Agent traces for profiles.bench_serving: a JSONL format and a synthetic generator.

A trace is one agent session: turn 1 sends a prompt (a system prompt with tool schemas, shared by every
session, then the task), the model answers, and every later turn sends the whole conversation back unchanged
with new tokens appended (a tool's output). So turn t's prompt is the previous prompt + the previous answer +
turn t's new tokens.

JSONL, one trace a line:
    {"id": "s0", "system_tokens": 4096, "turns": [{"new_tokens": 4096, "max_new": 200}, {"new_ids": [...], ...}]}
Each turn gives its appended tokens as ids (`new_ids`) or as a count (`new_tokens`: seeded random ids), and how
many tokens the model generates (`max_new`, with ignore_eos). `system_tokens` (optional) prepends the shared
system prefix (random ids from the file's seed, the same for every trace) to turn 1; with explicit ids,
`shared_prefix` (optional) says how many leading tokens of turn 1 every trace shares (for the eligible hit rate).

Synthetic variants, shaped like the SWE-style agent sessions published serving records replay (a first turn of
about 50k tokens, then about 800 tokens a turn over 10-15 turns): a shared 4k system prompt and tool schema, then
- short: a first turn of 8k tokens (the shared 4k included), then 10 turns of 300-800 tokens of tool output;
- long: a first turn of 50k tokens, then 12 turns of 800;
each answer 64 to 300 tokens. `scale` multiplies every length (for smoke tests).
"""
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_RANGE = (1000, 150000)  # ordinary text tokens of the Qwen3.5 vocabulary (no special tokens)

VARIANTS = {
    "short": dict(system=4096, first=8192, turns=10, tool=(300, 800), answer=(64, 300)),
    "long": dict(system=4096, first=50000, turns=12, tool=(800, 800), answer=(64, 300)),
}


@dataclass
class Turn:
    new_ids: list[int]  # the tokens this turn appends (turn 1: the whole first prompt)
    max_new: int  # tokens generated (ignore_eos)


@dataclass
class Trace:
    id: str
    turns: list[Turn]
    shared_prefix: int = 0  # leading tokens of turn 1 that every trace shares (system prompt + tool schema)
    meta: dict = field(default_factory=dict)

    def total_tokens(self) -> int:
        return sum(len(t.new_ids) + t.max_new for t in self.turns)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo, hi = TOKEN_RANGE[0], min(TOKEN_RANGE[1], vocab)
    if hi - lo < 256:  # a toy vocabulary: any id
        lo = 0
    return [rng.randrange(lo, hi) for _ in range(n)]


def synthetic(variant: str, num_traces: int, *, vocab: int, scale: float = 1.0, turns: int | None = None,
              max_new: int | None = None, seed: int = 0) -> list[Trace]:
    """num_traces sessions of the short or long variant, sharing one system prefix; `turns` caps the turns (the
    first included), `max_new` the answers."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown trace variant {variant!r}; known: {sorted(VARIANTS)}")
    v = VARIANTS[variant]
    size = lambda n: max(1, round(n * scale))
    system = _ids(random.Random(seed), size(v["system"]), vocab)
    n_turns = 1 + v["turns"] if turns is None else max(1, min(turns, 1 + v["turns"]))
    traces = []
    for i in range(num_traces):
        rng = random.Random(f"{seed}:{variant}:{i}")

        answers = [size(rng.randint(*v["answer"])) for _ in range(n_turns)]
        answers = [min(n, max_new) if max_new is not None else n for n in answers]
        first = system + _ids(rng, max(1, size(v["first"]) - len(system)), vocab)
        ts = [Turn(first, answers[0])]
        for j in range(1, n_turns):
            ts.append(Turn(_ids(rng, size(rng.randint(*v["tool"])), vocab), answers[j]))
        traces.append(Trace(f"{variant}{i}", ts, shared_prefix=len(system),
                            meta=dict(variant=variant, scale=scale, seed=seed)))
    return traces


def load_jsonl(path, *, vocab: int, turns: int | None = None, max_new: int | None = None,
               seed: int = 0) -> list[Trace]:
    """Traces from a JSONL file (see the module docstring); counts become seeded random ids."""
    traces = []
    system_cache: dict[int, list[int]] = {}
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rng = random.Random(f"{seed}:{d.get('id', line_no)}")
            n_sys = int(d.get("system_tokens", 0))
            if n_sys not in system_cache:
                system_cache[n_sys] = _ids(random.Random(seed), n_sys, vocab)
            ts = []
            for j, t in enumerate(d["turns"]):
                ids = [int(x) for x in t["new_ids"]] if "new_ids" in t else _ids(rng, int(t["new_tokens"]), vocab)
                if j == 0:
                    ids = system_cache[n_sys] + ids
                n = int(t.get("max_new", 256))
                ts.append(Turn(ids, min(n, max_new) if max_new is not None else n))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{line_no}: not a trace ({e!r}); see profiles/traces.py") from None
        if not ts or any(t.max_new < 1 or not t.new_ids for t in ts):
            raise ValueError(f"{path}:{line_no}: every turn needs tokens and max_new >= 1")
        if any(not 0 <= x < vocab for t in ts for x in t.new_ids):
            raise ValueError(f"{path}:{line_no}: token ids must lie in [0, {vocab})")
        shared = int(d.get("shared_prefix", n_sys))  # explicit ids: how many lead tokens all traces share
        traces.append(Trace(str(d.get("id", line_no)), ts[:turns] if turns else ts, shared_prefix=shared))
    if not traces:
        raise ValueError(f"{path}: no traces")
    return traces


def write_jsonl(traces: list[Trace], path) -> None:
    """Write traces with explicit ids (what load_jsonl reads back)."""
    with open(path, "w") as f:
        for t in traces:
            turns = [{"new_ids": x.new_ids, "max_new": x.max_new} for x in t.turns]
            f.write(json.dumps({"id": t.id, "shared_prefix": t.shared_prefix, "turns": turns}) + "\n")
