"""The model's compute ops, behind one router (kernels.registry).

The model calls only the functions below. Each asks the router which implementation runs the call: on the
"reference" backend the plain PyTorch compositions registered here, on "triton" the kernels (kernels.routes) and
fa4's forwards (fa4.routes) wherever their entries take the call's key, the reference elsewhere. `set_backend` /
`use_backend` choose the backend, `use_tuning` the kernel tuning (kernels.tuning.KernelTuning);
`backend_table()` says which backend each op runs on.

Shapes: N tokens in a flat varlen batch (see model.step.StepInput), H query heads, KV key/value heads,
D head dim; GDN with Hk key heads, Hv value heads, dk/dv head dims, C = 2*Hk*dk + Hv*dv conv channels.
"""
import functools
from contextlib import nullcontext

import torch

import reference as R
from kernels import registry
from kernels.registry import Impl
from kernels.tuning import KernelTuning
from model.step import StepInput
from reference.checks import check_snapshots


def _load(name: str) -> None:
    if name == "triton":  # the kernels and fa4's forwards register themselves on import
        import fa4.routes  # noqa: F401
        import kernels.routes  # noqa: F401


def set_backend(name: str) -> None:
    """"reference" (plain PyTorch) or "triton" (the kernels and fa4's forwards, each where the router takes a call,
    the reference elsewhere)."""
    _load(name)
    registry.set_backend(name)


def get_backend() -> str:
    return registry.get_backend()


def use_backend(name: str):
    _load(name)
    return registry.use(backend=name)


def use_tuning(tuning: KernelTuning):
    """Run a block with these kernel choices (an A/B: two tunings in one process)."""
    return registry.use(tuning=tuning)


def backend_table() -> dict[str, str]:
    """op name -> the backend whose implementations it runs now (the reference where the active one has none)."""
    active = registry.get_backend()
    return {op: active if registry.impls(op, active) else "reference" for op in registry.ops()}


_nvtx_range = None  # name -> context manager while NVTX ranges are on


def enable_nvtx(on: bool = True) -> None:
    """Wrap every op in an NVTX range named after it (for `ncu --nvtx --nvtx-include "op/"`)."""
    global _nvtx_range
    if not on:
        _nvtx_range = None
        return
    try:
        import nvtx
        _nvtx_range = nvtx.annotate
    except ImportError:
        _nvtx_range = torch.cuda.nvtx.range if torch.cuda.is_available() else (lambda name: nullcontext())


def _run(op: str, *args):
    if _nvtx_range is None:
        return registry.run(op, *args)
    with _nvtx_range(op):
        return registry.run(op, *args)


