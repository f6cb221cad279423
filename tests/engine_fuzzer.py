"""Property-based fuzzer for serving.engine.LLMEngine (CPU, fp32, reference ops, tiny preset with random weights).

Run:  PYTHONPATH=. python tests/engine_fuzzer.py [--examples N] [--seed S]   (FUZZ_MODEL=mixed: full attention at layers
1 and 3, so that a wrong KV page also reaches later GDN layers). tests/test_serving_engine_fuzz.py is its short CI form;
its long runs (thousands of examples) reach what the short form does not (profiles/FINDINGS.md, serving).
A scenario is a plain dict (cfg + list of ops), so a failure prints a repro:  run_scenario(SCENARIO).
"""
import argparse
import json
import os
import tempfile
import time
import traceback
from array import array
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

from model.config import get_preset  # noqa: E402
from model.generate import greedy  # noqa: E402
from model.model import Qwen35ForCausalLM  # noqa: E402
from serving.config import EngineConfig  # noqa: E402
from serving.engine import LLMEngine  # noqa: E402
from serving.sequence import SamplingParams, SequenceStatus, page_hash  # noqa: E402
from tests.hf_oracle import randomize_  # noqa: E402

VOCAB = 1024
MAX_NEW = 20
NEAR_TIE = 1e-4  # a divergence whose reference logit margin is below this is fp noise, not a bug

_MODEL = None
_REF: dict[tuple, list[int]] = {}
STATS = Counter()


def model():
    global _MODEL
    if _MODEL is None:
        over = dict(vocab_size=VOCAB)
        if os.environ.get("FUZZ_MODEL") == "mixed":  # full attention at layers 1 and 3: KV feeds later GDN layers
            over["layer_types"] = ("linear_attention", "full_attention", "linear_attention", "full_attention")
        m = Qwen35ForCausalLM.random(get_preset("tiny", **over), seed=0)
        randomize_(m, 0)  # varied outputs (the preset's init repeats one token forever)
        _MODEL = m.eval()
    return _MODEL


