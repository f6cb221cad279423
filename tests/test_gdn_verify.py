"""The Gated DeltaNet verify step (kernels/gdn_verify.py) against the reference op: 1..8 tokens a sequence, the
state after each token in its position slot (conv window and fp32 recurrent state), the last token's in the
sequence's slot where it has no position slot (else that slot is untouched), other slots untouched; the router's
choice of it; an sm_90a compile."""
import pytest
import torch
from conftest import compiled_script_output
from test_gdn_decode import DEVICE, EPS, assert_close, make_layer, make_token

from kernels import registry
from kernels.gdn_decode import GdnKey
from kernels.gdn_verify import MAX_Q_LEN, launch_verify
from kernels.registry import H200
from model import ops
from model.ops import _ref_gated_deltanet
from model.step import StepInput

ops._load("triton")


def verify_step(lens: list[int], slots: torch.Tensor, position_slots: torch.Tensor) -> StepInput:
    n, dev = sum(lens), slots.device
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    zeros = torch.zeros(n, dtype=torch.int64, device=dev)
    return StepInput(token_ids=zeros, positions=zeros, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                     max_seqlen_q=max(lens), cu_seqlens_host=tuple(cu),
                     seqused_k=torch.tensor(lens, dtype=torch.int32, device=dev),
                     page_table=torch.zeros(len(lens), 1, dtype=torch.int32, device=dev), slot_mapping=zeros,
                     state_slots=slots, position_slots=position_slots)


# (dtype, (Hk, Hv, dk, dv), tokens a sequence): GQA 1, 2 and 3, a dv that is not a power of two, 1..8 tokens
CASES = [(torch.float32, (2, 4, 16, 16), [3, 1, 5, 2]), (torch.float32, (1, 3, 16, 24), [8]),
         (torch.float32, (2, 2, 32, 32), [2, 4]), (torch.float16, (2, 4, 16, 16), [5, 5, 1]),
         (torch.float16, (1, 1, 16, 64), [7, 3])]
TOLS = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-4)}


@pytest.mark.parametrize("dtype,shape,lens", CASES, ids=lambda x: str(x).replace("torch.", "").replace(", ", "-"))
def test_matches_reference(dtype, shape, lens):
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(len(lens))
    n_slots = len(lens) + sum(lens) + 5
    conv_w, a_log, dt_bias, norm_w, conv0, rec0 = make_layer(gen, hk, hv, dk, dv, dtype, n_slots)
    conv_w, norm_w = conv_w.to(dtype), norm_w.to(dtype)
    order = torch.randperm(n_slots, generator=gen).tolist()
    slots = torch.tensor(order[:len(lens)], device=DEVICE)
    free = iter(order[len(lens):])
    # every odd sequence's last token has a position slot (a greedy step on the device writes them all)
    targets = [next(free) if (t < length - 1 and t % 3 != 1) or (t == length - 1 and i % 2) else -1
               for i, length in enumerate(lens) for t in range(length)]
    position_slots = torch.tensor(targets, device=DEVICE)
    qkv, z, b, a = make_token(gen, sum(lens), hk, hv, dk, dv, dtype)
    k_conv, k_rec, r_conv, r_rec = conv0.clone(), rec0.clone(), conv0.clone(), rec0.clone()
    step = verify_step(lens, slots, position_slots)
    out = launch_verify(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, k_conv, k_rec, slots, step.cu_seqlens,
                        position_slots, max(lens), EPS, torch.empty_like(z))
    ref = _ref_gated_deltanet(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, r_conv, r_rec, step, hk, EPS)
    what = f"Hk={hk} Hv={hv} dk={dk} dv={dv} lens={lens} {dtype}"
    assert_close(out, ref, TOLS[dtype][0], f"{what} output")
    written = slots.tolist()[::2] + [t for t in targets if t >= 0]
    assert torch.equal(k_conv[written], r_conv[written]), f"{what}: conv windows differ"
    assert_close(k_rec[written], r_rec[written], TOLS[dtype][1], f"{what} recurrent states")
    untouched = [s for s in range(n_slots) if s not in written]
    assert torch.equal(k_rec[untouched], rec0[untouched]) and torch.equal(k_conv[untouched], conv0[untouched])


def test_the_op_path_routes_verify_steps_here(monkeypatch):
    """model.ops.gated_deltanet of a step with position slots runs this kernel on the triton backend (the
    interpreter on the CPU), and the chunked prefill never takes it."""
    calls = []
    import kernels.gdn_verify as V
    monkeypatch.setattr(V, "launch_verify", lambda *args: calls.append(len(args)) or args[-1])
    gen = torch.Generator().manual_seed(0)
    conv_w, a_log, dt_bias, norm_w, conv0, rec0 = make_layer(gen, 2, 4, 16, 16, torch.float32, 6)
    qkv, z, b, a = make_token(gen, 4, 2, 4, 16, 16, torch.float32)
    step = verify_step([2, 2], torch.tensor([0, 1], device=DEVICE), torch.tensor([2, -1, 3, -1], device=DEVICE))
    with ops.use_backend("triton"):
        ops.gated_deltanet(qkv, z, b, a, conv_w, a_log, dt_bias, norm_w, conv0, rec0, step, 2, EPS)
    assert calls


@pytest.mark.parametrize("key, expected", [
    (GdnKey(4, 16, 16, 128, 128, torch.bfloat16, H200, False, True), "gdn_verify"),  # K = 3 drafts
    (GdnKey(8, 16, 32, 128, 128, torch.bfloat16, H200, False, True), "gdn_verify"),  # 9B, K = 4 (5 tokens)
    (GdnKey(16, 16, 16, 128, 128, torch.bfloat16, H200, False, True), "reference"),  # a prefill chunk beside
    (GdnKey(4, 16, 16, 128, 128, torch.bfloat16, H200, False, True, True), "reference"),  # with a snapshot point
    (GdnKey(4, 16, 16, 128, 128, torch.bfloat16, H200, False, False), "gdn_prefill_chunked"),  # no verify
])
def test_verify_choices(key, expected):
    assert registry.choose("gated_deltanet", key, "triton").name == expected
    assert MAX_Q_LEN == 8


SM90_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import gdn_verify as V
for hv, g in ((16, 1), (32, 2)):  # 2B and 9B at batch 1
    const = dict(HK=16, HV=hv, DK=128, DV=128, K=4, G=g, BK=128, BV=128, BT=4, T_MAX=8)
    types = {"state_ptr": "*fp32", "slots_ptr": "*i64", "cu_ptr": "*i32", "targets_ptr": "*i64",
             "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32", "scale": "fp32", "eps": "fp32"}
    sig = {n: "constexpr" if n in const else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in V._gdn_verify_kernel.arg_names}
    k = triton.compile(ASTSource(V._gdn_verify_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4 * g})
    print(hv, k.n_regs if hasattr(k, "n_regs") else 0, k.asm["ptx"].count("st.global"), flush=True)
"""


def test_compiles_for_sm90():
    out = compiled_script_output(SM90_COMPILE)
    assert [line.split()[0] for line in out.splitlines()] == ["16", "32"], out
