"""Reference gated delta rule (Gated DeltaNet's linear attention), recurrent and chunked.

Per value head, with the fp32 state S (dk x dv):
    S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k l2-normalised and q scaled by 1/sqrt(dk). Value head j reads key head j // (Hv // Hk).

Shapes: q, k (batch, T, Hk, dk); v (batch, T, Hv, dv); g, beta (batch, T, Hv);
or (total, ...) without the batch dim when cu_seqlens (N+1,) is given.
initial_state / final_state: (batch or N, Hv, dk, dv) fp32. Outputs are in v's dtype.
"""
import torch

from reference.checks import check_cu_seqlens, check_tensor
from reference.norms import l2norm


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    # -> q, k, v, g, beta in the compute dtype with key heads repeated to Hv: (T, Hv, d)
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[-2] // q.shape[-2]
    q = q.repeat_interleave(group, dim=-2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    k = k.repeat_interleave(group, dim=-2)
    return q, k, v, g, beta


def _recurrent_one(q, k, v, g, beta, state):
    # q, k: (T, H, dk); v: (T, H, dv); g, beta: (T, H); state: (H, dk, dv) -> o: (T, H, dv), state
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        update = beta[t][:, None] * (v[t] - predicted)  # (H, dv)
        state = state + torch.einsum("hk,hv->hkv", k[t], update)
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs) if outs else v.new_zeros(v.shape), state


def _recurrent_states_one(q, k, v, g, beta, state):
    # _recurrent_one, keeping the state after every token: -> o: (T, H, dv), states (T, H, dk, dv)
    states = []
    for t in range(q.shape[0]):
        o, state = _recurrent_one(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        states.append((o[0], state))
    if not states:
        return v.new_zeros(v.shape), state.new_zeros(0, *state.shape)
    return torch.stack([o for o, _ in states]), torch.stack([st for _, st in states])


def _chunked_one(q, k, v, g, beta, state, chunk_size):
    """The same recurrence, one chunk at a time. Within a chunk, with G_t = cumsum(g) and
    u_j = beta_j (v_j - exp(G_j) S0^T k_j - sum_{i<j} exp(G_j - G_i) (k_j.k_i) u_i), i.e. the unit lower
    triangular system (I + A) U = beta (V - exp(G) K S0):
        o_t = exp(G_t) q_t S0 + sum_{j<=t} exp(G_t - G_j) (q_t.k_j) u_j
        S_end = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T
    """
    outs = []
    for s in range(0, q.shape[0], chunk_size):
        qc, kc, vc = (t[s:s + chunk_size].transpose(0, 1) for t in (q, k, v))  # (H, C, d)
        gc = g[s:s + chunk_size].transpose(0, 1).cumsum(-1)  # (H, C)
        bc = beta[s:s + chunk_size].transpose(0, 1)  # (H, C)
        n = qc.shape[1]
        decay = torch.exp(gc[:, :, None] - gc[:, None, :])  # (H, C, C): exp(G_t - G_j)
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        strict = lower.clone().fill_diagonal_(False)
        decay = decay.masked_fill(~lower, 0.0)
        a = (bc[:, :, None] * decay * (kc @ kc.transpose(1, 2))).masked_fill(~strict, 0.0)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc[:, :, None] * (vc - torch.exp(gc)[:, :, None] * (kc @ state))  # (H, C, dv)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        o = torch.exp(gc)[:, :, None] * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ u
        g_last = gc[:, -1:]
        state = torch.exp(g_last)[:, :, None] * state + (kc * torch.exp(g_last - gc)[:, :, None]).transpose(1, 2) @ u
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else v.new_zeros(v.shape), state


def _segmented_one(q, k, v, g, beta, state, chunk_size, segment_size):
    """Context parallelism, the form in which one long sequence is split over independent programs. The recurrence
    is affine in the state, so a segment of segment_size tokens maps its start state S0 to M S0 + E:
        E (dk, dv): the segment's end state from a zero start;
        M (dk, dk): its transition, the same chunked recurrence applied to the identity with no values (v = 0), i.e.
                    the product over its chunks of (exp(G_last) I - kd^T w).
    Every segment's (M, E) is independent of the others (pass 1), a short scan S_{j+1} = M_j S_j + E_j gives each
    segment's true start, and pass 2 runs each segment from its start for the outputs."""
    h, dk = k.shape[1], k.shape[2]
    eye = torch.eye(dk, dtype=q.dtype, device=q.device).expand(h, dk, dk)
    bounds = [(s, min(s + segment_size, q.shape[0])) for s in range(0, q.shape[0], segment_size)]
    starts = [state]
    for lo, hi in bounds:  # pass 1 (every segment at once, in a kernel), then the scan
        qs, ks, vs, gs, bs = (t[lo:hi] for t in (q, k, v, g, beta))
        _, end = _chunked_one(qs, ks, vs, gs, bs, torch.zeros_like(state), chunk_size)
        _, transition = _chunked_one(qs, ks, torch.zeros_like(ks), gs, bs, eye, chunk_size)
        starts.append(transition @ starts[-1] + end)
    outs = [_chunked_one(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s0, chunk_size)[0]
            for (lo, hi), s0 in zip(bounds, starts)]  # pass 2
    return torch.cat(outs) if outs else v.new_zeros(v.shape), starts[-1]


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    nd = 3 if cu_seqlens is not None else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=nd)
    check_tensor("g", g, ndim=nd - 1)
    check_tensor("beta", beta, ndim=nd - 1)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:-2] != q.shape[:-2] or g.shape != v.shape[:-1] or beta.shape != v.shape[:-1]:
        raise ValueError(f"v {tuple(v.shape)}, g {tuple(g.shape)} and beta {tuple(beta.shape)} do not match "
                         f"q {tuple(q.shape)}")
    if v.shape[-2] % q.shape[-2] != 0:
        raise ValueError(f"value heads ({v.shape[-2]}) must be a multiple of key heads ({q.shape[-2]})")
    n = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    if cu_seqlens is not None:
        check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0])
    if initial_state is not None:
        check_tensor("initial_state", initial_state, ndim=4)
        want = (n, v.shape[-2], q.shape[-1], v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape {want}, got {tuple(initial_state.shape)}")


def _run(step, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_qk_l2norm):
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if cu_seqlens is None:
        bounds = [(b, None) for b in range(q.shape[0])]
        pick = lambda t, i: t[bounds[i][0]]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
        pick = lambda t, i: t[bounds[i][0]:bounds[i][1]]
    h, dk, dv = v.shape[-2], q.shape[-1], v.shape[-1]
    outs, states = [], []
    for i in range(len(bounds)):
        s0 = (initial_state[i].to(q.dtype) if initial_state is not None
              else torch.zeros(h, dk, dv, dtype=q.dtype, device=q.device))
        o, s = step(pick(q, i), pick(k, i), pick(v, i), pick(g, i), pick(beta, i), s0)
        outs.append(o)
        states.append(s)
    o = torch.stack(outs) if cu_seqlens is None else torch.cat(outs)
    return o.to(out_dtype), torch.stack(states).to(torch.promote_types(q.dtype, torch.float32))


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, scale=None, cu_seqlens=None,
                               use_qk_l2norm: bool = True):
    """The oracle: one token at a time. Returns (o, final_state)."""
    return _run(_recurrent_one, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_qk_l2norm)