def ref_tokens(prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _REF:
        _REF[key] = greedy(model(), torch.tensor([prompt]), MAX_NEW)[0].tolist()
    return _REF[key]


_REF_LOGITS: dict[tuple, torch.Tensor] = {}


@torch.no_grad()
def ref_all_logits(prompt: list[int]) -> torch.Tensor:
    """(MAX_NEW, vocab): row k is the reference logits that pick output token k (after prompt + ref[:k])."""
    key = tuple(prompt)
    if key not in _REF_LOGITS:
        toks = list(prompt) + ref_tokens(prompt)[:MAX_NEW - 1]
        m = model()
        cache = m.new_cache(1, len(toks))
        _REF_LOGITS[key] = m(torch.tensor([toks]), cache, all_logits=True)[0, len(prompt) - 1:].clone()
    return _REF_LOGITS[key]


LOGIT_TOL = 2e-3


@torch.no_grad()
def ref_logits(tokens: list[int]) -> torch.Tensor:
    m = model()
    cache = m.new_cache(1, len(tokens))
    return m(torch.tensor([tokens]), cache, all_logits=False)[0, -1]


def expected_output(prompt, params: SamplingParams, eos: tuple) -> tuple[list[int], str]:
    ref = ref_tokens(prompt)[:params.max_tokens]
    for i, t in enumerate(ref):
        if t in params.stop_token_ids or (t in eos and not params.ignore_eos):
            return ref[:i + 1], "stop"
    return ref, "length"


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def own_chain(tokens: list[int], num_pages: int, ps: int) -> list[bytes]:
    out, prev = [], b""
    for i in range(num_pages):
        prev = page_hash(prev, array("i", tokens[i * ps:(i + 1) * ps]).tobytes())
        out.append(prev)
    return out


class Failure(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise Failure(msg)


# ---- invariants ------------------------------------------------------------------------------------------

def check_invariants(engine: LLMEngine, where: str):
    bm, sched, sc, cfg = engine.block_manager, engine.scheduler, engine.state_cache, engine.cfg
    ps, N = cfg.page_size, cfg.num_pages
    holders = Counter()
    for seq in sched.running:
        check(seq.status is SequenceStatus.RUNNING, f"{where}: running seq {seq.id} has status {seq.status}")
        check(len(set(seq.pages)) == len(seq.pages), f"{where}: seq {seq.id} holds a page twice: {seq.pages}")
        for p in seq.pages:
            holders[p] += 1
    for seq in sched.waiting:
        check(seq.status is SequenceStatus.WAITING, f"{where}: waiting seq {seq.id} has status {seq.status}")
        check(not seq.pages, f"{where}: waiting seq {seq.id} holds pages {seq.pages}")
        check(seq.state_slot is None and seq.rolling_snapshot_slot is None and seq.pending_snapshot_slot is None,
              f"{where}: waiting seq {seq.id} holds slots")
        check(seq.num_computed_tokens == 0, f"{where}: waiting seq {seq.id} has computed tokens")
    ids = [s.id for s in sched.running] + [s.id for s in sched.waiting]
    check(len(ids) == len(set(ids)), f"{where}: a sequence is queued twice: {ids}")
    for p in range(N):
        check(bm.refcount[p] == holders[p], f"{where}: page {p} refcount {bm.refcount[p]} != holders {holders[p]}")
    free, ev = list(bm.free_pages), list(bm.evictable)
    check(len(set(free)) == len(free), f"{where}: free list has duplicates")
    check(not set(free) & set(ev), f"{where}: a page is both free and evictable")
    for p in free:
        check(bm.refcount[p] == 0 and bm.hash_of_page[p] is None, f"{where}: free page {p} is held or hashed")
    for p in ev:
        check(bm.refcount[p] == 0 and bm.hash_of_page[p] is not None, f"{where}: evictable page {p} bad state")
    for p in range(N):
        if bm.refcount[p] == 0:
            check(p in bm.evictable or p in set(free), f"{where}: unreferenced page {p} is neither free nor cached")
    check(len(free) + len(ev) + sum(1 for r in bm.refcount if r > 0) == N, f"{where}: pages lost")
    for h, p in bm.page_of_hash.items():
        check(bm.hash_of_page[p] == h, f"{where}: page_of_hash/hash_of_page disagree at page {p}")
    check(sum(h is not None for h in bm.hash_of_page) == len(bm.page_of_hash), f"{where}: stray hash_of_page")
    # page contents as far as the hashes tell: every hashed page a running seq holds is that seq's page
    for seq in sched.running:
        tokens = seq.token_ids
        computed = seq.num_computed_tokens
        check(0 <= computed <= seq.num_tokens, f"{where}: seq {seq.id} computed {computed} of {seq.num_tokens}")
        check(len(seq.pages) * ps >= computed, f"{where}: seq {seq.id} computed past its pages")
        full = computed // ps
        chain = own_chain(tokens, max(full, len(seq.known_page_hashes())), ps)
        known = seq.known_page_hashes()
        check(known == chain[:len(known)], f"{where}: seq {seq.id} memoised page hashes are wrong")
        check(seq.num_published_pages <= full, f"{where}: seq {seq.id} published {seq.num_published_pages} > {full}")
        for i, p in enumerate(seq.pages):
            h = bm.hash_of_page[p]
            if h is not None:
                check(i < full and h == chain[i],
                      f"{where}: seq {seq.id} page #{i} (page {p}) carries a hash that is not its prefix's "
                      f"(full={full})")
            if bm.refcount[p] > 1:
                check(h is not None and i < full, f"{where}: page {p} shared but not a cached full page")
    # state slots
    rs = [s.state_slot for s in sched.running]
    check(None not in rs and len(set(rs)) == len(rs), f"{where}: running state slots {rs}")
    fs = sched.free_state_slots
    check(len(set(fs)) == len(fs) and not set(fs) & set(rs) and set(fs) | set(rs) == set(range(cfg.max_num_seqs)),
          f"{where}: state slots free {fs} running {rs}")
    private = [s.rolling_snapshot_slot for s in sched.running if s.rolling_snapshot_slot is not None]
    pending = [s.pending_snapshot_slot for s in sched.running if s.pending_snapshot_slot is not None]
    check(not pending, f"{where}: pending snapshot slots between steps: {pending}")
    # a snapshot leaves with the page it is keyed by; the eviction tiers are disjoint and hold unreferenced pages
    lost = [k.hex()[:8] for k in sc.published if k not in bm.page_of_hash]
    check(not lost, f"{where}: snapshots whose page left the cache: {lost}")
    check(not set(bm._tail) & set(bm._lru), f"{where}: a page in both eviction tiers")
    children = [0] * bm.num_pages
    for p in range(bm.num_pages):
        if bm.parent_of(p) >= 0:
            check(bm.hash_of_page[p] is not None and bm.hash_of_page[bm.parent_of(p)] is not None,
                  f"{where}: page {p}'s chain link {bm.parent_of(p)} is not between cached pages")
            children[bm.parent_of(p)] += 1
    check(children == bm.children, f"{where}: children counts {bm.children} != {children}")
    allsnap = list(sc.free_slots) + list(sc.slot_of_key.values()) + private
    check(len(allsnap) == len(set(allsnap)) == cfg.snapshot_slots
          and set(allsnap) == set(range(cfg.max_num_seqs, cfg.max_num_seqs + cfg.snapshot_slots)),
          f"{where}: snapshot slots free {sc.free_slots} published {list(sc.slot_of_key.values())} private {private}")


def check_output_so_far(engine, rid, seq, req, where):
    exp, _ = req["expected"]
    out = seq.output_ids
    check(len(out) <= req["params"].max_tokens, f"{where}: req {rid} has {len(out)} > max_tokens tokens")
    if out != exp[:len(out)]:
        i = next(k for k, (a, b) in enumerate(zip(out, exp)) if a != b) if any(
            a != b for a, b in zip(out, exp)) else min(len(out), len(exp))
        if i < len(out) and i < len(exp):
            lg = ref_logits(req["prompt"] + exp[:i])
            margin = float(lg.max() - lg[out[i]])
            if margin < NEAR_TIE:
                STATS["near_tie"] += 1
                req["near_tie"] = True
                return
            raise Failure(f"{where}: req {rid} output diverges from greedy at token {i}: got {out[i]} want {exp[i]}"
                          f" (reference margin {margin:.3g}); out={out} exp={exp}; prompt len {len(req['prompt'])}")
        raise Failure(f"{where}: req {rid} output {out} is not a prefix of expected {exp}")


def check_logits(rid, r, seq_rows, where):
    """The logits each output token was sampled from equal the reference's (same tokens before it)."""
    out, exp = r["final"], r["expected"][0]
    check(len(seq_rows) >= len(out), f"{where}: req {rid} has {len(out)} tokens but {len(seq_rows)} sampled rows")
    ref = ref_all_logits(r["prompt"])
    for k in range(len(out)):
        if out[:k] != exp[:k] or k >= ref.shape[0]:
            break
        d = float((seq_rows[k] - ref[k]).abs().max())
        STATS["rows_checked"] += 1
        STATS["max_row_err_e6"] = max(STATS["max_row_err_e6"], int(d * 1e6))
        check(d <= LOGIT_TOL, f"{where}: req {rid} output token {k}: the engine's logits differ from the "
                              f"reference by {d:.3g} (prompt len {len(r['prompt'])})")


# ---- KV / snapshot content at the end ----------------------------------------------------------------------

@torch.no_grad()
def check_cache_contents(engine: LLMEngine, sources: list[list[int]]):
    """Every cached page (by hash) holds the reference KV of its prefix; every published snapshot the reference
    GDN state after its prefix."""
    bm, sc, cfg = engine.block_manager, engine.state_cache, engine.cfg
    ps = cfg.page_size
    where_of: dict[bytes, tuple[int, int]] = {}  # hash -> (source index, pages)
    for si, toks in enumerate(sources):
        for j, h in enumerate(own_chain(toks, len(toks) // ps, ps)):
            where_of.setdefault(h, (si, j + 1))
    need: dict[int, set] = {}
    for h in list(bm.page_of_hash) + list(sc.slot_of_key):
        check(h in where_of, "end: a cached key matches no submitted token prefix")
        si, n = where_of[h]
        need.setdefault(si, set()).add(n)
    m = model()
    pools = engine.pools
    for si, ns in need.items():
        toks = sources[si]
        top = max(ns)
        cache = m.new_cache(1, top * ps, page_size=ps)
        states = {}
        done = 0
        for n in sorted(ns):
            m(torch.tensor([toks[done:n * ps]]), cache, all_logits=False)
            done = n * ps
            states[n] = (cache.pools.conv_states[:, 0].clone(), cache.pools.recurrent_states[:, 0].clone())
        chain = own_chain(toks, top, ps)
        for n in ns:
            h = chain[n - 1]
            if h in bm.page_of_hash:
                p = bm.page_of_hash[h]
                for name, eng, ref in (("K", pools.k_pages, cache.pools.k_pages),
                                       ("V", pools.v_pages, cache.pools.v_pages)):
                    a, b = eng[:, p], ref[:, n - 1]
                    check(torch.allclose(a, b, atol=1e-4, rtol=1e-3),
                          f"end: cached page {p} ({n} pages of source {si}) {name} differs by "
                          f"{float((a - b).abs().max()):.3g}")
                STATS["pages_checked"] += 1
            if h in sc.slot_of_key:
                slot = sc.slot_of_key[h]
                conv, rec = states[n]
                for name, a, b in (("conv", pools.conv_states[:, slot], conv),
                                   ("recurrent", pools.recurrent_states[:, slot], rec)):
                    check(torch.allclose(a, b, atol=1e-4, rtol=1e-3),
                          f"end: snapshot slot {slot} ({n * ps} tokens of source {si}) {name} differs by "
                          f"{float((a - b).abs().max()):.3g}")
                STATS["snapshots_checked"] += 1


# ---- a scenario --------------------------------------------------------------------------------------------

def build_prompt(op, reqs, cap):
    kind, src, length, suffix, seed = op["kind"], op["src"], op["len"], op["suffix"], op["seed"]
    if not reqs:
        kind = "fresh"
    base = reqs[src % len(reqs)] if reqs else None
    if kind == "fresh":
        p = rand_tokens(length, seed)
    elif kind == "share":  # a long common prefix, then its own tokens
        cut = max(1, min(len(base["prompt"]), length))
        p = base["prompt"][:cut] + rand_tokens(suffix, seed)
    elif kind == "repeat":
        p = list(base["prompt"])
    elif kind == "extend":  # a returning session: the old prompt, its reply (as far as it got), new tokens
        p = base["prompt"] + list(base["final"] if base["final"] is not None else base["seq"].output_ids) \
            + rand_tokens(suffix, seed)
    elif kind == "truncate":
        p = base["prompt"][:max(1, min(length, len(base["prompt"])))]
    else:
        raise ValueError(kind)
    return p[:cap] or [1]


def run_scenario(sc: dict, check_contents: bool = True) -> dict:
    c = sc["cfg"]
    ps = c["page_size"]
    cfg = EngineConfig(num_pages=c["num_pages"], page_size=ps, max_num_seqs=c["max_num_seqs"],
                       snapshot_slots=c["snapshot_slots"], max_num_batched_tokens=c["budget"],
                       fast_lane_tokens=c["fast_lane"], eos_token_ids=tuple(c["eos"]),
                       interleave_slices=c["slices"], decode_ahead=c["ahead"], fed_decode=c.get("fed", False),
                       kv_eviction=c.get("eviction", "lru"), snapshot_interval=c.get("interval", 0))
    engine = LLMEngine(model(), cfg, pad_decode=c["padded"])
    rows: dict[int, list[torch.Tensor]] = {}  # seq id -> the logits rows it sampled from, in order
    orig_sample = engine._sample

    def recording_sample(chunks, ready, logits, greedy):
        for i, (ch, r) in enumerate(zip(chunks, ready)):
            if r:
                rows.setdefault(ch.seq.id, []).append(logits[i].detach().clone())
        return orig_sample(chunks, ready, logits, greedy)
    engine._sample = recording_sample
    reqs: dict[int, dict] = {}
    order: list[dict] = []
    sources: list[list[int]] = []

    def do_step(where):
        n_before = sum(len(r["seq"].output_ids) for r in reqs.values() if r["final"] is None)
        outs = engine.step()
        for o in outs:
            check(o.seq_id in reqs, f"{where}: output for unknown request {o.seq_id}")
            r = reqs[o.seq_id]
            check(r["final"] is None, f"{where}: output {o} for request {o.seq_id} after it ended")
            r["stream"].append(o.token)
            check(not o.finished or r["seq"].is_finished, f"{where}: StepOutput finished flag wrong for {o.seq_id}")
        for o in outs:
            r = reqs[o.seq_id]
            if o.finished and r["final"] is None:
                out = engine.pop_output(o.seq_id)
                finish(o.seq_id, out, where)
        check_invariants(engine, where)
        for rid, r in reqs.items():
            if r["final"] is None and not r.get("near_tie"):
                check_output_so_far(engine, rid, r["seq"], r, where)
        return outs, n_before

    def finish(rid, out, where):
        r = reqs[rid]
        r["final"] = list(out.output_ids)
        r["reason"] = out.finish_reason
        sources.append(r["prompt"] + r["final"])
        check(out.prompt_ids == r["prompt"], f"{where}: req {rid} prompt changed")
        check(out.cached_tokens <= max(0, len(r["prompt"]) - 1),
              f"{where}: req {rid} cached_tokens {out.cached_tokens} >= prompt {len(r['prompt'])}")
        check(out.cached_tokens % ps == 0, f"{where}: req {rid} cached_tokens {out.cached_tokens} not page-aligned")
        STATS["cached_tokens"] += out.cached_tokens
        check_logits(rid, r, rows.get(rid, []), where)
        if out.finish_reason != "abort":
            check(r["stream"] == r["final"], f"{where}: req {rid} streamed {r['stream']} != output {r['final']}")
            if not r.get("near_tie"):
                exp, reason = r["expected"]
                check(r["final"] == exp and out.finish_reason == reason,
                      f"{where}: req {rid} finished {r['final']} ({out.finish_reason}), expected {exp} ({reason})")
            STATS["finished"] += 1
        else:
            check(r["stream"] == r["final"], f"{where}: aborted req {rid} streamed {r['stream']} != {r['final']}")
            STATS["aborted"] += 1

    def abort(rid, where):
        seq = engine.sequences[rid]
        STATS[f"abort_{seq.status.value}"] += 1
        # as serving.async_engine._finish_sequence does
        if seq.status is SequenceStatus.RUNNING:
            engine.scheduler.finish(seq, "abort")
        elif seq.status is SequenceStatus.WAITING:
            engine.scheduler.waiting.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        finish(rid, engine.pop_output(rid), where)
        check_invariants(engine, where)

    def abort_all(where):
        for rid in sorted(rid for rid, r in reqs.items() if r["final"] is None):
            abort(rid, where)

    cap = c["num_pages"] * ps
    for k, op in enumerate(sc["ops"]):
        where = f"op {k} {op['op']}"
        if op["op"] == "add":
            mt = min(op["max_tokens"], cap - 1)
            prompt = build_prompt(op, order, cap - mt)
            ref = ref_tokens(prompt)
            stop = (ref[op["stop_at"] % mt],) if op.get("stop_at") is not None else ()
            params = SamplingParams(max_tokens=mt, ignore_eos=op["ignore_eos"], stop_token_ids=stop)
            rid = engine.add_request(prompt, params, min(op.get("cache_point", 0), len(prompt)))
            r = dict(prompt=prompt, params=params, seq=engine.sequences[rid], final=None, stream=[],
                     expected=expected_output(prompt, params, tuple(c["eos"])))
            reqs[rid] = r
            order.append(r)
            STATS["requests"] += 1
            STATS[f"kind_{op['kind'] if len(order) > 1 else 'fresh'}"] += 1
        elif op["op"] == "step":
            for _ in range(op["n"]):
                if not engine.has_unfinished:
                    break
                do_step(where)
        elif op["op"] == "abort":
            live = sorted(rid for rid, r in reqs.items() if r["final"] is None)
            if not live:
                continue
            abort(live[op["which"] % len(live)], where)
        elif op["op"] == "drain":
            drain(engine, do_step, where, abort_all)
    drain(engine, do_step, "final drain", abort_all)
    # nothing lost
    for rid, r in reqs.items():
        check(r["final"] is not None, f"end: request {rid} never ended")
    check(not engine.sequences, f"end: engine still holds sequences {list(engine.sequences)}")
    # all free
    bm = engine.block_manager
    check(all(x == 0 for x in bm.refcount), "end: pages still referenced")
    check(len(bm.free_pages) + len(bm.evictable) == cfg.num_pages, "end: free + evictable != total")
    check(len(engine.scheduler.free_state_slots) == cfg.max_num_seqs, "end: state slots not all free")
    check(len(engine.state_cache.free_slots) + len(engine.state_cache) == cfg.snapshot_slots,
          "end: private snapshot left")
    STATS["preemptions"] += engine.scheduler.num_preemptions
    STATS["ahead_steps"] += engine.num_ahead_steps
    STATS["fed_steps"] += engine.runner.num_fed_steps
    STATS["examples"] += 1
    if check_contents:
        check_cache_contents(engine, sources)
    return dict(preemptions=engine.scheduler.num_preemptions, ahead=engine.num_ahead_steps)


LIVELOCK_OK = False


def drain(engine, do_step, where, abort_all=None):
    empty = 0
    for i in range(20000):
        if not engine.has_unfinished:
            return
        outs, _ = do_step(f"{where} step {i}")
        empty = empty + 1 if not outs else 0
        if empty >= 400 and LIVELOCK_OK and abort_all is not None:
            STATS["livelocks_aborted"] += 1
            abort_all(f"{where} livelock abort")
            return
        check(empty < 400, f"{where}: 400 steps in a row without any output (livelock?)")
    raise Failure(f"{where}: did not finish in 20000 steps")


# ---- hypothesis ----------------------------------------------------------------------------------------

def strategies():
    from hypothesis import strategies as st

    cfg = st.fixed_dictionaries(dict(
        page_size=st.sampled_from([1, 2, 3, 4, 5, 8, 16]),
        max_num_seqs=st.integers(1, 4),
        snapshot_slots=st.integers(0, 8),
        budget=st.one_of(st.integers(1, 12), st.sampled_from([16, 24, 32, 64, 512])),
        fast_lane=st.one_of(st.just(512), st.just(0), st.integers(0, 16)),
        eos=st.lists(st.integers(0, 9), max_size=2),  # indices into EOS_POOL
        slices=st.sampled_from([0, 0, 1, 2, 3, 4]),
        ahead=st.booleans(),
        fed=st.booleans(),
        padded=st.booleans(),
        eviction=st.sampled_from(["lru", "mru"]),
        interval=st.sampled_from([0, 0, 4, 8, 24]),  # snapshot ladder rungs every this many tokens
        cap_tokens=st.one_of(st.integers(12, 48), st.integers(12, 320)),
        extra_pages=st.integers(0, 6),
    ))
    add = st.fixed_dictionaries(dict(
        op=st.just("add"),
        kind=st.sampled_from(["fresh", "share", "share", "share", "repeat", "extend", "extend", "extend", "truncate"]),
        src=st.integers(0, 20),
        len=st.one_of(st.integers(1, 40), st.integers(1, 300)),
        suffix=st.integers(0, 24),
        seed=st.integers(0, 10**6),
        max_tokens=st.integers(1, MAX_NEW),
        ignore_eos=st.booleans(),
        stop_at=st.one_of(st.none(), st.none(), st.integers(0, MAX_NEW - 1)),
        cache_point=st.one_of(st.just(0), st.integers(1, 64)),  # a shared prefix's end: a snapshot point
    ))
    step = st.fixed_dictionaries(dict(op=st.just("step"), n=st.integers(1, 6)))
    abort = st.fixed_dictionaries(dict(op=st.just("abort"), which=st.integers(0, 10)))
    drain_ = st.just(dict(op="drain"))
    ops = st.lists(st.one_of(add, add, add, add, add, step, step, step, step, abort, drain_),
                   min_size=15, max_size=70)
    return st.fixed_dictionaries(dict(cfg=cfg, ops=ops))


EOS_POOL: list[int] = []


def eos_pool() -> list[int]:
    """The tokens the model emits most often under greedy decoding: eos ids that actually get hit."""
    if not EOS_POOL:
        cnt = Counter()
        for s in range(12):
            cnt.update(ref_tokens(rand_tokens(5 + 17 * s, 7000 + s)))
        EOS_POOL.extend(t for t, _ in cnt.most_common(10))
    return EOS_POOL


def concretize(sc: dict) -> dict:
    """Resolve the drawn config into the one run_scenario takes (num_pages from the token cap)."""
    c = dict(sc["cfg"])
    ps = c["page_size"]
    c["num_pages"] = -(-c.pop("cap_tokens") // ps) + c.pop("extra_pages")
    pool = eos_pool()
    c["eos"] = sorted({pool[i] for i in c["eos"]})
    return dict(cfg=c, ops=sc["ops"])


def fuzz_db() -> str:
    return os.environ.get("FUZZ_DB", os.path.join(tempfile.gettempdir(), "engine_fuzzer_db"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-contents", action="store_true")
    ap.add_argument("--log", default=None)
    ap.add_argument("--livelock-ok", action="store_true",
                    help="on 400 steps without output, abort every live request (counted) instead of failing")
    args = ap.parse_args()
    if args.livelock_ok:
        global LIVELOCK_OK
        LIVELOCK_OK = True
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    failures = []
    t0 = time.time()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, print_blob=True,
              database=DirectoryBasedExampleDatabase(fuzz_db()),
              suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    @given(strategies())
    def prop(raw):
        sc = concretize(raw)
        try:
            run_scenario(sc, check_contents=not args.no_contents)
        except Exception as e:
            failures.append((type(e).__name__, str(e)[:400], sc))
            raise

    try:
        prop()
        status = "PASS"
    except Exception:
        status = "FAIL"
        traceback.print_exc()
    dt = time.time() - t0
    print(f"{status} in {dt:.0f}s; stats {dict(STATS)}")
    if failures:
        name, msg, sc = failures[-1]
        print("MINIMAL FAILING SCENARIO:", json.dumps(sc))
        print("ERROR:", name, msg)
    if args.log:
        with open(args.log, "w") as f:
            json.dump(dict(status=status, seconds=dt, stats=dict(STATS),
                           last_failure=failures[-1] if failures else None), f)


if __name__ == "__main__":
    main()
