"""profiles.bench_serving and profiles.traces on the CPU: a scaled-down closed-loop replay runs, its metrics add up, and
the prefix cache serves the returning turns."""
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.model import Qwen35ForCausalLM
from profiles import bench_serving, traces
from serving.config import EngineConfig
from serving.engine import LLMEngine
from tests.hf_oracle import small_config


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM.random(small_config(vocab_size=512, mtp_num_hidden_layers=1), seed=0)


def test_synthetic_traces_have_the_documented_shape():
    short = traces.synthetic("short", 3, vocab=248320)
    assert len(short) == 3 and all(len(t.turns) == 11 for t in short)
    first = [t.turns[0].new_ids for t in short]
    assert all(len(f) == 8192 for f in first) and short[0].shared_prefix == 4096
    assert first[0][:4096] == first[1][:4096] != first[0][4096:4096 + 4096]  # one shared system prefix
    assert all(300 <= len(x.new_ids) <= 800 and 1 <= x.max_new <= 300 for t in short for x in t.turns[1:])
    long = traces.synthetic("long", 1, vocab=248320, turns=3, max_new=50)
    assert [len(x.new_ids) for x in long[0].turns] == [50000, 800, 800]
    assert all(x.max_new <= 50 for x in long[0].turns)


def test_jsonl_round_trip_and_counts(tmp_path):
    path = tmp_path / "t.jsonl"
    ts = traces.synthetic("short", 2, vocab=512, scale=0.01, turns=3)
    traces.write_jsonl(ts, path)
    back = traces.load_jsonl(path, vocab=512)
    assert [[x.new_ids for x in t.turns] for t in back] == [[x.new_ids for x in t.turns] for t in ts]
    assert [t.shared_prefix for t in back] == [t.shared_prefix for t in ts]
    path.write_text(json.dumps({"id": "a", "system_tokens": 32, "turns": [{"new_tokens": 10, "max_new": 3},
                                                                          {"new_tokens": 5, "max_new": 2}]}) + "\n")
    (t,) = traces.load_jsonl(path, vocab=512)
    assert [len(x.new_ids) for x in t.turns] == [42, 5] and t.shared_prefix == 32
    path.write_text('{"turns": [{"max_new": 3}]}\n')
    with pytest.raises(ValueError, match="not a trace"):
        traces.load_jsonl(path, vocab=512)


def test_bench_smoke_on_the_cpu(model, tmp_path, capsys):
    run = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "3", "--max-new",
                              "3", "--concurrency", "2", "--page-size", "8", "--out-dir", str(tmp_path),
                              "--no-progress", "--per-request"], model=model)
    printed = capsys.readouterr().out
    assert "eligible_hit_rate" in printed and "ttft_p50_ms" in printed
    overall = run["overall"]
    replayed = traces.synthetic("short", 2, vocab=512, scale=0.01, turns=3, max_new=3)
    assert overall["requests"] == 6 and overall["generated"] == sum(x.max_new for t in replayed for x in t.turns)
    assert overall["decode_tok_s"] > 0 and overall["ttft_p99_ms"] >= overall["ttft_p50_ms"] > 0
    # returning turns resend the conversation unchanged: the cache serves all but the page-unaligned tail
    assert overall["eligible_hit_rate"] > 0.7 and 0 < overall["hit_rate"] <= overall["eligible_hit_rate"]
    assert all(u["final_answer_s"] > 0 for u in run["users"])
    # each request keeps the phases of the step that gave its first token; together they fit inside its TTFT
    assert "sample and wait" in printed
    table = run["requests"]
    assert len(table["rows"]) == 6
    for r in (dict(zip(table["columns"], row)) for row in table["rows"]):
        phases = [r[f"first_{k}"] for k in bench_serving.PHASES]
        assert 0 < sum(phases) <= r["ttft_ms"] + 1e-3
    assert overall["return_dispatch_ms"] > 0
    # where the replay's wall time went, by kind of step: every step counted once, the shares summing to the wall
    kinds = {k["kind"]: k for k in run["step_kinds"]}
    assert {"mixed", "between steps"} <= set(kinds) and abs(sum(k["share"] for k in kinds.values()) - 1) < 1e-6
    assert kinds["mixed"]["prefill_tokens"] > 0 and kinds["mixed"]["decode_steps"] > 0
    # the host's own time of a step: its wall less its waits for sampled tokens (on the CPU those are ~0)
    assert all(0 < k["host_busy_ms"] <= k["mean_ms"] + 1e-9 for k in kinds.values() if k["steps"])
    assert "rows_per_decode" in printed
    assert ("dispatch-bound" in printed) == (overall["return_dispatch_ms"] > overall["return_sample_ms"])
    saved = json.loads((tmp_path / "serving.json").read_text())
    # a knob away from its default keys its own row (page size 8 here)
    assert "custom|short|c2|cpu|graphs|page_size8" in saved["runs"] and "command" in saved and "environment" in saved


