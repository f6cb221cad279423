"""Closed-loop replay of agent traces through the engine: `python -m profiles.bench_serving --model qwen3.5-2b
--trace short`.

N users (--concurrency) each replay traces (profiles/traces.py: JSONL or the synthetic short/long variants): a user
sends a turn's request (the whole conversation so far, as an agent harness does), waits for the full answer, and
sends the next turn at once. Before timing, one request warms the kernels and puts the shared system prefix in
the prefix cache (a server that has seen any earlier session has it).

Per user it reports TTFT p50/p99 (all turns, and returning turns apart: turn 2 on), time to the final answer of
a trace, decode tok/s (1000 / mean TPOT in ms, TPOT of a request = (last - first token time) / (tokens - 1)),
the plain cache hit rate (cached prompt tokens / prompt tokens, as agent harnesses count it) and the eligible one
(cached / the prompt tokens that an earlier request of the session, or the shared system prefix, had already sent:
what a prefix cache could have served at best), and throughput. It prints a table and adds the run to
profiles/results/serving.json (card, versions, command), keyed by model, trace and concurrency. --hf-baseline then
times transformers' greedy generate on the same config (random weights, batch 1) and reports our batch-1 decode
speed over it.

`--sessions N` replays N traces as sessions interleaved across the users (each idle user takes the next turn of
the least recently served session), so that with N > concurrency a session returns after others ran and its prefix
competes for the caches; it reports the eligible hit rate beside the offline optimum's over the same requests and
KV pool (profiles.belady) and the returning turns' TTFT p50/p99. On a GPU the GDN snapshot pool is sized by
--state-cache-fraction / --state-cache-gb (EngineConfig), on the CPU it has 3C + 16 slots; --snapshot-slots sets
it on either, and --kv-working-set F caps the KV pool at F times the pages the replay writes.

`--sweep interleave=4,8,12 --repeat 2` replays once per value of an engine knob on one loaded model, alternating
the values, and prints them side by side with each value's mean (serving.json keeps every run and a `sweep|...`
summary). Decode kernel knobs sweep the same way by variant name (`--sweep tma_min=16m,8m`;
`prenorm+tma_min=rule/16m,rule/8m` for pairs: profiles.host_time's AB_KNOBS). On the H200
one configuration's c16 figure moves by about 7% from run to run, within one process too, so compare variants this
way rather than across processes.
"""
import gc
import json
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from model import ops
from model.config import Qwen35Config
from model.load import describe_model, load_model
from profiles.belady import belady_hits
from profiles.common import (
    RESULTS,
    TritonCompileLog,
    bandwidth_ceilings,
    command_line,
    environment,
    host_cpu,
    print_table,
    write_result,
)
from profiles.shared_cpu import shared_cpu
from profiles.traces import Trace, load_jsonl, synthetic, write_jsonl
from serving import cli
from serving.config import EngineConfig
from serving.device import pick_device
from serving.engine import LLMEngine, StepPhases
from serving.model_runner import state_slot_bytes
from serving.sequence import SamplingParams

PHASES = ("schedule_ms", "dispatch_ms", "commit_ms", "sample_ms")  # engine.StepPhases' host milliseconds


@dataclass
class Request:
    user: int
    trace: str
    turn: int
    prompt_tokens: int
    eligible_tokens: int
    submit: float
    first: float | None = None
    last: float | None = None
    generated: int = 0
    cached_tokens: int = 0
    first_step: dict | None = None  # the phases (engine.StepPhases, ms) of the step that gave the first token
    order: int = 0  # its submission among the replay's requests
    finish_order: int = 0  # the submissions before it finished
    ids: tuple[array, array] | None = None  # with sessions: its prompt and answer (for profiles.belady)

    @property
    def ttft_ms(self) -> float:
        return 1e3 * (self.first - self.submit)

    @property
    def tpot_ms(self) -> float | None:
        return 1e3 * (self.last - self.first) / (self.generated - 1) if self.generated > 1 else None


class User:
    """One closed-loop client: replays its traces turn after turn."""

    def __init__(self, index: int, traces: list[Trace]):
        self.index, self.queue = index, list(traces)
        self.trace: Trace | None = None
        self.turn = 0
        self.history: list[int] = []  # everything sent and received in the current trace
        self.trace_start = 0.0
        self.trace_times: list[float] = []  # seconds from a trace's first request to its final answer

    def next_prompt(self) -> tuple[list[int], int, int] | None:
        """(prompt, max_new, eligible tokens) of the next request, or None when the user is done."""
        if self.trace is None:
            if not self.queue:
                return None
            self.trace, self.turn, self.history = self.queue.pop(0), 0, []
            self.trace_start = time.perf_counter()
        t = self.trace.turns[self.turn]
        eligible = len(self.history) if self.turn else self.trace.shared_prefix
        return self.history + t.new_ids, t.max_new, eligible

    def finished_turn(self, prompt: list[int], output: list[int], now: float) -> None:
        self.history = prompt + output
        self.turn += 1
        if self.turn == len(self.trace.turns):
            self.trace_times.append(now - self.trace_start)
            self.trace = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


