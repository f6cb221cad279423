"""Kernel stamps (kernels/stamps.py) and the step timeline built from them (profiles/step_stamps.py): slots handed
out in launch order and read back after a run, the phases of a layer from synthetic stamps, the stamps' place
around the PDL wait in the sm_90a PTX, and on the GPU a stamped attention layer whose stamps are ordered as its
kernels ran and whose output equals the unstamped one."""
import pytest
import torch
from conftest import compiled_script_output, rel_err

from kernels import stamps
from profiles.step_stamps import layer_phases, summarise


def test_slots_in_launch_order_and_read_back():
    buf = stamps.StampBuffer(torch.device("cpu"), capacity=3)
    a, b = buf.take("a"), buf.take("b")
    assert buf.take("c") is not None and buf.take("d") is None  # full: no slot
    a[:] = torch.tensor([5, 9, 10, 12, 18, 20, 14, 2])
    b[2:4] = torch.tensor([30, 31])
    assert [r["name"] for r in buf.read()] == ["a", "b"]  # c wrote no go stamp: not read
    assert buf.read()[0] == {"slot": 0, "name": "a", "first_arrive": 5, "last_arrive": 9, "first_go": 10,
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


def _row(name, arrive, go, end, spread=0):
    # two programs: one ends halfway, the other at `end`
    return {"name": name, "first_arrive": arrive, "last_arrive": arrive, "first_go": go, "last_go": go + spread,
            "first_end": (go + end) // 2, "last_end": end, "busy_sum": (end - go) // 2 + (end - go), "programs": 2}


def test_layer_phases_from_synthetic_stamps():
    # an attention layer then a GDN layer then an attention layer, in ns
    rows = [_row("attention_prep", 0, 1000, 2000), _row("attention_split", 500, 2500, 9000, spread=300),
            _row("attention_combine", 2600, 9200, 11000), _row("gdn_decode", 15000, 40000, 44000),
            _row("attention_prep", 60000, 90000, 91000), _row("attention_split", 90500, 92000, 99000),
            _row("attention_combine", 92100, 99500, 101000)]
    first, gdn, last = layer_phases(rows, ["attention", "gdn", "attention"])
    assert first["prep"] == pytest.approx(1.5) and first["split"] == pytest.approx(6.7)
    assert first["combine"] == pytest.approx(1.8) and first["after"] == pytest.approx(29.0)
    assert first["attention_split.lead"] == pytest.approx(2.0) and first["attention_split.spread"] == 0.3
    assert first["attention_split.first_end"] == pytest.approx(3.25) and first["attention_split.busy"] == 4.875
    assert gdn["kernel"] == pytest.approx(4.0) and gdn["after"] == pytest.approx(46.0)
    assert "after" not in last  # the last layer's GEMVs run into the next step
    with pytest.raises(ValueError, match="expected"):
        layer_phases(rows[:-1], ["attention", "gdn", "attention"])


def test_summary_prices_the_gemvs_between_mixers(monkeypatch):
    import profiles.step_stamps as S
    monkeypatch.setattr(S, "bytes_after", lambda model, i: 3_000_000)  # layer 0's 'after' streams 3 MB
    rows = [{"layer": 0, "kind": "gdn", "kernel": 4.0, "after": 1.0}, {"layer": 1, "kind": "gdn", "kernel": 6.0}]
    table = {(r["kind"], r["phase"]): r for r in summarise([rows], model=None)}
    assert table[("gdn", "kernel")]["mean_us"] == 5.0 and table[("gdn", "kernel")]["count"] == 2
    assert table[("gdn", "after")]["gemv_TBps"] == pytest.approx(3.0)  # 3 MB in 1 us


SM90_STAMPED = """
from kernels import paged_decode_attention as P
from tests.sm90_compile import triton_sm90
tile = P.plan(1, 4, 256, 2)
bf16 = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "gate_ptr")
arg_type = lambda n: ("*bf16" if n in bf16 else "*fp32" if n.startswith("ws_") else "*i64" if n == "stamps_ptr" else
                      "*i32" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32")
const = dict(Q_LEN=1, VARLEN=True, GROUP=4, HEAD_DIM=256, PAGE_SIZE=16, BLOCK_M=tile.block_m, BLOCK_N=P.BLOCK_N,
             DIRECT=False, HAS_GATE=True, DOT_PRECISION="tf32", PREFETCH=False, PDL=True)
for on in (False, True):
    ptx = triton_sm90(P._split_kernel, {**const, "STAMPS": on}, arg_type, tile.num_warps, tile.num_stages)["ptx"]
    before, _, after = ptx.partition("griddepcontrol.wait")
    print(before.count("%globaltimer"), after.count("%globaltimer"), ptx.count("atom.global"), flush=True)
"""


def test_stamps_sit_around_the_pdl_wait_in_sm90_ptx():
    # the decode split kernel compiled for sm_90a on the CPU: without STAMPS no timer and no atomic; with it one
    # reading before griddepcontrol.wait (arrival), two after (go, end), eight atomics (min / max at arrival, go and
    # end, and the busy sum and program count)
    off, on = [tuple(map(int, line.split())) for line in compiled_script_output(SM90_STAMPED, timeout=600).split("\n")
               if line]
    assert off == (0, 0, 0) and on == (1, 2, 8), (off, on)


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