def test_bench_with_speculation_on_the_cpu(model, tmp_path, capsys):
    """--speculative-tokens: the replay decodes through MTP verify steps and keys its own row."""
    run = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "2", "--max-new",
                              "6", "--concurrency", "2", "--out-dir", str(tmp_path), "--no-progress",
                              "--speculative-tokens", "2"], model=model)
    assert run["overall"]["generated"] > 0 and "MTP speculative decoding, 2 drafts" in capsys.readouterr().out
    runs = json.loads((tmp_path / "serving.json").read_text())["runs"]
    assert "custom|short|c2|cpu|graphs|speculative_tokens2" in runs


@pytest.mark.parametrize("forced", [3.0, 1.5])
def test_bench_forced_acceptance_on_the_cpu(model, tmp_path, forced):
    """--forced-acceptance L: greedy verify steps keep L tokens on average whatever the target says (the first
    verify after each prefill drafts on the host, where it is not forced)."""
    run = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.08", "--turns", "2", "--max-new",
                              "40", "--concurrency", "1", "--out-dir", str(tmp_path), "--no-progress",
                              "--speculative-tokens", "2", "--forced-acceptance", str(forced)], model=model)
    length = run["overall"]["acceptance_length"]  # a verify step near a request's end keeps fewer
    assert forced - 0.5 < length <= forced + 0.25, length
    assert run["overall"]["forced_acceptance"] == forced and run["overall"]["generated"] > 0


def test_step_verdict_names_the_longer_phase():
    assert bench_serving.step_verdict(30.0, 0.2).startswith("dispatch-bound")
    assert bench_serving.step_verdict(3.0, 12.0).startswith("GPU-bound")


def test_host_time_profiles_a_returning_step_on_the_cpu(capsys):
    from profiles import host_time
    result = host_time.main(["--ctx", "40", "--new", "9", "--device", "cpu", "--top", "3"])
    assert result["wall_ms"] > 0 and len(result["ops"]) == 3 and result["ops"][0]["calls"] >= 1
    assert "one step of 9 new tokens over 40 cached" in capsys.readouterr().out
    assert result["python_wall_ms"] > 0 and len(result["python"]) == 3


def test_knob_variants_are_configs_and_combine():
    # host_time's --ab knobs are data: a KernelTuning and EngineConfig fields a variant; 'A+B' is every pair of
    # variants, named 'a/b', with A's tuning overridden by B's changed fields and both engine fields
    from kernels.tuning import KernelTuning
    from profiles.host_time import AB_KNOBS, UNBOUNDED_K, Variant, knob_variants
    assert set(AB_KNOBS) == {"prenorm", "tma_min", "tma_pause", "verify_rows", "fed_decode", "token_ring"}
    assert knob_variants("verify_rows")["gemv"].tuning == KernelTuning(gemv_max_rows=4)
    assert knob_variants("prenorm")["rule"] == Variant() and knob_variants("tma_min")["8m"] == Variant()
    pairs = knob_variants("prenorm+tma_min")
    assert list(pairs) == [f"{a}/{b}" for a in ("fused", "rule", "unfused") for b in ("16m", "8m", "4m")]
    assert pairs["unfused/4m"].tuning == KernelTuning(fused_norm_max_k=0, tma_min_bytes=4 * 2**20)
    assert pairs["fused/8m"].tuning == KernelTuning(fused_norm_max_k=UNBOUNDED_K)
    assert pairs["rule/8m"] == Variant()
    engines = knob_variants("fed_decode+token_ring")
    assert engines["on/off"].engine == (("fed_decode", True), ("token_ring", False))
    assert all(v.tuning == KernelTuning() for v in engines.values())