class Sessions:
    """--sessions: the traces as sessions that any user may serve. An idle user takes the next turn of the least
    recently served session (the one whose last answer is the oldest; never-served sessions first, in order) that
    is neither in flight nor done, so with more sessions than users a session's turns come back after others ran."""

    def __init__(self, traces: list[Trace]):
        self.sessions = [User(i, [t]) for i, t in enumerate(traces)]  # a User of one trace is a session's state
        self.last_served = [-1] * len(traces)  # the order of each session's last answer (-1: none yet)
        self.busy: set[int] = set()
        self.done: set[int] = set()
        self.served = 0

    def take(self) -> User | None:
        """The session the next idle user serves, marked in flight; None when none is ready."""
        ready = [i for i in range(len(self.sessions)) if i not in self.busy and i not in self.done]
        if not ready:
            return None
        i = min(ready, key=lambda j: (self.last_served[j], j))
        self.busy.add(i)
        return self.sessions[i]

    def answered(self, session: User) -> None:
        i = session.index
        self.busy.discard(i)
        self.last_served[i], self.served = self.served, self.served + 1
        if session.trace is None and not session.queue:
            self.done.add(i)


def replay(engine: LLMEngine, traces: list[Trace], concurrency: int, progress: bool = True, sessions: bool = False
           ) -> tuple[list[Request], list[User], float, list[tuple[float, StepPhases]]]:
    """Run every trace to its end with `concurrency` closed-loop users. Returns the requests, users, wall time and
    each engine step's (wall ms, phases). Without `sessions` user i replays traces i, i + concurrency, ... one
    after the other; with it the users interleave the traces' turns (Sessions), and a user's trace times are those
    of the sessions whose last turn it served."""
    from tqdm import tqdm
    pool = Sessions(traces) if sessions else None
    if pool is None:
        users = [User(i, traces[i::concurrency]) for i in range(min(concurrency, len(traces)))]
    else:
        users = [User(i, []) for i in range(min(concurrency, len(traces)))]
    live: dict[int, tuple[User, Request, list[int]]] = {}
    owner: dict[int, User] = {}  # with sessions: the user serving each live request
    done: list[Request] = []
    steps: list[tuple[float, StepPhases]] = []
    bar = tqdm(total=sum(len(t.turns) for t in traces), desc="turns", disable=not progress, file=sys.stderr)
    start = time.perf_counter()
    idle = list(users)
    while idle or live:
        waiting = []  # with sessions: users that found no session ready (all others in flight)
        for client in idle:
            u = client if pool is None else pool.take()
            if u is None:
                waiting.append(client)
                continue
            nxt = u.next_prompt()
            if nxt is None:
                continue
            prompt, max_new, eligible = nxt
            seq_id = engine.add_request(prompt, SamplingParams(max_tokens=max_new, ignore_eos=True),
                                        cache_point=min(u.trace.shared_prefix, len(prompt)))
            live[seq_id] = (u, Request(client.index, u.trace.id, u.turn, len(prompt), min(eligible, len(prompt) - 1),
                                       time.perf_counter(), order=len(live) + len(done)), prompt)
            owner[seq_id] = client
        idle = waiting if live else []
        before = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append((1e3 * (now - before), engine.last_step))
        for o in outs:
            u, r, prompt = live[o.seq_id]
            if r.first is None:
                r.first, r.first_step = now, {k: getattr(engine.last_step, k) for k in PHASES}
            r.last, r.generated = now, r.generated + 1
            if o.finished:
                result = engine.pop_output(o.seq_id)
                r.cached_tokens = result.cached_tokens
                if pool is not None:
                    r.ids = array("i", prompt), array("i", result.output_ids)
                    r.finish_order = len(live) + len(done)
                u.finished_turn(prompt, result.output_ids, now)
                client = owner.pop(o.seq_id)
                if pool is not None:
                    if u.trace is None:  # the session's last turn: its trace time is its server's
                        client.trace_times.append(u.trace_times[-1])
                    pool.answered(u)
                del live[o.seq_id]
                done.append(r)
                idle.append(client)
                bar.update(1)
    bar.close()
    return done, users, time.perf_counter() - start, steps


def offline_optimum(requests: list[Request], num_pages: int, page_size: int) -> dict:
    """The eligible hit rate that Belady's MIN over the same requests, in admission order, and the same KV pool
    would get (profiles.belady), and ours over it."""
    ordered = sorted(requests, key=lambda r: r.order)
    # each request was submitted, then finished after finish_order submissions: the events in that order
    events = sorted([(r.order, 0, "admit", i) for i, r in enumerate(ordered)]
                    + [(r.finish_order, -1, "finish", i) for i, r in enumerate(ordered)])
    hits = belady_hits([(list(r.ids[0]), list(r.ids[1])) for r in ordered], num_pages, page_size,
                       [(kind, i) for _, _, kind, i in events])
    eligible = sum(r.eligible_tokens for r in ordered)
    best = sum(min(h, r.eligible_tokens) for h, r in zip(hits, ordered))
    ours = sum(r.cached_tokens for r in ordered)
    return {"belady_eligible_hit_rate": best / eligible if eligible else None,
            "hit_rate_over_belady": ours / best if best else None}


def step_kind(phases: StepPhases) -> str:
    if phases.prefill_tokens == 0:
        return "decode ahead" if phases.ahead else ("decode" if phases.decode_steps else "idle")
    return "mixed" if phases.decode_steps else "prefill"


