"""Kernel stamps (kernels/stamps.py) and the step timeline built from them (profiles/step_stamps.py): slots handed
out in launch order and read back after a run, launches' critical-path shares from synthetic stamps, the stamps'
place around the PDL wait in the sm_90a PTX (Triton's split kernel, the CuTe TMA GEMV chain), and on the GPU a
stamped attention layer whose stamps are ordered as its kernels ran and whose output equals the unstamped one."""
import json

import pytest
import torch
from conftest import compiled_script_output, rel_err

from kernels import stamps, tma_gemv
from profiles.step_stamps import critical_shares, summarise


def test_slots_in_launch_order_and_read_back():
    buf = stamps.StampBuffer(torch.device("cpu"), capacity=3)
    a, b = buf.take("a", bytes=4096), buf.take("b")
    assert buf.take("c") is not None and buf.take("d") is None  # full: no slot
    a[:] = torch.tensor([5, 9, 10, 12, 18, 20, 14, 2])
    b[2:4] = torch.tensor([30, 31])
    assert [r["name"] for r in buf.read()] == ["a", "b"]  # c wrote no go stamp: not read
    assert buf.read()[0] == {"slot": 0, "name": "a", "bytes": 4096, "first_arrive": 5, "last_arrive": 9, "first_go": 10,
                             "last_go": 12, "first_end": 18, "last_end": 20, "busy_sum": 14, "programs": 2}
    buf.reset()
    assert buf.read() == [] and buf.slots[0, 0] == stamps.INT64_MAX


def test_slot_is_a_dummy_unless_recording_on_a_gpu():
    cpu = torch.device("cpu")
    ptr, on = stamps.slot("x", cpu)
    assert not on and ptr.dtype == torch.int64 and ptr.numel() == len(stamps.FIELDS)
    with stamps.record(cpu) as buf:
        assert stamps.slot("x", cpu)[1] is False and buf.names == []  # the CPU interpreter runs no asm
    assert stamps._ACTIVE is None


