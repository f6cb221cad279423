"""The Gated DeltaNet decode kernel (kernels/gdn_decode.py) against the reference op model.ops._ref_gated_deltanet:
output, conv window and fp32 state over consecutive steps, slots scattered in a larger pool, model.ops' routing to
it, CUDA-graph replay, and argument checks."""
import pytest
import torch
from conftest import compiled_script_output, record_launches, rel_err

from kernels import gdn_decode, registry
from kernels.gdn_decode import gated_deltanet_op, gdn_decode_step
from kernels.gdn_prefill import gdn_key
from model import ops
from model.ops import _ref_gated_deltanet
from model.step import StepInput

EPS = 1e-6
CONV_K = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def decode_step(slots: torch.Tensor) -> StepInput:
    """A StepInput of len(slots) sequences with one new token each (only the GDN fields matter)."""
    b, dev = slots.numel(), slots.device
    zeros = torch.zeros(b, dtype=torch.int64, device=dev)
    return StepInput(token_ids=zeros, positions=zeros, cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=dev),
                     max_seqlen_q=1, seqused_k=torch.ones(b, dtype=torch.int32, device=dev),
                     page_table=torch.zeros(b, 1, dtype=torch.int32, device=dev), slot_mapping=zeros,
                     state_slots=slots)


def make_layer(gen, hk, hv, dk, dv, dtype, n_slots, device=DEVICE):
    """Random weights and random nonzero pools: conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states."""
    c = 2 * hk * dk + hv * dv
    r = lambda *s: torch.randn(*s, generator=gen)
    weights = (r(c, CONV_K) * 0.5, torch.log(torch.rand(hv, generator=gen) * 2 + 0.01), r(hv), 1 + 0.2 * r(dv))
    pools = (r(n_slots, c, CONV_K - 1).to(dtype), r(n_slots, hv, dk, dv) * 0.5)
    return [t.to(device) for t in weights] + [t.to(device) for t in pools]


def make_token(gen, bsz, hk, hv, dk, dv, dtype, device=DEVICE):
    """Random per-token inputs: qkv (B, C), z (B, Hv, dv), b, a (B, Hv)."""
    c = 2 * hk * dk + hv * dv
    return [(torch.randn(*s, generator=gen) * m).to(dtype).to(device)
            for s, m in (((bsz, c), 1.0), ((bsz, hv, dv), 1.0), ((bsz, hv), 1.0), ((bsz, hv), 2.0))]


def assert_close(out, ref, tol, what):
    assert (out.shape, out.dtype) == (ref.shape, ref.dtype), f"{what}: {out.shape} {out.dtype} vs {ref.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def run_steps(hk, hv, dk, dv, dtype, bsz, n_slots, steps, tol_out, tol_state, seed=0, device=DEVICE,
              norm_dtype=None, slot_dtype=torch.int64):
    """Decode `steps` tokens with the kernel and the reference from the same pools; compare after each step.
    norm_w is in the io dtype unless norm_dtype says otherwise."""
    gen = torch.Generator().manual_seed(seed)
    conv_w, a_log, dt_bias, norm_w, conv0, rec0 = make_layer(gen, hk, hv, dk, dv, dtype, n_slots, device)
    conv_w, norm_w = conv_w.to(dtype), norm_w.to(norm_dtype or dtype)
    slots = torch.randperm(n_slots, generator=gen)[:bsz].to(device, slot_dtype)
    untouched = torch.ones(n_slots, dtype=torch.bool, device=device)
    untouched[slots] = False
    k_conv, k_rec, r_conv, r_rec = conv0.clone(), rec0.clone(), conv0.clone(), rec0.clone()
    for t in range(steps):
        qkv, z, b, a = make_token(gen, bsz, hk, hv, dk, dv, dtype, device)
        out = gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, k_conv, k_rec, slots, hk, EPS)
        ref = _ref_gated_deltanet(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, r_conv, r_rec, decode_step(slots),
                                  hk, EPS)
        what = f"step {t} Hk={hk} Hv={hv} dk={dk} dv={dv} B={bsz} {dtype}"
        assert_close(out, ref, tol_out, f"{what} output")
        assert torch.equal(k_conv, r_conv), f"{what}: conv_states differ (max {(k_conv - r_conv).abs().max():.3e})"
        assert_close(k_rec, r_rec, tol_state, f"{what} recurrent_states")
    assert torch.equal(k_rec[untouched], rec0[untouched]), "a slot outside state_slots was written"
    assert torch.equal(k_conv[untouched], conv0[untouched]), "a conv window outside state_slots was written"


