"""The one-launch GDN first stretch (kernels/in_proj_gdn.py) against its two ops (ops.in_proj_gated_deltanet_by_ops).

CPU: who computes what (every in-projection row, conv channel and b / a row is taken by exactly one CTA of one
cluster, and each CTA's conv channels are the rows it projected), the config's errors, the routing (off the GPU, and
with FUSED off, the op is its two ops), the choice of cluster size, and a compile for sm_90a of the 0.8B (first
layer: no residual), 2B and 9B shapes in clusters of 8, and of 2B and 9B in clusters of 4 (one subprocess), checking
the PTX: the cluster barriers, the DSMEM stores, one PDL wait, a TMA copy a box of each row block. `gpu` tests
(H200): the output, the new residual (exact), the conv window (exact: the same GEMV rows) and the fp32 state over
consecutive steps against the two ops, in clusters of 8 and of 4, with the slot inside a larger pool; in a CUDA
graph.
"""
import json

import pytest
import torch
from conftest import HAS_CUDA, compiled_script_output, rel_err
from test_gdn_decode import decode_step, make_layer

import reference as R
from kernels import in_proj_gdn as F
from kernels import tma_gemv
from model import ops
from model.ops import _ref_gated_deltanet

needs_dsl = pytest.mark.skipif(not tma_gemv.dsl_available(), reason="nvidia-cutlass-dsl is not installed")
gpu_sm90 = pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90")
SHAPES = [(1024, 16, 16), (2048, 16, 16), (4096, 16, 32)]  # hidden, Hk, Hv: 0.8B, 2B, 9B
EPS = 1e-6


@pytest.mark.parametrize("hk, hv, cluster", [(16, 16, 8), (16, 32, 8), (4, 16, 8), (1, 1, 8), (16, 16, 4),
                                             (16, 32, 4), (3, 3, 4)])