def _row(name, arrive, go, end, spread=0, mb=0.0, programs=2):
    # two programs: one busy half the time to `end`, the other all of it (end 0 / no programs: no end stamp)
    return {"name": name, "bytes": int(mb * 1e6), "first_arrive": arrive, "last_arrive": arrive, "first_go": go,
            "last_go": go + spread, "first_end": (go + end) // 2, "last_end": end,
            "busy_sum": ((end - go) // 2 + (end - go)) if programs else 0, "programs": programs}


def test_critical_shares_add_up_to_the_step():
    # a GEMV, a mixer, a chain, in ns: each launch's share runs from its go to the next one's
    rows = [_row("tma_gemv", 0, 1000, 0, mb=21.0, programs=0), _row("gdn_decode", 500, 8000, 15000, spread=300),
            _row("tma_gemv_chain", 2000, 16000, 56000, mb=80.0)]
    gemv, gdn, chain = critical_shares(rows)
    assert gemv["share_us"] == pytest.approx(7.0) and gemv["TBps"] == pytest.approx(3.0) and gemv["busy_us"] is None
    assert gdn["share_us"] == pytest.approx(8.0) and gdn["lead_us"] == pytest.approx(7.5)
    assert gdn["spread_us"] == pytest.approx(0.3) and gdn["busy_us"] == pytest.approx(5.25) and gdn["TBps"] is None
    assert chain["share_us"] == pytest.approx(40.0) and chain["TBps"] == pytest.approx(2.0)  # the last: to its end
    assert sum(r["share_us"] for r in (gemv, gdn, chain)) == pytest.approx(55.0)  # first go to last end


def test_summary_groups_launches_by_kernel_and_size():
    one = critical_shares([_row("tma_gemv", 0, 0, 0, mb=50.0, programs=0), _row("gdn_decode", 0, 20000, 25000),
                           _row("tma_gemv", 0, 30000, 0, mb=50.0, programs=0), _row("gdn_decode", 0, 40000, 44000),
                           _row("tma_gemv", 0, 46000, 0, mb=20.0, programs=0), _row("argmax", 0, 56000, 60000)])
    table = {(r["name"], r["MB"]): r for r in summarise([one, one])}
    big = table[("tma_gemv", 50.0)]
    assert big["count"] == 2 and big["share_us"] == pytest.approx(15.0) and big["step_us"] == pytest.approx(30.0)
    assert big["min_us"] == pytest.approx(10.0) and big["max_us"] == pytest.approx(20.0)
    assert big["TBps"] == pytest.approx(50.0 / 15.0)
    assert table[("tma_gemv", 20.0)]["count"] == 1 and table[("gdn_decode", 0.0)]["count"] == 2
    assert [r["name"] for r in summarise([one])][:2] == ["tma_gemv", "gdn_decode"]  # launch order
    # a last launch without an end stamp has no share, rather than minus the timer's epoch
    last = critical_shares([_row("gdn_decode", 0, 1000, 3000), _row("argmax", 0, 5000, 0, programs=0)])[-1]
    assert last["share_us"] is None and summarise([[last]])[0]["share_us"] is None


def test_compare_matches_groups_of_two_runs(tmp_path, capsys):
    from profiles import step_stamps
    one = critical_shares([_row("tma_gemv", 0, 0, 0, mb=50.0, programs=0), _row("gdn_decode", 0, 20000, 25000),
                           _row("argmax", 0, 30000, 31000)])
    two = critical_shares([_row("tma_gemv", 0, 0, 0, mb=50.0, programs=0), _row("gdn_decode", 0, 18000, 22000),
                           _row("rms_norm", 0, 26000, 27000, programs=0), _row("argmax", 0, 28000, 29000)])
    paths = []
    for name, replay, knobs in (("base", one, []), ("other", two, ["tma_min=16m"])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"graph_ms": 1.5, "knobs": knobs, "groups": summarise([replay])}))
        paths.append(str(path))
    rows = {r["name"]: r for r in step_stamps.main(["--compare", *paths])["compare"]}
    assert rows["tma_gemv"]["step_delta_us"] == pytest.approx(-2.0) and rows["gdn_decode"]["other_us"] == 8.0
    assert rows["rms_norm"]["base_us"] is None and rows["rms_norm"]["other_us"] == 2.0  # only in the other run
    assert "tma_min=16m" in capsys.readouterr().out


SM90_STAMPED = """
from kernels import argmax as A
from tests.sm90_compile import split_kernel_sm90, triton_sm90
arg_type = lambda n: {"logits_ptr": "*bf16", "part_val_ptr": "*fp32", "stamps_ptr": "*i64"}.get(
    n, "*i32" if n.endswith("_ptr") and n != "out_ptr" else "*i64" if n == "out_ptr" else "i32")
for on in (False, True):
    split = split_kernel_sm90(PREFETCH=False, STAMPS=on)["ptx"]
    const = dict(CHUNK=A.CHUNK, P=122, PB=128, ADVANCE=False, STAMPS=on, PDL=True)
    greedy = triton_sm90(A._argmax_kernel, const, arg_type, A.NUM_WARPS, 1)["ptx"]
    for ptx in (split, greedy):
        before, _, after = ptx.partition("griddepcontrol.wait")
        print(before.count("%globaltimer"), after.count("%globaltimer"), ptx.count("atom.global"), flush=True)
"""


def test_stamps_sit_around_the_pdl_wait_in_sm90_ptx():
    # the decode split kernel compiled for sm_90a on the CPU: without STAMPS no timer and no atomic; with it one
    # reading before griddepcontrol.wait (arrival), two after (go, end), eight atomics (min / max at arrival, go and
    # end, and the busy sum and program count). The greedy argmax, the step's last kernel, stamps its end too (its
    # last program, after the token), so step_stamps' span reaches the step's end; its atomics: the ticket's besides
    # the stamps' eight
    split_off, argmax_off, split_on, argmax_on = [
        tuple(map(int, line.split())) for line in compiled_script_output(SM90_STAMPED, timeout=600).split("\n")
        if line]
    assert split_off == (0, 0, 0) and split_on == (1, 2, 8), (split_off, split_on)
    assert argmax_off[:2] == (0, 0) and argmax_on == (1, 2, argmax_off[2] + 8), (argmax_off, argmax_on)