def test_host_time_ab_refuses_an_unknown_knob(capsys):
    from profiles import host_time
    with pytest.raises(SystemExit):
        host_time.main(["--decode", "1", "--device", "cpu", "--ab", "prenorm+no_such_knob"])
    assert "unknown knob 'no_such_knob'" in capsys.readouterr().err


def engines_under(monkeypatch) -> list:
    """(the kernel tuning, the EngineConfig fields) each engine host_time builds sees, in order."""
    from kernels import registry
    from profiles import host_time
    seen, real = [], host_time.make_engine

    def make_engine(*args, **kwargs):
        seen.append((registry.tuning(), dict(host_time.ENGINE_FIELDS)))
        return real(*args, **kwargs)
    monkeypatch.setattr(host_time, "make_engine", make_engine)
    return seen


@pytest.mark.parametrize("knob", ["prenorm", "tma_min", "fed_decode", "token_ring"])
def test_host_time_ab_alternates_the_variants(capsys, monkeypatch, knob):
    from kernels import registry
    from kernels.tuning import KernelTuning
    from profiles import host_time
    seen = engines_under(monkeypatch)
    variants = host_time.knob_variants(knob)
    rows = host_time.main(["--decode", "1", "--ctx", "24", "--device", "cpu", "--ab", knob])["ab"][knob]
    assert [(r[knob], r["repeat"]) for r in rows] == [(n, rep) for rep in (0, 1) for n in variants]
    assert all(r["graph_ms"] > 0 for r in rows) and "graph_ms" in capsys.readouterr().out
    # each engine built under its variant's tuning and engine fields
    assert seen == [(v.tuning, dict(v.engine)) for _ in (0, 1) for v in variants.values()]
    assert len({tuning for tuning, _ in seen}) > 1 or len({str(fields) for _, fields in seen}) > 1
    # the defaults again afterwards
    assert registry.tuning() == KernelTuning() and host_time.ENGINE_FIELDS == {}


def test_host_time_ab_takes_several_knobs_in_turn(monkeypatch):
    # two-variant knobs, to keep it short (4 decode engines a knob): each knob's table, then its default again
    from kernels import registry
    from kernels.tuning import KernelTuning
    from profiles import host_time
    seen = engines_under(monkeypatch)
    knobs = ["fed_decode", "token_ring"]
    argv = ["--decode", "1", "--ctx", "24", "--device", "cpu", *(a for k in knobs for a in ("--ab", k))]
    found = host_time.main(argv)["ab"]
    assert list(found) == knobs
    for knob in knobs:
        names = list(host_time.AB_KNOBS[knob])
        assert [(r[knob], r["repeat"]) for r in found[knob]] == [(n, rep) for rep in (0, 1) for n in names]
    assert [fields for _, fields in seen] == [{knob: on} for knob in knobs for _ in (0, 1) for on in (False, True)]
    assert registry.tuning() == KernelTuning() and host_time.ENGINE_FIELDS == {}


def test_host_time_admission_keys():
    from profiles import host_time
    rows = host_time.main(["--admission", "--ctx", "320", "--new", "17"])["admission"]
    assert [r["keys"] for r in rows] == ["hash every page", "memo of the finished request"]
    assert [r["pages"] for r in rows] == [21, 21] and all(r["host_ms"] > 0 for r in rows)


def test_host_time_launch_costs_need_the_gpu():
    from profiles import host_time
    with pytest.raises(SystemExit, match="needs the GPU"):
        host_time.main(["--launch-costs", "--device", "cpu"])


@pytest.mark.gpu
def test_host_time_launch_costs_on_the_gpu():
    from profiles import host_time
    rows = host_time.main(["--launch-costs"])["launch_costs"]
    assert len(rows) == 4 and all(0 < r["host_us"] <= r["total_us"] for r in rows)