# ---- the ops the model calls -------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    # x: (N, n) -> (N, n), zero-centred weight
    return _run("rms_norm", x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    # residual += x; returns (rms_norm(residual), residual); residual None: (rms_norm(x), x)
    return _run("add_rms_norm", x, residual, weight, eps)


def linear(x, weight):
    # x: (N, K), weight: (N_out, K) -> (N, N_out); the decode GEMV when the kernels run (few rows)
    return _run("linear", x, weight)


def silu_and_mul(gate_up):
    # gate_up: (N, 2I) -> (N, I)
    return _run("silu_and_mul", gate_up)


def add_rms_norm_linear(x, residual, norm_w, eps, weight):
    # residual += x (x alone when residual is None); returns (linear(rms_norm(residual), weight), residual), one GEMV
    # at decode. The residual passed in may be overwritten: use the returned one.
    return _run("add_rms_norm_linear", x, residual, norm_w, eps, weight)


def silu_and_mul_linear(gate_up, weight):
    # gate_up: (N, 2I), weight: (hidden, I) -> linear(silu_and_mul(gate_up), weight): (N, hidden), one GEMV at decode
    return _run("linear", gate_up, weight, None, True)


def out_proj_mlp(o, residual, out_w, norm_w, eps, gate_up_w, down_w):
    # a dense layer's second stretch: y = linear(o, out_w); (h, s) = add_rms_norm(y, residual); returns
    # (silu_and_mul_linear(linear(h, gate_up_w), down_w), s), one launch at batch-1 decode on the H200
    return _run("out_proj_mlp", o, residual, out_w, norm_w, eps, gate_up_w, down_w)


def out_proj_mlp_by_ops(o, residual, out_w, norm_w, eps, gate_up_w, down_w):
    """out_proj_mlp as its three ops, each on the active backend: the reference backend's out_proj_mlp."""
    gate_up, s = add_rms_norm_linear(linear(o, out_w), residual, norm_w, eps, gate_up_w)
    return silu_and_mul_linear(gate_up, down_w), s


def gather_rows(tables, indices):
    # tables[k]: (rows_k, width_k), indices[k]: (B,) int -> [(B, width_k)] = tables[k][indices[k]], up to four
    return _run("gather_rows", tables, indices)


def argmax(logits, advance=None):
    # logits: (B, V) -> (B,) int64 greedy tokens (the first maximum; a NaN counts as the largest); advance (a
    # reference.DecodeAdvance): also write them, and the next decode step's other inputs, into advance.inputs
    return _run("argmax", logits, advance)


def _ref_argmax(logits, advance=None):
    tokens = R.argmax(logits)
    if advance is not None:
        R.advance_decode_inputs(tokens, advance)
    return tokens


def attention_prep(q, k, v, q_norm_w, k_norm_w, step: StepInput, k_pages, v_pages, eps):
    """q: (N, H, D), k, v: (N, KV, D) raw projections. Applies q_norm/k_norm and partial RoPE, writes
    k and v into the layer's pages at step.slot_mapping, and returns the normed, rotated q."""
    return _run("attention_prep", q, k, v, q_norm_w, k_norm_w, step, k_pages, v_pages, eps)


def paged_attention(q, k_pages, v_pages, step: StepInput, scale, gate=None):
    """q: (N, H, D) over each sequence's cached K/V (step.page_table, step.seqused_k), causal at the end.
    Returns (N, H, D), times sigmoid(gate) when gate (N, H, D) is given."""
    return _run("paged_attention", q, k_pages, v_pages, step, scale, gate)


def gated_deltanet(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                   step: StepInput, num_k_heads, eps):
    """The GDN mixer between its projections. qkv: (N, C); z: (N, Hv, dv); b, a: (N, Hv); conv_w: (C, K);
    conv_states: (slots, C, K-1) and recurrent_states: (slots, Hv, dk, dv) fp32, read and updated in place at
    step.state_slots. Returns gated_rms_norm(o, z): (N, Hv, dv)."""
    return _run("gated_deltanet", qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                step, num_k_heads, eps)


def gated_deltanet_of_projection(proj, parts, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                                 step: StepInput, num_k_heads, eps):
    """gated_deltanet of a GDN in-projection's output proj (N, qkv | z | b | a, the widths `parts`): (N, Hv * dv)."""
    n, hv = proj.shape[0], parts[2]
    qkv, z, b, a = proj.split(list(parts), dim=-1)
    o = gated_deltanet(qkv, z.view(n, hv, -1), b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                       step, num_k_heads, eps)
    return o.reshape(n, -1)


def gated_deltanet_in_two_passes(op, args, step: StepInput, num_k_heads, eps):
    """A gated_deltanet op (`op`, which ignores snapshots) for a step with snapshot points: the sequences' tokens
    before their points run first, their slots are copied into the snapshot slots, then everything after the
    points runs (the GDN layer is a function of (state, tokens), so two passes give the one-pass result). The
    reference backend's way; the Triton one writes the snapshots inside its kernels."""
    qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states = args
    cu = step.cu_seqlens_host if step.cu_seqlens_host is not None else tuple(step.cu_seqlens.tolist())
    check_snapshots(cu, step.snapshot_offsets, step.snapshot_slots, step.state_slots)
    out = torch.empty_like(z)
    first, rest = _snapshot_passes(tuple(cu), tuple(step.snapshot_offsets), qkv.device)
    for rows, sub_cu, sub_cu_host, seqs in (first, rest):
        slots = step.state_slots[seqs]
        longest = max(x - y for x, y in zip(sub_cu_host[1:], sub_cu_host))
        sub = StepInput(token_ids=step.token_ids[rows], positions=step.positions[rows], cu_seqlens=sub_cu,
                        cu_seqlens_host=sub_cu_host, max_seqlen_q=longest, seqused_k=step.seqused_k,
                        page_table=step.page_table, slot_mapping=step.slot_mapping[rows], state_slots=slots)
        out[rows] = op(qkv[rows], z[rows], b[rows], a[rows], conv_w, A_log, dt_bias, norm_w, conv_states,
                       recurrent_states, sub, num_k_heads, eps)
        if rows is first[0]:  # the states at the points: into the snapshot slots
            dst = step.snapshot_slots[seqs]
            conv_states[dst] = conv_states[slots]
            recurrent_states[dst] = recurrent_states[slots]
    return out


@functools.lru_cache(maxsize=8)
def _snapshot_passes(cu: tuple[int, ...], offsets: tuple[int, ...], device):
    """The two passes of gated_deltanet_in_two_passes, each (token rows, cu_seqlens, its host copy, the sequences'
    indices), as device tensors moved once per step (every GDN layer of the step reuses them); for one sequence
    (a returning turn) the rows and the sequence are slices, so the passes take views and add no gathers."""
    pin = torch.device(device).type == "cuda"
    move = lambda values, dtype: torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)
    snap = [i for i, o in enumerate(offsets) if o]
    if len(offsets) == 1:
        o, n = offsets[0], cu[1]
        return [(slice(0, o), move((0, o), torch.int32), (0, o), slice(0, 1)),
                (slice(o, n), move((0, n - o), torch.int32), (0, n - o), slice(0, 1))]
    before = [range(cu[i], cu[i] + offsets[i]) for i in snap]
    after = [range(cu[i] + offsets[i], cu[i + 1]) for i in range(len(offsets))]
    passes = []
    for pieces, seqs in ((before, snap), (after, range(len(offsets)))):
        sub_cu = [0]
        for piece in pieces:
            sub_cu.append(sub_cu[-1] + len(piece))
        passes.append((move([r for piece in pieces for r in piece], torch.int64), move(sub_cu, torch.int32),
                       tuple(sub_cu), move(list(seqs), torch.int64)))
    return passes