def step_breakdown(steps: list[tuple[float, StepPhases]], wall_s: float) -> list[dict]:
    """Where a replay's wall time went, by kind of engine step: decode steps launched ahead (their wall is mostly
    the wait for the GPU), other decode steps, mixed steps (a prefill in slices with decode steps between), prefill
    steps; and the bench's own loop between steps. host_busy_ms: a step's wall less its waits for sampled tokens
    (StepPhases.wait_ms), the host's own time: near the wall, the step is host-bound; far below it, GPU-bound."""
    rows = []
    for kind in ("decode ahead", "decode", "mixed", "prefill", "idle"):
        mine = [(ms, p) for ms, p in steps if step_kind(p) == kind]
        if not mine:
            continue
        total = sum(ms for ms, _ in mine)
        decode_steps = sum(p.decode_steps for _, p in mine)
        rows.append({"kind": kind, "steps": len(mine), "wall_s": total / 1e3, "share": total / 1e3 / wall_s,
                     "mean_ms": total / len(mine), "dispatch_ms": sum(p.dispatch_ms for _, p in mine) / len(mine),
                     "host_busy_ms": (total - sum(p.wait_ms for _, p in mine)) / len(mine),
                     "prefill_tokens": sum(p.prefill_tokens for _, p in mine), "decode_steps": decode_steps,
                     "rows_per_decode": sum(p.decode_rows for _, p in mine) / len(mine)})
    outside = wall_s - sum(ms for ms, _ in steps) / 1e3
    rows.append({"kind": "between steps", "steps": None, "wall_s": outside, "share": outside / wall_s})
    return rows


def request_row(r: Request) -> dict:
    """A request's figures; first_<phase>: the phases of the step that gave its first token."""
    return dict(user=r.user, turn=r.turn, prompt=r.prompt_tokens, cached=r.cached_tokens,
                new=r.prompt_tokens - r.cached_tokens, ttft_ms=round(r.ttft_ms, 3),
                tpot_ms=None if r.tpot_ms is None else round(r.tpot_ms, 4), generated=r.generated,
                **{f"first_{k}": round((r.first_step or {}).get(k, 0.0), 3) for k in PHASES})


def request_table(rows: list[dict]) -> dict:
    """request_row dicts as one table, {"columns": [...], "rows": [[...], ...]} (key names repeated per request made
    serving.json the largest result file)."""
    columns = list(rows[0]) if rows else []
    return {"columns": columns, "rows": [[r[c] for c in columns] for r in rows]}


def summarize(requests: list[Request], users: list[User], wall_s: float) -> tuple[list[dict], dict]:
    """Per-user rows and the overall row."""
    def row(name, reqs, trace_times):
        tpots = [r.tpot_ms for r in reqs if r.tpot_ms is not None]
        back = [r.ttft_ms for r in reqs if r.turn > 0]
        prompt = sum(r.prompt_tokens for r in reqs)
        cached = sum(r.cached_tokens for r in reqs)
        eligible = sum(r.eligible_tokens for r in reqs)
        return {
            "user": name, "requests": len(reqs),
            "ttft_p50_ms": percentile([r.ttft_ms for r in reqs], 50),
            "ttft_p99_ms": percentile([r.ttft_ms for r in reqs], 99),
            "ttft_first_turn_ms": percentile([r.ttft_ms for r in reqs if r.turn == 0], 50),
            "ttft_return_p50_ms": percentile(back, 50), "ttft_return_p99_ms": percentile(back, 99),
            # where a returning turn's first step goes (the median of each phase over the returning turns)
            **{f"return_{k}": percentile([r.first_step[k] for r in reqs if r.turn > 0 and r.first_step], 50)
               for k in PHASES},
            "final_answer_s": sum(trace_times) / len(trace_times) if trace_times else None,
            "decode_tok_s": 1e3 / (sum(tpots) / len(tpots)) if tpots else None,
            "hit_rate": cached / prompt if prompt else None,
            "eligible_hit_rate": cached / eligible if eligible else None,
            "prompt_tokens": prompt, "cached_tokens": cached, "eligible_tokens": eligible,
            "generated": sum(r.generated for r in reqs),
        }
    rows = [row(str(u.index), [r for r in requests if r.user == u.index], u.trace_times) for u in users]
    overall = row("all", requests, [t for u in users for t in u.trace_times])
    per_user = [r["decode_tok_s"] for r in rows if r["decode_tok_s"] is not None]
    overall["decode_tok_s"] = sum(per_user) / len(per_user) if per_user else None  # the mean user
    overall["min_user_decode_tok_s"] = min(per_user) if per_user else None
    overall["wall_s"] = wall_s
    overall["throughput_tok_s"] = overall["generated"] / wall_s
    overall["prefill_tok_s"] = (overall["prompt_tokens"] - overall["cached_tokens"]) / wall_s
    return rows, overall


def hf_model(cfg: Qwen35Config, device: torch.device):
    """transformers' Qwen3.5 for cfg, random weights, bf16, built on the device."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig
    hf = cfg.to_hf()
    hf.pop("model_type")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if cfg.is_moe:
                hf.pop("intermediate_size", None)
                return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hf)).eval()
            return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf)).eval()
    finally:
        torch.set_default_dtype(default)


@torch.no_grad()
def hf_decode_tok_s(cfg: Qwen35Config, device: torch.device, prompt_len: int, new_tokens: int) -> dict:
    """transformers' greedy generate at batch 1 on cfg (random weights, bf16): decode tok/s from the time of
    new_tokens tokens minus the time of 1 (the prefill)."""
    import transformers
    hf = hf_model(cfg, device)
    ids = torch.randint(1000, min(150000, cfg.vocab_size), (1, prompt_len), device=device)

    def timed(n: int) -> float:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize(device)
        assert out.shape[1] == prompt_len + n, out.shape
        return time.perf_counter() - t

    timed(2)  # warm-up
    prefill, total = timed(1), timed(new_tokens)
    result = dict(transformers=transformers.__version__, prompt_tokens=prompt_len, new_tokens=new_tokens,
                  prefill_s=prefill, decode_tok_s=(new_tokens - 1) / max(total - prefill, 1e-9))
    try:
        import fla
        result["fla"] = getattr(fla, "__version__", "yes")
    except ImportError:
        result["fla"] = None
    return result


def build_traces(args, vocab: int) -> list[Trace]:
    n = args.sessions or args.num_traces or args.concurrency
    if args.trace in ("short", "long"):
        return synthetic(args.trace, n, vocab=vocab, scale=args.scale, turns=args.turns, max_new=args.max_new,
                         seed=args.seed)
    return load_jsonl(args.trace, vocab=vocab, turns=args.turns, max_new=args.max_new, seed=args.seed)


def working_set_pages(traces: list[Trace], page_size: int) -> int:
    """The pages a replay of traces writes: the shared prefix once, then each trace's own tokens."""
    shared = max((t.shared_prefix for t in traces), default=0)
    return shared // page_size + sum(-(-(t.total_tokens() - shared) // page_size) for t in traces)