def test_host_time_profiles_a_decode_step_on_the_cpu(capsys):
    from profiles import host_time
    result = host_time.main(["--ctx", "30", "--decode", "2", "--device", "cpu", "--top", "3"])
    assert result["eager_ms"] > 0 and result["graph_ms"] > 0  # no graphs on the CPU: both eager
    assert "a decode step of 2 over 30" in capsys.readouterr().out


def test_hf_baseline_needs_the_gpu():
    with pytest.raises(SystemExit, match="needs the GPU"):
        bench_serving.main(["--device", "cpu", "--hf-baseline"])


def engines_built(monkeypatch, what) -> list:
    """What each engine the bench builds sees: what(args) at each bench_serving.make_engine call, in order."""
    seen = []
    real_make_engine = bench_serving.make_engine

    def make_engine(m, args, ts):
        seen.append(what(args))
        return real_make_engine(m, args, ts)
    monkeypatch.setattr(bench_serving, "make_engine", make_engine)
    return seen


def test_bench_sweep_alternates_the_variants_and_saves_them_side_by_side(model, tmp_path, capsys, monkeypatch):
    """--sweep KNOB=V1,V2 --repeat 2: one model, the variants alternated (v1, v2, v1, v2), each on a fresh engine
    with that knob; a table of every run plus each variant's mean, and one summary entry in serving.json beside the
    per-variant runs."""
    seen = engines_built(monkeypatch, lambda args: args.interleave)
    summary = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "2",
                                  "--max-new", "2", "--concurrency", "2", "--page-size", "8", "--out-dir",
                                  str(tmp_path), "--no-progress", "--sweep", "interleave=0,3", "--repeat", "2"],
                                 model=model)
    assert seen == [0, 3, 0, 3]
    assert [(r["variant"], r["repeat"]) for r in summary["runs"]] == [
        ("interleave=0", 1), ("interleave=3", 1), ("interleave=0", 2), ("interleave=3", 2)]
    assert all(r["decode_tok_s"] > 0 and r["wall_s"] > 0 for r in summary["runs"])
    means = {m["variant"]: m for m in summary["means"]}
    runs_0 = [r["decode_tok_s"] for r in summary["runs"] if r["variant"] == "interleave=0"]
    assert means["interleave=0"]["decode_tok_s"] == pytest.approx(sum(runs_0) / 2)
    printed = capsys.readouterr().out
    assert printed.count("=== interleave") == 4 and "mean" in printed
    saved = json.loads((tmp_path / "serving.json").read_text())["runs"]
    assert "sweep|custom|short|c2|cpu|interleave" in saved
    assert {k for k in saved if not k.startswith("sweep")} == {f"custom|short|c2|cpu|graphs|page_size8|interleave{n}"
                                                               for n in (0, 3)}


def test_bench_replays_one_turn_traces(model, tmp_path):
    # the warm-up's returning turn fits the engine sized for one-turn traces (it was 64 tokens past it)
    result = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "1",
                                 "--max-new", "2", "--out-dir", str(tmp_path), "--no-progress"], model=model)
    assert result["overall"]["requests"] == 1
    assert "requests" not in result  # the per-request table only with --per-request


def test_bench_sweeps_a_kernel_knob_and_restores_it(model, tmp_path, monkeypatch):
    """--sweep of a decode kernel knob (profiles.host_time's AB_KNOBS): each variant set before its engine is built
    (its graphs captured), the knob's setting back afterwards."""
    from kernels import registry
    from kernels.tuning import KernelTuning
    seen = engines_built(monkeypatch, lambda args: registry.tuning().tma_min_bytes)
    summary = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "2",
                                  "--max-new", "2", "--concurrency", "2", "--page-size", "8", "--out-dir",
                                  str(tmp_path), "--no-progress", "--sweep", "tma_min=16m,4m"], model=model)
    assert seen == [16 * 2**20, 4 * 2**20] and registry.tuning() == KernelTuning()  # the default again
    assert [r["variant"] for r in summary["runs"]] == ["tma_min=16m", "tma_min=4m"]