# ---- interpreter-sized (also run on the GPU) ----------------------------------------------------------------

# (dtype, (Hk, Hv, dk, dv), B): GQA ratios 2, 1 and 3 (27B's), a dv that is not a power of two, B 1 and 3
CASES = [(torch.float32, (2, 4, 16, 16), 3), (torch.float32, (1, 3, 16, 24), 1), (torch.float16, (2, 2, 32, 32), 3),
         (torch.float16, (2, 4, 16, 16), 1), (torch.float16, (1, 3, 16, 24), 3), (torch.float32, (1, 2, 16, 64), 1)]
TOLS = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-4)}  # (output, recurrent state)


@pytest.mark.parametrize("dtype,shape,bsz", CASES, ids=lambda x: str(x).replace("torch.", "").replace(", ", "-"))
def test_matches_reference(dtype, shape, bsz):
    # slots of either integer type: int32 in the fp16 cases (as the engine's decode steps pass them), else int64
    run_steps(*shape, dtype, bsz, n_slots=bsz + 3, steps=3, tol_out=TOLS[dtype][0], tol_state=TOLS[dtype][1],
              seed=bsz, slot_dtype=torch.int32 if dtype == torch.float16 else torch.int64)


def test_states_loaded_before_the_wait_in_one_pass(monkeypatch):
    # EARLY: where one pass covers a key head's value heads (B1, 2 value heads a key head: both at once) the states
    # load before the PDL wait; 3 value heads a key head go one a pass, loading them inside it
    launches = record_launches(monkeypatch, gdn_decode, "_gdn_decode_kernel")
    run_steps(2, 4, 16, 16, torch.float32, 1, n_slots=4, steps=2, tol_out=1e-5, tol_state=1e-5)
    run_steps(1, 3, 16, 24, torch.float32, 1, n_slots=2, steps=1, tol_out=1e-5, tol_state=1e-5)
    assert [(kwargs["G"], kwargs["EARLY"]) for _, kwargs in launches] == [(2, True), (2, True), (1, False)]


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import gdn_decode as G
for early in (False, True):  # 9B's B1 launch: 16 key heads, both value heads a pass
    const = dict(HK=16, HV=32, DK=128, DV=128, K=4, G=2, BK=128, BV=128, BT=4, EARLY=early, STAMPS=False, PDL=True)
    types = {"state_ptr": "*fp32", "slots_ptr": "*i32", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32",
             "scale": "fp32", "eps": "fp32"}
    sig = {n: "constexpr" if n in const else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in G._gdn_decode_kernel.arg_names}
    ptx = triton.compile(ASTSource(G._gdn_decode_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    after_barrier = ptx[ptx.find("bar.sync", wait):]  # past the first reduction after the wait
    late = [line for line in after_barrier.splitlines() if "ld.global" in line and "ld.global.cg" not in line]
    print(ptx.count("griddepcontrol"), ptx[:wait].count("ld.global"), len(late), flush=True)
"""


def test_loads_around_the_wait_in_sm90_ptx():
    # the interpreter runs no PDL: compiled for sm_90a on the CPU. Without EARLY only the slot loads before
    # griddepcontrol.wait; with it the states, conv windows and weights do, and every load of what the previous
    # kernel wrote (qkv, z, a, b) comes before the first reduction's barrier: no load after it, one round trip after
    # the wait instead of several
    out = compiled_script_output(SM90_COMPILE)
    (pdl_late, before_late, after_late), (pdl_early, before_early, after_early) = [
        tuple(map(int, line.split())) for line in out.splitlines()]
    assert pdl_late == pdl_early == 2, out
    assert before_late == 1 and before_early > 1, out
    assert after_early == 0 < after_late, out


def test_rows_as_views_of_one_projection():
    # the model's fused in_proj: qkv | z | b | a are column slices of one (B, C + Hv dv + 2 Hv) matmul output
    gen = torch.Generator().manual_seed(5)
    hk, hv, dk, dv, bsz = 2, 4, 16, 32, 3
    c = 2 * hk * dk + hv * dv
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dv, torch.float32, 5)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    proj = torch.randn(bsz, c + hv * dv + 2 * hv, generator=gen).to(DEVICE)
    qkv, z, b, a = proj.split([c, hv * dv, hv, hv], dim=-1)
    z = z.view(bsz, hv, dv)
    r_conv, r_rec = conv.clone(), rec.clone()
    out = gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, rec, slots, hk, EPS)
    ref = _ref_gated_deltanet(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, a_log,
                              dt_bias, norm_w, r_conv, r_rec, decode_step(slots), hk, EPS)
    assert_close(out, ref, 1e-5, "strided rows output")
    assert torch.equal(conv, r_conv)
    assert_close(rec, r_rec, 1e-5, "strided rows recurrent_states")
    with pytest.raises(ValueError, match="z must be contiguous within a row"):
        gdn_decode_step(qkv, z.transpose(1, 2).contiguous().transpose(1, 2), b, a, conv_w, a_log, dt_bias, norm_w,
                        conv, rec, slots, hk, EPS)


def test_fp32_norm_weight_with_fp16_io():
    run_steps(2, 4, 16, 16, torch.float16, 2, n_slots=4, steps=2, tol_out=1e-3, tol_state=1e-4,
              norm_dtype=torch.float32)


def test_adapter_dispatch_and_out_buffer(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    hk, hv, dk, dv, bsz = 2, 4, 16, 16, 2
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dv, torch.float32, 4)
    slots = torch.tensor([3, 1], device=DEVICE)
    # decode: the kernel, writing into a poisoned out= buffer
    qkv, z, b, a = make_token(gen, bsz, hk, hv, dk, dv, torch.float32)
    r_conv, r_rec = conv.clone(), rec.clone()
    ref = _ref_gated_deltanet(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, r_conv, r_rec, decode_step(slots), hk, EPS)
    out = torch.full_like(z, float("nan"))
    got = gdn_decode_step(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, rec, slots, hk, EPS, out=out)
    assert got is out
    assert_close(out, ref, 1e-5, "out= buffer")
    # model.ops.gated_deltanet on the triton backend: the router sends a decode step to this kernel (fp32 on the CPU:
    # not the CuTe decode's layout), one launch, and a prefill step (3 + 1 tokens) to the chunked prefill
    launches = record_launches(monkeypatch, gdn_decode, "_gdn_decode_kernel")
    args = (qkv, z, b, a, conv_w, a_log, dt_bias, norm_w)
    with ops.use_backend("triton"):
        got = ops.gated_deltanet(*args, conv.clone(), rec.clone(), decode_step(slots), hk, EPS)
    ref = _ref_gated_deltanet(*args, r_conv.clone(), r_rec.clone(), decode_step(slots), hk, EPS)
    assert_close(got, ref, 1e-5, "model.ops, decode")
    assert len(launches) == 1, "a decode step must run the kernel"
    assert_close(gated_deltanet_op(*args, conv.clone(), rec.clone(), decode_step(slots), hk, EPS), ref, 1e-5,
                 "the op entry, decode")
    key = gdn_key(*args, conv, rec, decode_step(slots), hk, EPS)
    assert not key.cute_layout and registry.choose("gated_deltanet", key, "triton").name == "gdn_decode"
    assert registry.choose("gated_deltanet", key, "reference").name == "reference"
    qkv, z, b, a = make_token(gen, 4, hk, hv, dk, dv, torch.float32)
    step = decode_step(slots)
    step.cu_seqlens, step.max_seqlen_q = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE), 3
    key = gdn_key(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv, rec, step, hk, EPS)
    assert registry.choose("gated_deltanet", key, "triton").name == "gdn_prefill_chunked"


# ---- argument checks -----------------------------------------------------------------------------------------

def _valid_args():
    gen = torch.Generator().manual_seed(3)
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, 2, 4, 16, 16, torch.float32, 4)
    qkv, z, b, a = make_token(gen, 2, 2, 4, 16, 16, torch.float32)
    return dict(qkv=qkv, z=z, b=b, a=a, conv_w=conv_w, A_log=a_log, dt_bias=dt_bias, norm_w=norm_w,
                conv_states=conv, recurrent_states=rec, state_slots=torch.tensor([0, 2], device=DEVICE),
                num_k_heads=2, eps=EPS)


BAD_ARGS = [  # (the argument the error must name, a function of the valid arguments returning a bad value)
    ("recurrent_states", lambda d: d["recurrent_states"].half()),
    ("recurrent_states", lambda d: d["recurrent_states"].transpose(2, 3)),
    ("qkv", lambda d: d["qkv"][:, 1:]),
    ("state_slots", lambda d: d["state_slots"].float()),
    ("state_slots", lambda d: d["state_slots"][:1]),
    ("num_k_heads", lambda d: 3),
    ("z", lambda d: d["z"].half()),
    ("a", lambda d: d["a"][:1]),
    ("conv_w", lambda d: d["conv_w"][1:]),
    ("conv_states", lambda d: d["conv_states"][..., :2]),
    ("norm_w", lambda d: d["norm_w"][1:]),
    ("out", lambda d: torch.empty(2, 4, 8, device=DEVICE)),
]


@pytest.mark.parametrize("name,bad", BAD_ARGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_ARGS)])
def test_rejects_bad_arguments(name, bad):
    args = _valid_args()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=f"^{name}"):
        gdn_decode_step(**args)


def test_rejects_mixed_devices():
    args = _valid_args()
    args["z"] = torch.empty(args["z"].shape, device="meta")
    with pytest.raises(ValueError, match="share one device"):
        gdn_decode_step(**args)


# ---- GPU: bf16 at Qwen3.5-9B shapes ----------------------------------------------------------------------------

QWEN9B = (16, 32, 128, 128)  # Hk, Hv, dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("bsz", [1, 7, 64])
def test_gpu_bf16_real_shapes_20_steps(bsz):
    run_steps(*QWEN9B, torch.bfloat16, bsz, n_slots=bsz + 5, steps=20, tol_out=1e-2, tol_state=1e-3, seed=bsz)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    check_graph_replay(QWEN9B, bsz=8, n_slots=16, seed=11)


def check_graph_replay(shape, bsz, n_slots, seed, gate_dtype=torch.float32):
    """gdn_decode_step captured in a CUDA graph (bf16, A_log and dt_bias in gate_dtype), replayed 3 times with new
    tokens and sequences moved between slots, against the reference."""
    hk, hv, dk, dv = shape
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    conv_w, a_log, dt_bias, norm_w, conv, rec = make_layer(gen, hk, hv, dk, dv, dtype, n_slots)
    conv_w, norm_w, a_log, dt_bias = conv_w.to(dtype), norm_w.to(dtype), a_log.to(gate_dtype), dt_bias.to(gate_dtype)
    static = make_token(gen, bsz, hk, hv, dk, dv, dtype)  # qkv, z, b, a
    slots = torch.randperm(n_slots, generator=gen)[:bsz].cuda()
    out = torch.empty_like(static[1])
    call = lambda: gdn_decode_step(*static, conv_w, a_log, dt_bias, norm_w, conv, rec, slots, hk, EPS, out=out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    r_conv, r_rec = conv.clone(), rec.clone()
    for t in range(3):
        new = make_token(gen, bsz, hk, hv, dk, dv, dtype)
        for dst, src in zip(static, new):
            dst.copy_(src)
        slots.copy_(torch.randperm(n_slots, generator=gen)[:bsz])  # sequences move between slots
        out.fill_(float("nan"))
        graph.replay()
        ref = _ref_gated_deltanet(*new, conv_w, a_log, dt_bias, norm_w, r_conv, r_rec, decode_step(slots.clone()), hk,
                                  EPS)
        assert_close(out, ref, 1e-2, f"graph replay {t} output")
        assert torch.equal(conv, r_conv), f"graph replay {t}: conv_states differ"
        assert_close(rec, r_rec, 1e-3, f"graph replay {t} recurrent_states")