SM90_GEMV_STAMPED = """
import dataclasses
from kernels.tma_gemv import GemvInput, choose_config, compile_config
chain = (GemvInput(2048, norm=True, add=True), GemvInput(6144, gated=True))
for on in (False, True):
    cfg = dataclasses.replace(choose_config(2048, 2048, chain=chain), stamps=on)
    ptx = compile_config(cfg, keep_ptx=True).__ptx__
    before, _, after = ptx.partition("griddepcontrol.wait")
    print(before.count("%globaltimer"), after.count("%globaltimer"), ptx.count("atom.global"), flush=True)
"""


@pytest.mark.skipif(not tma_gemv.dsl_available(), reason="nvidia-cutlass-dsl is not installed")
def test_the_tma_gemv_chain_stamps_around_its_wait(monkeypatch, tmp_path):
    # the CuTe chain (2B's out_proj -> norm -> gate_up -> down) compiled for sm_90a on the CPU: stamped, thread 0
    # reads the timer on arrival, at its go and at its CTA's end (after a consumer barrier), and adds eight
    # atomics to the grid syncs' two
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    off, on = [tuple(map(int, line.split())) for line in
               compiled_script_output(SM90_GEMV_STAMPED, timeout=600).splitlines()[-2:]]
    assert off == (0, 0, 2) and on == (1, 2, 10), (off, on)


@pytest.mark.gpu
def test_a_stamped_attention_layer_on_the_gpu():
    from kernels.attention_prep import attention_prep
    from kernels.paged_decode_attention import choose_num_splits, paged_decode_attention
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    h, kv, d, page, ctx = 8, 2, 256, 16, 4097
    pages = -(-ctx // page)
    k_pages = torch.randn(pages, page, kv, d, device=dev, dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(pages, device=dev, dtype=torch.int32)[None]
    seqused = torch.tensor([ctx], device=dev, dtype=torch.int32)
    slot = (table[0, (ctx - 1) // page].long() * page + (ctx - 1) % page).view(1)
    q, k, v = (torch.randn(1, n, d, device=dev, dtype=torch.bfloat16) for n in (h, kv, kv))
    w = torch.randn(d, device=dev, dtype=torch.bfloat16) * 0.1
    cos, sin = torch.rand(1, d // 8, device=dev), torch.rand(1, d // 8, device=dev)

    def layer():
        q_out = attention_prep(q, k, v, w, w, cos, sin, k_pages, v_pages, slot, 1e-6)
        return paged_decode_attention(q_out[:, None], k_pages, v_pages, table, seqused)

    plain = layer()
    with stamps.record(dev) as buf:
        stamped = layer()
    torch.cuda.synchronize()
    assert rel_err(stamped, plain) == 0.0
    prep, split, combine = buf.read()
    assert [prep["name"], split["name"], combine["name"]] == ["attention_prep", "attention_split", "attention_combine"]
    for r in (prep, split, combine):
        assert r["first_arrive"] <= r["last_arrive"] and r["first_arrive"] <= r["first_go"] <= r["last_go"], r
        assert r["first_go"] <= r["first_end"] <= r["last_end"] and r["last_go"] <= r["last_end"], r
        assert 0 <= r["busy_sum"] <= r["programs"] * (r["last_end"] - r["first_go"]), r
    assert split["programs"] == 2 * choose_num_splits(1, kv, table.shape[1] * page)  # every program stamped
    assert prep["last_end"] <= split["first_go"] and split["last_end"] <= combine["first_go"], (prep, split, combine)