def test_shared_cpu_pins_the_threads_with_the_hogs_and_restores_them():
    """Inside shared_cpu(2): this process's threads on one CPU, two more processes busy on it; after: the CPU sets
    as they were and the hogs gone."""
    import os
    import threading

    from profiles.shared_cpu import shared_cpu
    before = os.sched_getaffinity(0)
    with shared_cpu(2):
        cpu = os.sched_getaffinity(0)
        started = []
        thread = threading.Thread(target=lambda: started.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
        hogs = [int(p) for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), os.getpid())]
        assert len(cpu) == 1 and started == [cpu] and len(hogs) == 2
        assert all(os.sched_getaffinity(pid) == cpu for pid in hogs)
    assert os.sched_getaffinity(0) == before
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in hogs)
    with pytest.raises(ValueError, match="hogs"), shared_cpu(-1):
        pass


def _child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_bench_sweeps_host_hogs(model, tmp_path, monkeypatch):
    """--sweep host_hogs=0,1: the replay of each variant under that many hogs (profiles.shared_cpu), keyed apart."""
    seen = []
    real = bench_serving.shared_cpu

    def spy(hogs):
        seen.append(hogs)
        return real(hogs)
    monkeypatch.setattr(bench_serving, "shared_cpu", spy)
    summary = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.01", "--turns", "2",
                                  "--max-new", "2", "--concurrency", "2", "--page-size", "8", "--out-dir",
                                  str(tmp_path), "--no-progress", "--sweep", "host_hogs=0,1"], model=model)
    assert seen == [0, 1] and [r["variant"] for r in summary["runs"]] == ["host_hogs=0", "host_hogs=1"]
    saved = json.loads((tmp_path / "serving.json").read_text())["runs"]
    assert "custom|short|c2|cpu|graphs|page_size8|host_hogs1" in saved


@pytest.mark.parametrize("argv,message", [
    (["--sweep", "slices=4"], "unknown knob"), (["--sweep", "interleave=a,b"], "integers"),
    (["--sweep", "interleave="], "give values"), (["--repeat", "0"], "--repeat"),
    (["--sweep", "tma_min=soon"], "no variant 'soon'"),
    (["--sweep", "prenorm+tma_min=fused/2m"], "no variant 'fused/2m'"),
    (["--sweep", "host_hogs=0,-1"], "host_hogs takes values >= 0")])
def test_bench_refuses_a_bad_sweep(model, argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_serving.main(["--device", "cpu", *argv], model=model)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 100), st.floats(0, 50)), min_size=1, max_size=12))
def test_critical_path_charges_sum_to_the_span(spans):
    from profiles.host_time import critical_path
    kernels = [(name, start, start + length) for name, start, length in spans]
    rows = critical_path(kernels)
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    assert sum(r["critical_us"] for r in rows) == pytest.approx(span, abs=1e-6)
    assert all(r["critical_us"] >= 0 for r in rows)
    assert sum(r["count"] for r in rows) == len(kernels)


def test_critical_path_charges_overlap_once_and_gaps_to_idle():
    from profiles.host_time import critical_path
    rows = {r["kernel"]: r for r in critical_path([("a", 0, 10), ("b", 5, 12), ("c", 15, 20), ("a", 16, 30)])}
    assert {k: r["critical_us"] for k, r in rows.items()} == {"a": 20.0, "b": 2.0, "(idle)": 3.0, "c": 5.0}
    assert rows["a"]["duration_us"] == 12.0 and rows["a"]["count"] == 2
    # a kernel inside a longer one: the inner one owns its stretch (it ends first), no idle while the outer runs
    rows = {r["kernel"]: r["critical_us"] for r in critical_path([("a", 0, 10), ("b", 2, 5)])}
    assert rows == {"a": 7.0, "b": 3.0}


def test_host_time_timeline_needs_a_decode_step_on_cuda():
    from profiles import host_time
    with pytest.raises(SystemExit, match="give --decode B"):
        host_time.main(["--timeline", "--device", "cpu"])