def recurrent_gated_delta_rule_states(q, k, v, g, beta, *, initial_state=None, scale=None,
                                      use_qk_l2norm: bool = True):
    """A speculative verify step's oracle: batch sequences of T tokens each ((batch, T, ...) shapes), with the state
    after every token. Returns (o, states (batch, T, Hv, dk, dv) fp32): a step that keeps L of its T tokens rolls
    each GDN layer back to states[:, L - 1]."""
    return _run(_recurrent_states_one, q, k, v, g, beta, initial_state, scale, None, use_qk_l2norm)


def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, scale=None, cu_seqlens=None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64, segment_size: int | None = None):
    """The chunked (WY) form, chunk_size tokens at a time. Same arguments and results as the recurrent form.
    segment_size (a multiple of chunk_size): each sequence split into segments of that many tokens, stitched by their
    transitions (context parallelism: `_segmented_one`)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if segment_size is not None and (segment_size < chunk_size or segment_size % chunk_size):
        raise ValueError(f"segment_size must be a positive multiple of chunk_size ({chunk_size}), got {segment_size}")
    if segment_size is None:
        step = lambda *a: _chunked_one(*a, chunk_size)
    else:
        step = lambda *a: _segmented_one(*a, chunk_size, segment_size)
    return _run(step, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_qk_l2norm)


def gdn_gates(a, b, A_log, dt_bias):
    """beta = sigmoid(b) and the log-decay g = -exp(A_log) * softplus(a + dt_bias), both fp32.
    a, b: (..., Hv); A_log, dt_bias: (Hv,)."""
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())