def make_engine(model, args, traces: list[Trace]) -> LLMEngine:
    page = args.page_size
    max_len = -(-(max(t.total_tokens() for t in traces) + 1) // page) * page
    slots = 3 * args.concurrency + 16 if args.snapshot_slots is None else args.snapshot_slots
    common = dict(page_size=page, max_num_seqs=args.concurrency, max_model_len=max_len,
                  snapshot_slots=slots, max_num_batched_tokens=args.chunk,
                  fast_lane_tokens=args.fast_lane, cuda_graphs=not args.eager, seed=args.seed,
                  interleave_slices=args.interleave, interleave_slice_tokens=args.interleave_slice_tokens,
                  prefill_graph_tokens=args.prefill_graphs,
                  decode_ahead=bool(args.decode_ahead), fed_decode=bool(args.fed_decode),
                  token_ring=bool(args.token_ring), kv_eviction=args.kv_eviction,
                  state_cache_fraction=args.state_cache_fraction,
                  state_cache_gb=args.state_cache_gb, **cli.speculative_fields(args))
    if args.kv_working_set is not None:  # a fixed pool on either device
        pages = int(args.kv_working_set * working_set_pages(traces, page))
        return LLMEngine(model, EngineConfig(num_pages=max(pages, args.concurrency * max_len // page), **common))
    if model.lm_head.weight.device.type == "cuda":
        if args.snapshot_slots is not None:  # that many slots' bytes (the sizing rounds down to whole slots)
            common["state_cache_gb"] = args.snapshot_slots * state_slot_bytes(model) * (1 + 1e-9) / 2**30
        return LLMEngine(model, EngineConfig.for_gpu_memory(args.gpu_memory_utilization, **common))
    # CPU: room for every user's longest trace plus the cache of one more
    return LLMEngine(model, EngineConfig.for_token_budget((args.concurrency + 1) * max_len, **common))


def warm_up(engine: LLMEngine, traces: list[Trace]) -> None:
    """Compile the kernels of every step shape the replay meets (LLMEngine.warm_up) and cache the shared system
    prefix: a first turn of the prefix plus a few tokens, then a returning turn as long as trace 0's second turn
    (other tokens)."""
    engine.warm_up()
    t = traces[0]
    prefix = t.turns[0].new_ids[:max(t.shared_prefix, 1)]
    first = prefix + [prefix[-1]] * 8
    out = engine.generate([first], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    n_back = len(t.turns[1].new_ids) if len(t.turns) > 1 else 64
    n_back = min(n_back, engine.cfg.max_model_len - len(first) - len(out.output_ids) - 4)  # fits one-turn traces
    back = first + out.output_ids + [(i * 7919) % engine.model.config.vocab_size for i in range(n_back)]
    engine.generate([back], SamplingParams(max_tokens=4, ignore_eos=True))


# engine knobs of the command line, and their defaults: a run with another value gets its own row in serving.json
ENGINE_KNOBS = {"chunk": EngineConfig.max_num_batched_tokens, "fast_lane": 1024, "page_size": 16,
                "interleave": EngineConfig.interleave_slices,
                "interleave_slice_tokens": EngineConfig.interleave_slice_tokens,
                "prefill_graphs": EngineConfig.prefill_graph_tokens,
                "decode_ahead": int(EngineConfig.decode_ahead), "fed_decode": int(EngineConfig.fed_decode),
                "token_ring": int(EngineConfig.token_ring), "kv_eviction": EngineConfig.kv_eviction,
                "speculative_tokens": EngineConfig.speculative_tokens,
                "speculative_draft_vocab": EngineConfig.draft_vocab_size}
BENCH_KNOBS = {"host_hogs": 0}  # the replay's conditions, not the engine's (profiles.shared_cpu)
VALUE_KNOBS = ENGINE_KNOBS.keys() | BENCH_KNOBS.keys()  # swept by value (the rest: decode kernel variants)


def run_key(args) -> str:
    trace = args.trace if args.trace in ("short", "long") else Path(args.trace).name
    mode = "eager" if args.eager else "graphs"
    knobs = "".join(f"|{name}{getattr(args, name)}" for name, default in ENGINE_KNOBS.items()
                    if getattr(args, name) != default)
    if args.sessions:
        knobs += f"|sessions{args.sessions}"
    if args.host_hogs:
        knobs += f"|host_hogs{args.host_hogs}"
    if args.forced_acceptance:
        knobs += f"|forced_L{args.forced_acceptance:g}"
    if args.snapshot_slots is not None:
        knobs += f"|snapshot_slots{args.snapshot_slots}"
    if args.kv_working_set is not None:
        knobs += f"|kv_working_set{args.kv_working_set:g}"
    if args.state_cache_gb is not None:
        knobs += f"|state_cache_gb{args.state_cache_gb:g}"
    elif args.state_cache_fraction != EngineConfig.state_cache_fraction:
        knobs += f"|state_cache_fraction{args.state_cache_fraction:g}"
    return f"{args.model}|{trace}|c{args.concurrency}|{args.device_name}|{mode}{knobs}"


def step_verdict(dispatch_ms: float, sample_ms: float) -> str:
    """What bounds a step, from its phases: the wait for the GPU (in sample) or the dispatch (the host's launches,
    and any host sync inside the model step, which waits for the GPU there)."""
    if sample_ms >= dispatch_ms:
        return "GPU-bound (the wait for the GPU is the longer phase)"
    return "dispatch-bound (host launches, or a host sync inside the model step)"


def main(argv=None, model=None) -> dict:
    """The command line; `model` (a Qwen35ForCausalLM) replaces --model (tests)."""
    ap = cli.Parser(prog=cli.prog("profiles.bench_serving"), description=__doc__)
    ap.add_argument("--model", default=None, type=cli.model_spec,
                    help="preset (random weights) or HF checkpoint folder (default: tiny on the CPU, qwen3.5-2b on "
                         "the GPU)")
    ap.add_argument("--trace", default="short", help="short | long | a JSONL file of traces")
    ap.add_argument("--concurrency", type=cli.positive_int, default=1, help="closed-loop users")
    ap.add_argument("--num-traces", type=cli.positive_int, default=None,
                    help="traces in all (default: one per user)")
    ap.add_argument("--sessions", type=cli.positive_int, default=None, metavar="N",
                    help="replay N sessions (traces) interleaved across the users: each user takes the next turn of "
                         "the least recently served session, so with N > concurrency a session's turns come back "
                         "after other sessions ran (its prefix may be evicted meanwhile)")
    ap.add_argument("--turns", type=cli.positive_int, default=None,
                    help="replay only the first TURNS turns of each trace")
    ap.add_argument("--max-new", type=cli.positive_int, default=None, help="cap every answer at MAX_NEW tokens")
    ap.add_argument("--scale", type=cli.positive_float, default=1.0, help="multiply the synthetic traces' lengths")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the model runs; auto: cuda when a GPU is visible, else cpu")
    ap.add_argument("--ops", default="auto", choices=["auto", "reference", "triton"],
                    help="kernel backend of model.ops; auto: triton on the GPU, reference on the CPU")
    graphs = ap.add_mutually_exclusive_group()
    graphs.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    graphs.add_argument("--cuda-graphs", dest="eager", action="store_false", default=False,
                        help="CUDA graphs for decode (the default)")
    ap.add_argument("--gpu-memory-utilization", type=cli.fraction, default=0.85,
                    help="fraction of the card for weights, activations and the KV pool (CUDA), in (0, 1]")
    cli.add_state_cache_args(ap)
    ap.add_argument("--snapshot-slots", type=cli.non_negative_int, default=None,
                    help="GDN snapshot slots of the prefix cache, on either device (default: 3C + 16 on the CPU, "
                         "sized from memory on a GPU)")
    ap.add_argument("--kv-working-set", type=cli.positive_float, default=None, metavar="F",
                    help="a KV pool of F times the pages the replay writes (at least the users' longest traces), "
                         "on either device (default: the CPU's room for C + 1 traces, a GPU's memory)")
    ap.add_argument("--page-size", type=cli.positive_int, default=ENGINE_KNOBS["page_size"],
                    help="tokens of a KV page")
    ap.add_argument("--chunk", type=cli.positive_int, default=ENGINE_KNOBS["chunk"],
                    help="max tokens a step computes (chunked prefill)")
    ap.add_argument("--fast-lane", type=cli.non_negative_int, default=ENGINE_KNOBS["fast_lane"],
                    help="returning-session prefills up to this go first")
    ap.add_argument("--interleave", type=cli.non_negative_int, default=ENGINE_KNOBS["interleave"], metavar="SLICES",
                    help="mixed steps launch their prefill in SLICES layer slices with decode steps between "
                         "(EngineConfig.interleave_slices; 0: off)")
    ap.add_argument("--interleave-slice-tokens", type=cli.non_negative_int,
                    default=ENGINE_KNOBS["interleave_slice_tokens"],
                    metavar="TOKENS", help="with --interleave, a mixed step of T prefill tokens takes at least "
                    "ceil(T / TOKENS) slices, one a layer at most (EngineConfig.interleave_slice_tokens; 0: off)")
    ap.add_argument("--prefill-graphs", type=cli.non_negative_int, default=ENGINE_KNOBS["prefill_graphs"],
                    metavar="TOKENS",
                    help="prefill steps up to TOKENS replay CUDA graphs (serving.prefill_graphs) "
                         "(EngineConfig.prefill_graph_tokens; default: every step; 0: off)")
    ap.add_argument("--decode-ahead", type=int, choices=(0, 1), default=ENGINE_KNOBS["decode_ahead"],
                    help="launch each decode step before reading the last one's tokens (EngineConfig.decode_ahead)")
    ap.add_argument("--fed-decode", type=int, choices=(0, 1), default=ENGINE_KNOBS["fed_decode"],
                    help="each decode step's argmax writes the next step's inputs; a fed step copies nothing "
                         "(EngineConfig.fed_decode)")
    ap.add_argument("--token-ring", type=int, choices=(0, 1), default=ENGINE_KNOBS["token_ring"],
                    help="a fed decode's argmax stores its tokens in pinned host memory, so that no copy sits "
                         "between two decode graphs (EngineConfig.token_ring)")
    ap.add_argument("--kv-eviction", choices=("lru", "mru"), default=ENGINE_KNOBS["kv_eviction"],
                    help="which released chain's cached KV pages go first when the pool is full "
                         "(EngineConfig.kv_eviction)")
    cli.add_speculative_args(ap)
    ap.add_argument("--forced-acceptance", type=cli.positive_float, default=None, metavar="L",
                    help="with --speculative-tokens K: each greedy verify step keeps L tokens on average (1..K+1) "
                         "whatever the target says (Speculator.force_lengths): the machinery at that acceptance "
                         "length on random weights; the tokens are not the model's (a benchmark mode)")
    ap.add_argument("--host-hogs", type=cli.non_negative_int, default=BENCH_KNOBS["host_hogs"], metavar="N",
                    help="during the replay, pin this process to one CPU shared with N busy processes: a host-bound "
                         "machine emulated on this one (profiles.shared_cpu)")
    ap.add_argument("--seed", type=cli.non_negative_int, default=0, help="seed of the synthetic traces and of sampling")
    ap.add_argument("--sweep", default=None, metavar="KNOB=V1,V2,...",
                    help=f"replay once per value of an engine knob ({', '.join(ENGINE_KNOBS)}), of host_hogs, or "
                         "per variant of a decode kernel knob (profiles.host_time's AB_KNOBS, e.g. tma_min=16m,8m), "
                         "one model load, and print the variants side by side")
    ap.add_argument("--repeat", type=int, default=1, help="replay every variant this many times, alternating "
                                                          "the variants (run-to-run spread on the GPU: ~7%%)")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers' generate (GPU)")
    ap.add_argument("--hf-prompt", type=cli.positive_int, default=8192, help="prompt tokens of the HF baseline")
    ap.add_argument("--hf-new", type=cli.positive_int, default=64, help="tokens the HF baseline generates")
    ap.add_argument("--write-trace", default=None, help="also write the replayed traces to this JSONL file")
    ap.add_argument("--out-dir", default=None, help="where serving.json goes (default profiles/results)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar while the traces replay")
    ap.add_argument("--per-request", action="store_true",
                    help="also print a row per request and keep them in serving.json")
    args = ap.parse_args(argv)
    cli.check_speculative(ap, args)
    knob, values = parse_sweep(args.sweep)
    if args.sessions and args.num_traces and args.num_traces != args.sessions:
        raise SystemExit(f"--sessions {args.sessions} replays {args.sessions} traces: leave out --num-traces")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    if args.forced_acceptance is not None and not 1 <= args.forced_acceptance <= args.speculative_tokens + 1:
        raise SystemExit(f"--forced-acceptance L needs --speculative-tokens K >= L - 1 and L >= 1, got "
                         f"L {args.forced_acceptance}, K {args.speculative_tokens}")
    out = sys.stdout
    device = pick_device(args.device)
    if args.hf_baseline and device.type != "cuda":
        raise SystemExit("--hf-baseline needs the GPU")
    if args.hf_baseline and (knob or args.repeat > 1):
        raise SystemExit("--hf-baseline times one replay: leave out --sweep and --repeat")
    args.device_name = device.type
    ops.set_backend(args.ops if args.ops != "auto" else ("triton" if device.type == "cuda" else "reference"))
    if model is None:
        args.model = args.model or ("qwen3.5-2b" if device.type == "cuda" else "tiny")
        model, what = load_model(args.model, device), describe_model(args.model)
    else:
        args.model, what = args.model or "custom", "a given model"
    if knob is None and args.repeat == 1:
        return run_once(args, model, what, device, out)
    return run_variants(args, model, what, device, out, knob, values)


def parse_sweep(spec: str | None) -> tuple[str | None, list]:
    """--sweep KNOB=V1,V2,... -> (the knob, its values): an ENGINE_KNOBS name with int values (kv_eviction: its
    names), or a decode kernel knob of profiles.host_time's AB_KNOBS with variant names; (None, []) without it."""
    if spec is None:
        return None, []
    name, _, listed = spec.partition("=")
    name = name.strip().replace("-", "_")
    listed = [v.strip() for v in listed.split(",") if v.strip()]
    if not listed:
        raise SystemExit(f"--sweep {spec!r}: give values, as in {name}=4,12")
    if name not in VALUE_KNOBS:
        from profiles.host_time import AB_KNOBS, knob_variants
        if any(part not in AB_KNOBS for part in name.split("+")):  # A+B: pairs of variants, as in host_time --ab
            raise SystemExit(f"--sweep: unknown knob {name!r}; one of {', '.join(ENGINE_KNOBS)} (engine), host_hogs or "
                             f"{', '.join(sorted(AB_KNOBS))} (kernels, joined by + for pairs)")
        variants = knob_variants(name)
        unknown = [v for v in listed if v not in variants]
        if unknown:
            raise SystemExit(f"--sweep {spec!r}: {name} has no variant {unknown[0]!r}; one of {', '.join(variants)}")
        return name, listed
    if name == "kv_eviction":
        if set(listed) - {"lru", "mru"}:
            raise SystemExit(f"--sweep {spec!r}: kv_eviction is lru or mru")
        return name, listed
    try:
        values = [int(v) for v in listed]
    except ValueError:
        raise SystemExit(f"--sweep {spec!r}: values must be integers") from None
    if name in BENCH_KNOBS and min(values) < 0:
        raise SystemExit(f"--sweep {spec!r}: {name} takes values >= 0")
    return name, values


def run_variants(args, model, what: str, device: torch.device, out, knob: str | None, values: list) -> dict:
    """Replay each value of knob (or the one configuration) args.repeat times, alternating them so that a drift of
    the machine hits every variant alike; print and save the variants' figures side by side. A kernel knob's
    variant is set before its replay's engine captures its graphs, and the knob restored after."""
    kernel_variants = {}
    if knob is not None and knob not in VALUE_KNOBS:
        from profiles.host_time import knob_variants
        kernel_variants = knob_variants(knob)
    rows = _replay_variants(args, model, what, device, out, knob, values, kernel_variants)
    means = [{"variant": v, "repeat": "mean",
              **{k: mean([r[k] for r in rows if r["variant"] == v and r[k] is not None]) for k in SWEEP_COLUMNS}}
             for v in dict.fromkeys(r["variant"] for r in rows)]
    print_table(rows + (means if args.repeat > 1 else []), ["variant", "repeat", *SWEEP_COLUMNS], out)
    summary = dict(model=args.model, trace=args.trace, concurrency=args.concurrency, knob=knob, values=values,
                   repeat=args.repeat, command=command_line(), runs=rows, means=means)
    key = f"sweep|{args.model}|{args.trace}|c{args.concurrency}|{args.device_name}|{knob or 'repeat'}"
    out.write(f"wrote {save(summary, key, args.out_dir)}\n")
    return summary


def _replay_variants(args, model, what: str, device: torch.device, out, knob: str | None, values: list,
                     kernel_variants: dict) -> list[dict]:
    """run_variants' replays: one row a variant and repeat."""
    from profiles.host_time import Variant, running
    rows = []
    for rep in range(args.repeat):
        for value in values or [None]:
            if value not in kernel_variants and knob is not None:
                setattr(args, knob, value)
            out.write(f"=== {knob or 'run'} {'' if value is None else value}, repeat {rep + 1} of {args.repeat}\n")
            with running(kernel_variants.get(value, Variant())):
                overall = run_once(args, model, what, device, out)["overall"]
            rows.append({"variant": "default" if value is None else f"{knob}={value}", "repeat": rep + 1,
                         **{k: overall[k] for k in SWEEP_COLUMNS}})
            gc.unfreeze()  # the engine's warm-up froze its objects (LLMEngine.warm_up): let its cycles go
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


SWEEP_COLUMNS = ("decode_tok_s", "min_user_decode_tok_s", "ttft_return_p50_ms", "throughput_tok_s", "wall_s")


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_once(args, model, what: str, device: torch.device, out) -> dict:
    """One replay of args' traces on a fresh engine: prints its table, adds it to serving.json and returns it."""
    traces = build_traces(args, model.config.vocab_size)
    if args.write_trace:
        write_jsonl(traces, args.write_trace)
    built = time.perf_counter()
    engine = make_engine(model, args, traces)
    built = time.perf_counter() - built
    out.write(f"model: {what} | device: {device} | dtype: {model.lm_head.weight.dtype} | ops: {ops.get_backend()}\n"
              f"host: {host_cpu()}\n"
              f"engine: {engine.pool_summary} (built and captured in {built:.1f} s)\n"
              f"traces: {len(traces)} x {args.trace} ({sum(len(t.turns) for t in traces)} turns, up to "
              f"{max(t.total_tokens() for t in traces)} tokens each) at concurrency {args.concurrency}"
              + (" as interleaved sessions" if args.sessions else "") + "\n")
    warm_up(engine, traces)
    spec = engine.speculator
    if args.forced_acceptance:
        spec.force_lengths(args.forced_acceptance, args.seed)
    spec_before = (spec.num_verify_steps, spec.num_accepted) if spec else None
    runner = engine.runner
    steps_before = (runner.num_graph_steps, runner.num_eager_decode_steps, runner.num_eager_steps,
                    runner.num_graph_prefill_steps, engine.num_ahead_steps, runner.num_fed_steps)
    with TritonCompileLog() as compiles, shared_cpu(args.host_hogs):
        requests, users, wall, steps = replay(engine, traces, args.concurrency, progress=not args.no_progress,
                                              sessions=bool(args.sessions))
    rows, overall = summarize(requests, users, wall)
    if spec is not None:  # tokens a verify step emitted on average: the acceptance length L
        verify_steps = spec.num_verify_steps - spec_before[0]
        overall["acceptance_length"] = 1 + (spec.num_accepted - spec_before[1]) / max(verify_steps, 1)
        overall["forced_acceptance"] = args.forced_acceptance
        out.write(f"speculative decoding: {verify_steps} verify steps, mean acceptance length "
                  f"{overall['acceptance_length']:.2f}" + (" (FORCED: greedy steps keep L tokens, whatever the "
                                                          "target says)" if args.forced_acceptance else "") + "\n")
    if args.sessions:
        overall.update(offline_optimum(requests, engine.cfg.num_pages, engine.cfg.page_size))
    kinds = step_breakdown(steps, wall)
    if args.per_request:
        print_table([request_row(r) for r in requests], ["user", "turn", "prompt", "cached", "new", "ttft_ms",
                                                          "tpot_ms", "generated"], out)
    columns = ["user", "requests", "ttft_p50_ms", "ttft_p99_ms", "ttft_return_p50_ms", "final_answer_s",
               "decode_tok_s", "hit_rate", "eligible_hit_rate", "generated"]
    print_table(rows + [overall], columns, out)
    out.write(f"throughput {overall['throughput_tok_s']:.1f} generated tok/s, {overall['prefill_tok_s']:.0f} "
              f"prefilled tok/s, wall {wall:.2f} s; steps: "
              f"{runner.num_graph_steps - steps_before[0]} graph decode, "
              f"{runner.num_eager_decode_steps - steps_before[1]} eager decode "
              f"({engine.num_ahead_steps - steps_before[4]} of the decodes launched ahead, "
              f"{runner.num_fed_steps - steps_before[5]} fed), "
              f"{runner.num_eager_steps - steps_before[2]} eager (prefill or mixed; "
              f"{runner.num_graph_prefill_steps - steps_before[3]} of them through prefill graphs)\n")
    print_table(kinds, ["kind", "steps", "wall_s", "share", "mean_ms", "dispatch_ms", "host_busy_ms", "prefill_tokens",
                        "decode_steps", "rows_per_decode"], out)
    if args.sessions:
        out.write(f"{args.sessions} sessions interleaved over {len(users)} users: eligible hit rate "
                  f"{fmt(overall['eligible_hit_rate'], '.3f')} (offline optimum "
                  f"{fmt(overall['belady_eligible_hit_rate'], '.3f')} in {engine.cfg.num_pages} KV pages), "
                  f"returning-turn TTFT p50 "
                  f"{fmt(overall['ttft_return_p50_ms'], '.1f')} ms, "
                  f"p99 {fmt(overall['ttft_return_p99_ms'], '.1f')} ms\n")
    if overall["return_sample_ms"] is not None:
        out.write("returning turns' first step, p50 of each phase: schedule {return_schedule_ms:.2f} ms, dispatch "
                  "{return_dispatch_ms:.2f}, commit {return_commit_ms:.2f}, sample and wait {return_sample_ms:.2f}: "
                  .format(**overall) + step_verdict(overall["return_dispatch_ms"], overall["return_sample_ms"]) + "\n")
    if compiles.names:
        out.write(f"WARNING: {len(compiles.names)} Triton compiles during the timed replay "
                  f"({compiles.seconds:.2f} s): {sorted(set(compiles.names))}\n")
    run = dict(model=args.model, weights=what, trace=args.trace, concurrency=args.concurrency, sessions=args.sessions,
               turns=args.turns,
               max_new=args.max_new, scale=args.scale, device=str(device), dtype=str(model.lm_head.weight.dtype),
               ops=ops.get_backend(), engine=engine.pool_summary, cuda_graphs=not args.eager,
               command=command_line(), overall=overall, users=rows,
               steps=dict(graph_decode=runner.num_graph_steps - steps_before[0],
                          eager_decode=runner.num_eager_decode_steps - steps_before[1],
                          eager=runner.num_eager_steps - steps_before[2],
                          graph_prefill=runner.num_graph_prefill_steps - steps_before[3],
                          decode_ahead=engine.num_ahead_steps - steps_before[4],
                          fed=runner.num_fed_steps - steps_before[5]),
               step_kinds=kinds,
               triton_compiles=dict(count=len(compiles.names), seconds=compiles.seconds,
                                    kernels=sorted(set(compiles.names))))
    if args.per_request:  # every request's row: kept only when asked (a 64-session replay's would fill the file)
        run["requests"] = request_table([request_row(r) for r in requests])
    if device.type == "cuda":
        try:
            run["ceilings"] = bandwidth_ceilings(2.0)
        except torch.OutOfMemoryError:  # a pool that fills the card (35B-A3B on 80 GB) leaves no 4 GiB to probe
            run["ceilings"] = "not measured: no free memory beside the pools"
    path = save(run, run_key(args), args.out_dir)  # before the baseline: a run cut short during it keeps ours
    out.write(f"wrote {path}\n")
    if args.hf_baseline:
        del engine, runner
        gc.unfreeze()  # as between a sweep's variants
        gc.collect()
        torch.cuda.empty_cache()
        hf = hf_decode_tok_s(model.config, device, args.hf_prompt, args.hf_new)
        gc.collect()
        torch.cuda.empty_cache()
        hf["ratio"] = overall["decode_tok_s"] / hf["decode_tok_s"] if overall["decode_tok_s"] else None
        run["hf_baseline"] = hf
        out.write(f"HF transformers {hf['transformers']} (fla {hf['fla']}) greedy generate, batch 1, "
                  f"{args.hf_prompt}-token prompt: {hf['decode_tok_s']:.1f} tok/s; ours per user "
                  f"{overall['decode_tok_s']:.1f} tok/s = {hf['ratio']:.1f}x\n")
        out.write(f"wrote {save(run, run_key(args), args.out_dir)}\n")
    return run


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def save(run: dict, key: str, out_dir=None) -> Path:
    """Add the run to serving.json under key, keeping the other runs."""
    path = Path(out_dir or RESULTS) / "serving.json"
    runs = {}
    if path.exists():
        try:
            runs = json.loads(path.read_text()).get("runs", {})
        except (json.JSONDecodeError, AttributeError):
            runs = {}
    runs[key] = run
    return write_result("serving", {"environment": environment(), "runs": runs}, out_dir)


if __name__ == "__main__":
    main()