def submitted(requests) -> list[tuple[str, int]]:
    return [(r.trace, r.turn) for r in sorted(requests, key=lambda r: r.submit)]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_sessions_interleave_their_turns_across_the_users(model, concurrency):
    ts = traces.synthetic("short", 3, vocab=512, scale=0.005, turns=3, max_new=2)
    engine = LLMEngine(model, EngineConfig.for_token_budget(4096, page_size=8, max_num_seqs=concurrency))
    requests, users, _, _ = bench_serving.replay(engine, ts, concurrency, progress=False, sessions=True)
    order = submitted(requests)
    assert sorted(order) == [(t.id, j) for t in ts for j in range(3)]
    for t in ts:  # each session's turns in order
        assert [turn for trace, turn in order if trace == t.id] == [0, 1, 2]
    assert order[:3] == [(t.id, 0) for t in ts]  # never-served sessions first
    assert all(a[0] != b[0] for a, b in zip(order, order[1:]))  # 3 sessions > users: none runs twice in a row
    if concurrency == 1:  # one user: round robin
        assert order == [(t.id, j) for j in range(3) for t in ts]
    assert {r.user for r in requests} == set(range(concurrency))
    assert sum(len(u.trace_times) for u in users) == 3  # every session's trace time, kept by its last server
    # the returning turns found their prefixes: the eligible hit rate covers them
    _, overall = bench_serving.summarize(requests, users, 1.0)
    assert overall["eligible_hit_rate"] > 0.5


def test_bench_sessions_flag_reports_hit_rate_and_returning_ttft(model, tmp_path, capsys):
    run = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.005", "--turns", "3",
                              "--max-new", "2", "--concurrency", "2", "--sessions", "3", "--page-size", "8",
                              "--out-dir", str(tmp_path), "--no-progress"], model=model)
    printed = capsys.readouterr().out
    overall = run["overall"]
    assert run["sessions"] == 3 and overall["requests"] == 9
    assert overall["ttft_return_p99_ms"] >= overall["ttft_return_p50_ms"] > 0 and overall["eligible_hit_rate"] > 0
    line = next(x for x in printed.splitlines() if x.startswith("3 sessions interleaved over 2 users"))
    assert "eligible hit rate" in line and "returning-turn TTFT p50" in line and "p99" in line
    assert f"{overall['eligible_hit_rate']:.3f}" in line
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert any("|sessions3" in key for key in saved["runs"])
    # Belady's MIN over the same requests and pool bounds the measured rate (a little slack: it holds pages by
    # request, where the engine shares them)
    assert overall["belady_eligible_hit_rate"] >= overall["eligible_hit_rate"] - 0.02
    assert f"offline optimum {overall['belady_eligible_hit_rate']:.3f}" in line


def test_bench_pool_flags_size_the_snapshot_and_kv_pools(model, tmp_path):
    run = bench_serving.main(["--device", "cpu", "--trace", "short", "--scale", "0.005", "--turns", "2",
                              "--max-new", "2", "--concurrency", "2", "--sessions", "4", "--page-size", "8",
                              "--snapshot-slots", "5", "--kv-working-set", "0.75", "--kv-eviction", "lru",
                              "--out-dir", str(tmp_path), "--no-progress"], model=model)
    assert "snapshot_slots 5" in run["engine"]
    pages = int(run["engine"].split("KV pool ")[1].split(" pages")[0])
    traces = bench_serving.build_traces(SimpleNamespace(sessions=4, num_traces=None, concurrency=2, trace="short",
                                                        scale=0.005, turns=2, max_new=2, seed=0),
                                        model.config.vocab_size)
    longest = max(t.total_tokens() for t in traces)
    assert pages == max(int(0.75 * bench_serving.working_set_pages(traces, 8)), 2 * (-(-(longest + 1) // 8)))
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert any("|snapshot_slots5|kv_working_set0.75" in key and "kv_evictionlru" in key for key in saved["runs"])


def test_bench_sessions_refuses_a_different_num_traces(model, capsys):
    with pytest.raises(SystemExit, match="--sessions"):
        bench_serving.main(["--device", "cpu", "--sessions", "3", "--num-traces", "2"], model=model)