def moe(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None):
    """x: (N, hidden) -> (N, hidden). expert_start (expert parallel): gate_up_w/down_w hold experts
    [expert_start, expert_start + E_local) of the router's E; the result is this rank's partial sum."""
    return _run("moe", x, router_w, gate_up_w, down_w, top_k, shared, expert_start)


# ---- the reference backend: compositions of reference/ ------------------------------------------------

def _ref_attention_prep(q, k, v, q_norm_w, k_norm_w, step, k_pages, v_pages, eps):
    q = R.apply_rope(R.rms_norm(q, q_norm_w, eps), step.cos, step.sin)
    k = R.apply_rope(R.rms_norm(k, k_norm_w, eps), step.cos, step.sin)
    R.write_kv_pages(k, v, k_pages, v_pages, step.slot_mapping)
    return q


def _ref_paged_attention(q, k_pages, v_pages, step, scale, gate):
    o = R.paged_attention(q, k_pages, v_pages, step.page_table, step.seqused_k, causal=True,
                          softmax_scale=scale, cu_seqlens_q=step.cu_seqlens)
    return o if gate is None else R.sigmoid_gate_mul(o, gate)


def _ref_gated_deltanet(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                        step, num_k_heads, eps):
    args = (qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states)
    if step.position_slots is not None:
        return _ref_gated_deltanet_per_position(*args, step, num_k_heads, eps)
    if step.snapshot_offsets is not None and any(step.snapshot_offsets):
        return gated_deltanet_in_two_passes(_ref_gated_deltanet, args, step, num_k_heads, eps)
    slots = step.state_slots
    n, hv, dv = z.shape
    dk = (qkv.shape[1] - hv * dv) // (2 * num_k_heads)
    mixed, conv_final = R.causal_conv1d(qkv, conv_w, initial_state=conv_states[slots],
                                        cu_seqlens=step.cu_seqlens, activation="silu")
    conv_states[slots] = conv_final.to(conv_states.dtype)
    q, k, v = mixed.split([num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
    g, beta = R.gdn_gates(a, b, A_log, dt_bias)
    # the same function either way; one token per sequence needs no chunking
    delta_rule = R.recurrent_gated_delta_rule if step.max_seqlen_q == 1 else R.chunk_gated_delta_rule
    o, final = delta_rule(q.view(n, num_k_heads, dk), k.view(n, num_k_heads, dk), v.view(n, hv, dv),
                                        g, beta, initial_state=recurrent_states[slots], cu_seqlens=step.cu_seqlens)
    recurrent_states[slots] = final.to(recurrent_states.dtype)
    return R.gated_rms_norm(o, z, norm_w, eps)


def _ref_gated_deltanet_per_position(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_states, recurrent_states,
                                     step, num_k_heads, eps):
    """A verify step (step.position_slots): each sequence's tokens through the recurrent form with the state after
    every token, which goes to its position slot where one is given, and to its snapshot slot at its snapshot point
    (a prefill chunk beside the verify chunks); the last token's to the sequence's slot where it has no position
    slot."""
    n, hv, dv = z.shape
    dk = (qkv.shape[1] - hv * dv) // (2 * num_k_heads)
    g, beta = R.gdn_gates(a, b, A_log, dt_bias)
    out = torch.empty_like(z)
    cu = step.cu_seqlens_host if step.cu_seqlens_host is not None else tuple(step.cu_seqlens.tolist())
    targets = step.position_slots.tolist()
    if step.snapshot_offsets is not None:  # the state after a chunk's first `offset` tokens: its snapshot slot
        for i, (offset, snapshot) in enumerate(zip(step.snapshot_offsets, step.snapshot_slots.tolist())):
            if offset:
                targets[cu[i] + offset - 1] = snapshot
    for i, slot in enumerate(step.state_slots.tolist()):
        rows = slice(cu[i], cu[i + 1])
        mixed, windows = R.causal_conv1d_windows(qkv[None, rows], conv_w, initial_state=conv_states[slot][None])
        q, k, v = mixed[0].split([num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
        t = q.shape[0]
        o, states = R.recurrent_gated_delta_rule_states(
            q.view(1, t, num_k_heads, dk), k.view(1, t, num_k_heads, dk), v.view(1, t, hv, dv), g[None, rows],
            beta[None, rows], initial_state=recurrent_states[slot][None])
        out[rows] = o[0]
        for j, target in enumerate(targets[rows]):
            dst = target if target >= 0 or j < t - 1 else slot
            if dst >= 0:
                conv_states[dst] = windows[0, j].to(conv_states.dtype)
                recurrent_states[dst] = states[0, j]
    return R.gated_rms_norm(out, z, norm_w, eps)


def _ref_linear(x, weight, out=None, gated=False):
    return R.silu_and_mul_linear(x, weight) if gated else R.linear(x, weight)


def _ref_moe(x, router_w, gate_up_w, down_w, top_k, shared, expert_start=None):
    if expert_start is None:
        return R.moe(x, router_w, gate_up_w, down_w, top_k, shared)
    return R.moe(x, router_w, gate_up_w, down_w, top_k, shared, expert_start)


REFERENCE = {
    "rms_norm": R.rms_norm,
    "add_rms_norm": R.add_rms_norm,
    "silu_and_mul": R.silu_and_mul,
    "linear": _ref_linear,
    "add_rms_norm_linear": R.add_rms_norm_linear,
    "out_proj_mlp": out_proj_mlp_by_ops,
    "attention_prep": _ref_attention_prep,
    "paged_attention": _ref_paged_attention,
    "gated_deltanet": _ref_gated_deltanet,
    "moe": _ref_moe,
    "argmax": _ref_argmax,
    "gather_rows": R.gather_rows,
}
for _op, _fn in REFERENCE.items():
    registry.define(_op)
    registry.register(_op, Impl("reference", "reference", _fn))