def test_ctas_take_every_row_once(hk, hv, cluster):
    cfg = F.InProjGdnConfig(2048, hk, hv, cluster=cluster).validate()
    rows, channels, ab_rows = [], [], []
    for head in range(hk):
        for rank in range(cluster):
            blocks = [F.row_block(cfg, b, head, rank) for b in range(cfg.blocks)]
            rows += [block * F.BLOCK_ROWS + r for block in blocks for r in range(F.BLOCK_ROWS)]
            for tidx in range(cfg.own_channels):  # a thread's channel is the row it reads from its projection
                channel = F.own_channel(cfg, tidx, head, rank)
                assert channel == blocks[tidx // F.BLOCK_ROWS] * F.BLOCK_ROWS + tidx % F.BLOCK_ROWS, (head, rank, tidx)
                channels.append(channel)
            if rank < 2 * cfg.group:
                ab_rows.append(F.ab_weight_row(cfg, rank, head))
    first_ab = cfg.conv_channels + hv * cfg.head_dim
    assert sorted(rows) == list(range(first_ab))  # q | k | v | z, each row once
    assert sorted(channels) == list(range(cfg.conv_channels))
    assert sorted(ab_rows) == list(range(first_ab, first_ab + 2 * hv))
    assert F.ab_weight_row(cfg, cluster - 1, hk - 1) < first_ab + 2 * hv  # unused ranks stay in the weight


@pytest.mark.parametrize("hk, hv, cluster", [(16, 16, 8), (16, 32, 8), (16, 64, 8), (16, 16, 4), (16, 32, 4),
                                             (3, 6, 4)])
def test_the_delta_step_reads_its_heads_rows(hk, hv, cluster):
    # what the kernel's delta step reads, by position in the CTA's shared memory, is the math's q, k (key head h,
    # all dk, pushed by every rank), and v, z of value head h * G + j at the CTA's dv columns
    cfg = F.InProjGdnConfig(2048, hk, hv, cluster=cluster).validate()
    d, sl = cfg.head_dim, cfg.slice

    def proj_row(i, head, rank):  # the in-projection row of sProj[i]
        return F.row_block(cfg, i // F.BLOCK_ROWS, head, rank) * F.BLOCK_ROWS + i % F.BLOCK_ROWS
    for head in range(hk):
        qk = {}  # sQK position -> the channel pushed there
        for rank in range(cluster):
            for t in range(2 * sl):  # sQK[(t // slice) * dk + rank * slice + t % slice] = silu(conv) of channel t
                qk[(t // sl) * d + rank * sl + t % sl] = F.own_channel(cfg, t, head, rank)
            for col in range(cfg.group * sl):
                j, c = divmod(col, sl)
                vhead, dv_col = head * cfg.group + j, rank * sl + c
                v = F.own_channel(cfg, (2 + j) * sl + c, head, rank)  # sConv[(2 + j) * slice + col % slice]
                assert v == (2 * hk + vhead) * d + dv_col, (head, rank, col)
                z = proj_row((2 + cfg.group + j) * sl + c, head, rank)  # sProj[(2 + G + j) * slice + col % slice]
                assert z == cfg.conv_channels + vhead * d + dv_col, (head, rank, col)
        assert qk == {piece * d + i: (piece * hk + head) * d + i for piece in (0, 1) for i in range(d)}


@pytest.mark.parametrize("fields, match", [(dict(head_dim=64), "head_dim"), (dict(num_v_heads=48), "num_v_heads"),
                                           (dict(num_v_heads=24), "num_v_heads"), (dict(conv_taps=1), "conv_taps"),
                                           (dict(cluster=2), "cluster"),
                                           (dict(num_v_heads=64, cluster=4), "num_v_heads")])
def test_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        F.InProjGdnConfig(**{**dict(hidden=2048, num_k_heads=16, num_v_heads=16), **fields}).validate()


def _layer(hidden, hk, hv, device, seed=0, slots=5, add=True):
    """Random bf16 weights (the in-projection scaled to keep its outputs O(1)) and pools: the op's arguments
    without the step, as a dict."""
    gen = torch.Generator().manual_seed(seed)
    dk = 128
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dk, torch.bfloat16, slots, "cpu")
    rows = 2 * hk * dk + 2 * hv * dk + 2 * hv
    bf = lambda t: t.to(torch.bfloat16).to(device)
    return dict(x=bf(torch.randn(1, hidden, generator=gen)),
                residual=bf(torch.randn(1, hidden, generator=gen)) if add else None,
                norm_w=bf(0.1 * torch.randn(hidden, generator=gen)), eps=EPS,
                in_w=bf(torch.randn(rows, hidden, generator=gen) / hidden ** 0.5),
                parts=(2 * hk * dk + hv * dk, hv * dk, hv, hv), conv_w=bf(conv_w), A_log=bf(a_log),
                dt_bias=bf(dt_bias), gdn_norm_w=bf(norm_w), conv_states=bf(conv), recurrent_states=rec.to(device),
                num_k_heads=hk)


def _cloned(args):
    """_layer's arguments with every tensor cloned (the op updates the states in place)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _run(args, step):
    return ops.in_proj_gated_deltanet(*_positional(args, step))


def test_off_the_gpu_it_is_its_two_ops(monkeypatch):
    # FUSED on, but no sm_90 GPU here: the op runs its two ops (the reference's here), which split the projection
    # into qkv | z | b | a as the layer's parts say
    monkeypatch.setattr(F, "FUSED", True)
    args = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in _layer(256, 2, 4, "cpu").items()}
    ref_conv, ref_rec = args["conv_states"].clone(), args["recurrent_states"].clone()
    step = decode_step(torch.tensor([3]))
    out, s = F.in_proj_gated_deltanet(*_positional(args, step))
    proj, ref_s = R.add_rms_norm_linear(args["x"], args["residual"], args["norm_w"], EPS, args["in_w"])
    qkv, z, b, a = proj.split(list(args["parts"]), dim=-1)
    ref = _ref_gated_deltanet(qkv, z.view(1, 4, 128), b, a, args["conv_w"], args["A_log"], args["dt_bias"],
                              args["gdn_norm_w"], ref_conv, ref_rec, step, 2, EPS)
    assert torch.equal(out, ref.reshape(1, -1)) and torch.equal(s, ref_s)
    assert torch.equal(args["recurrent_states"], ref_rec) and torch.equal(args["conv_states"], ref_conv)
    assert not torch.equal(ref_rec, _layer(256, 2, 4, "cpu")["recurrent_states"])  # the step moved the state


@pytest.mark.parametrize("add", [True, False])
def test_available_answers_for_every_layer_off_the_gpu(add):
    # the first layer has no residual: `available` says no here (no GPU) rather than failing on the None
    a = _layer(256, 2, 4, "cpu", add=add)
    assert F.available(a["x"], a["in_w"], _available_tensors(a, torch.tensor([3])), 2) is False


@pytest.mark.parametrize("resident", [16, 15])
def test_available_only_where_every_cluster_is_resident(monkeypatch, resident):
    # the shape checks pass (tma_gemv's GPU check patched away); then the driver's count of resident 8-CTA clusters
    # decides: 16 key heads need 16 at once, else the two ops run (a second wave would double the kernel's time)
    monkeypatch.setattr(tma_gemv, "available", lambda *a, **kw: True)
    asked = []
    monkeypatch.setattr(F, "resident_clusters", lambda device, cluster: asked.append((device, cluster)) or resident)
    a = _layer(256, 16, 16, "cpu")
    assert F.available(a["x"], a["in_w"], _available_tensors(a, torch.tensor([3])), 16) is (resident == 16)
    assert asked == [(0, 8)]


@pytest.mark.parametrize("clusters, group, resident, chosen", [
    ((8,), 1, {8: 15, 4: 33}, 0),  # 2B's 16 key heads on session 22's H200: refused
    ((8, 4), 1, {8: 15, 4: 33}, 4),  # clusters of 4 fit
    ((8, 4), 1, {8: 16, 4: 33}, 8),  # the first that fits
    ((8, 4), 4, {8: 15, 4: 33}, 0),  # G = 4 needs 8 ranks for its b and a rows
    ((4,), 2, {8: 0, 4: 16}, 4)])
def test_the_first_cluster_size_that_fits(monkeypatch, clusters, group, resident, chosen):
    monkeypatch.setattr(F, "CLUSTERS", clusters)
    monkeypatch.setattr(F, "resident_clusters", lambda device, cluster: resident[cluster])
    assert F.fitting_cluster(16, group, 0) == chosen


def _available_tensors(a, state_slots):
    """in_proj_gdn.available's keyword tensors of _layer's arguments."""
    return dict(residual=a["residual"], input_norm_w=a["norm_w"], conv_w=a["conv_w"], A_log=a["A_log"],
                dt_bias=a["dt_bias"], norm_w=a["gdn_norm_w"], conv_states=a["conv_states"],
                recurrent_states=a["recurrent_states"], state_slots=state_slots)


def _positional(a, step):
    return (a["x"], a["residual"], a["norm_w"], a["eps"], a["in_w"], a["parts"], a["conv_w"], a["A_log"],
            a["dt_bias"], a["gdn_norm_w"], a["conv_states"], a["recurrent_states"], step, a["num_k_heads"])


SM90_COMPILE = """
import json, sys
from kernels.in_proj_gdn import InProjGdnConfig, compile_config
from tests.sm90_compile import parity_resets_in_loops, ptx_counts
for hidden, hk, hv, add, cluster, ring_kib in json.loads(sys.argv[1]):
    cfg = InProjGdnConfig(hidden, hk, hv, add=add, cluster=cluster, ring_bytes=ring_kib * 1024)
    ptx = compile_config(cfg, keep_ptx=True).__ptx__
    print(json.dumps({"blocks": cfg.blocks, "cluster": cluster, "resets": parity_resets_in_loops(ptx),
                      **ptx_counts(ptx, {
        "cluster_arrive": "barrier.cluster.arrive", "cluster_wait": "barrier.cluster.wait",
        "mapa": "mapa.shared::cluster",
        "remote_store": "st.shared::cluster.f32", "pdl_wait": "griddepcontrol.wait",
        "tma": "cp.async.bulk.tensor.2d"})}), flush=True)
"""


@needs_dsl
def test_compiles_for_sm90(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    cases = [(1024, 16, 16, False, 8, 128), (2048, 16, 16, True, 8, 128), (4096, 16, 32, True, 8, 128),
             (1024, 16, 16, True, 4, 128), (2048, 16, 16, True, 4, 128),
             (4096, 16, 32, True, 4, 192)]  # in_proj_gdn.RING_BYTES
    out = compiled_script_output(SM90_COMPILE, json.dumps(cases), timeout=600)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), out
    for row in rows:
        assert row["resets"] == 0, row  # the ring's state carried across the CTA's row blocks
        # a relaxed arrive at the start (waited by the producer warp and by the consumers), two exchanges (arrive +
        # wait each) after the first wait
        assert row["cluster_arrive"] == 3 and row["cluster_wait"] == 4, row
        # q / k, b / a and the norm's sums, each pushed to every CTA of the cluster
        assert row["mapa"] == row["remote_store"] == 3 * row["cluster"], row
        # a copy a box of the slot, in each of the CTA's (2 + 2G) * slice / 16 row blocks (unrolled)
        assert row["pdl_wait"] == 1 and row["tma"] == row["blocks"] * tma_gemv.SLOT_ROWS // F.BLOCK_ROWS, row


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
@pytest.mark.parametrize("hidden, hk, hv", SHAPES)
@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("cluster", [8, 4])
def test_matches_its_two_ops_over_steps(monkeypatch, hidden, hk, hv, add, cluster):
    import kernels.backend  # noqa: F401  (registers the triton backend)
    fused = _layer(hidden, hk, hv, "cuda", seed=hidden + hv, add=add)
    apart = _cloned(fused)
    slot = decode_step(torch.tensor([3], device="cuda"))
    # where fewer clusters fit at once (15 of 8 CTAs on session 22's H200) the kernel runs in two waves: slower, and
    # refused by `available`, but as exact (the clusters share nothing); its outputs are checked either way
    monkeypatch.setattr(F, "resident_clusters", lambda device_index, cluster: hk)
    monkeypatch.setattr(F, "CLUSTERS", (cluster,))
    compiled, get = [], F._CACHE.get
    monkeypatch.setattr(F._CACHE, "get", lambda cfg: compiled.append(cfg) or get(cfg))  # no silent fallback
    assert F.available(fused["x"], fused["in_w"], _available_tensors(fused, slot.state_slots), hk)
    with ops.use_backend("triton"):
        for step in range(3):  # the same x each step: the states carry the difference
            fresh = lambda args: dict(args, residual=None if not add else args["residual"].clone())  # may be summed
            monkeypatch.setattr(F, "FUSED", True)  # into in place; the states are shared and carry over
            out, s = _run(fresh(fused), slot)
            monkeypatch.setattr(F, "FUSED", False)
            ref, ref_s = _run(fresh(apart), slot)
            # in the kernel's order, so that the first failure names the stage: the staged row, the projection rows
            # (the conv windows hold them), the exchange of q / k / b / a and the delta step, then the gated norm
            what = f"hidden {hidden} Hk {hk} Hv {hv} add={add} cluster {cluster} step {step}"
            assert torch.equal(s, ref_s), f"{what}: s = x + residual"
            assert torch.equal(fused["conv_states"], apart["conv_states"]), f"{what}: conv windows (projection rows)"
            err = rel_err(fused["recurrent_states"], apart["recurrent_states"])
            assert err < 1e-3, f"{what}: recurrent state (q / k / b / a exchange, delta step): {err:.2e}"
            err = rel_err(out.float(), ref.float())  # conv, norm and state sums in other orders than Triton's
            assert err < 1e-2, f"{what}: output (o, the norm's exchange, z): {err:.2e}"
            assert [c.cluster for c in compiled] == [cluster] * (step + 1), what  # the kernel ran, in this cluster


@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_available_only_where_every_cluster_fits():
    args = _layer(2048, 16, 16, "cuda", seed=5)
    slot = decode_step(torch.tensor([1], device="cuda"))
    resident = F.resident_clusters(0)
    assert 1 <= resident <= torch.cuda.get_device_properties(0).multi_processor_count // 8, resident
    assert F.available(args["x"], args["in_w"], _available_tensors(args, slot.state_slots), 16) == (resident >= 16)


def _fused_2b_layer(monkeypatch, seed, slot):
    """FUSED on (in two waves where the 16 clusters do not fit at once), the triton backend registered, a 2B GDN
    layer's arguments on the GPU, a clone of them, and a decode step of state slot `slot`."""
    import kernels.backend  # noqa: F401
    monkeypatch.setattr(F, "FUSED", True)
    monkeypatch.setattr(F, "resident_clusters", lambda device_index, cluster: 16)
    args = _layer(2048, 16, 16, "cuda", seed=seed)
    return args, _cloned(args), decode_step(torch.tensor([slot], device="cuda"))





@pytest.mark.gpu
@gpu_sm90
@needs_dsl
def test_replays_in_a_cuda_graph(monkeypatch):
    args, eager, step = _fused_2b_layer(monkeypatch, seed=7, slot=1)
    with ops.use_backend("triton"):
        _run(_cloned(args), step)  # compile, eager
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = _run(args, step)
        for _ in range(2):
            graph.replay()
            ref, _ = _run(eager, step)
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
            assert torch.equal(args["recurrent_states"], eager["recurrent_states"])
