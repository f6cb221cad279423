"""CUDA graphs for prefill steps: the row-wise stretches and the mixer cores, planned on the device.

A returning agent turn (a few hundred new tokens over a long cached context) is one eager step of ~330 launches,
and on the H200 its host side (~30 ms for 2B) is two to three times its GPU time: the step is launch-bound. The
graphs replay all of it: the row-wise ops (projections, norms, the MLP), the Gated DeltaNet cores once their batch
layout is planned on the device (kernels.varlen.DeviceBatch: the step's cu_seqlens, slots and snapshot points are
copied into static buffers, and a kernel inside the graph lays out the piece tables that the host would have
built), and the attention cores where the router's choice for the graph's key can be captured (Impl.captures:
the split-KV kernel, whose grid holds the most KV splits its bucket's steps ask for, kernels.paged_decode_attention.
captured_splits; each step copies its page table, key counts and KV slots into static buffers and the split count
the eager call would use into `kv_splits`).

Graphs are keyed by (rows, seqs): the row bucket, and 1 or max_seqs sequences. A one-sequence graph's attention
launches one program per (M-block, KV head, split); a graph of several sequences launches a work list
(captured_work_grid): its programs take the step's real (sequence, M-block, split) triples in turn and the rest
exit, so that its grid is not every sequence padded to the longest. Each program computes what the eager call's
program of the same triple computes where the eager call plans the graph's tile (its longest sequence's M-block and
the kernel variant; otherwise the sums are the same, rounded in another order). Both hold attention only where the
router's choice for the key captures: for max_seqs sequences the split-KV kernel takes buckets of up to 512 rows,
and larger ones go to a prefill forward, which runs eagerly between segments.

Stretch i (0 <= i <= L, for L layers) ends where layer i's mixer core begins:
    stretch 0:      RoPE of the positions, embed(tokens) -> layer 0's mixer_in
    stretch i:      layer i-1's mixer_out (its out projection and MLP) -> layer i's mixer_in
    stretch L:      layer L-1's mixer_out -> the final norm
A segment is a run of stretches joined by the cores captured with them; each segment is one graph, and an eager
core follows a segment that ends at one (an attention core the router sends to a forward, or the reference GDN).
A segment also ends after a captured core where a mixed step's prefill slice ends (`cuts`,
EngineConfig.slice_cuts), so that its decode step waits for no more prefill work than the slice's. With every core
captured and no cuts a step is one replay, then lm_head on the sequences' last rows (eager: B rows).
The graphs read and write static buffers: the tokens and positions, the residual stream (updated in place by the
fused add + norm), each mixer kind's projected input and core output, and the final norm's output. Captured for
every row bucket up to `max_tokens` (kernels.row_buckets): an eager step of N rows runs its projections on exactly
its bucket's rows, so a replayed step computes the very same products as the eager one. Rows past N hold what an
earlier step left there (their KV slots are -1: never written); every op on them is row-wise (the cores' piece
tables and cu_seqlens end at the step's last token), so they never reach a real row. Steps of at most
GEMV_MAX_ROWS tokens (the GEMV's) and above max_tokens run eagerly.

Not under tensor parallelism (the stretches hold the all-reduces) or the reference MoE (its routing syncs with the
host); the reference ops' cores run eagerly.
"""
from dataclasses import replace

import torch

import reference as R
from kernels import registry
from kernels.row_buckets import GEMV_MAX_ROWS, MATMUL_ROW_BUCKET, row_bucket, row_buckets_up_to
from model import ops
from model.cache import CachePools
from model.model import Qwen35ForCausalLM
from model.step import CapturedGrid, StepInput


def prefill_graphs_unsupported(model: Qwen35ForCausalLM) -> str | None:
    """Why this model's prefill stretches cannot be captured, or None."""
    if model.config.is_moe and ops.backend_table()["moe"] == "reference":
        return "the reference MoE's expert loop syncs with the host; use the triton backend"
    if model.plan.sharded:
        return "tensor-parallel stretches hold collectives"
    return None


class PrefillGraphs:
    """The prefill graphs of a model for steps of up to max_tokens tokens and max_seqs sequences over page tables
    of max_pages pages."""

    def __init__(self, model: Qwen35ForCausalLM, max_tokens: int, max_seqs: int, max_pages: int,
                 cuts: frozenset[int] = frozenset()):
        if max_tokens < MATMUL_ROW_BUCKET:
            raise ValueError(f"max_tokens must be at least {MATMUL_ROW_BUCKET}, got {max_tokens}")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
        if max_pages < 1:
            raise ValueError(f"max_pages must be at least 1, got {max_pages}")
        self.model, self.config = model, model.config
        self.layers = model.model.layers
        self.buckets = row_buckets_up_to(max_tokens)
        self.max_seqs, self.max_pages, self.cuts = max_seqs, max_pages, cuts
        weight = model.lm_head.weight
        rows, hidden, dev = self.buckets[-1], self.config.hidden_size, weight.device
        zeros = lambda width, dtype=weight.dtype: torch.zeros(rows, width, dtype=dtype, device=dev)
        self.tokens, self.positions = zeros(1, torch.int64)[:, 0], zeros(1, torch.int64)[:, 0]
        self.residual, self.final = zeros(hidden), zeros(hidden)
        kinds = {layer.layer_type: layer.mixer.widths for layer in self.layers}
        self.projected = {kind: zeros(w_in) for kind, (w_in, _) in kinds.items()}  # mixer_in's output, per kind
        self.mixed = {kind: zeros(w_out) for kind, (_, w_out) in kinds.items()}  # the core's output, per kind
        # attention's static inputs: RoPE, KV slots (-1: not written), page tables, key counts, the split count
        self.cos, self.sin = zeros(self.config.rotary_dim // 2, torch.float32), zeros(self.config.rotary_dim // 2,
                                                                                      torch.float32)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(max_seqs, max_pages, dtype=torch.int32, device=dev)
        self.seqused_k = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.kv_splits = torch.ones(1, dtype=torch.int32, device=dev)
        self.variants = (1, max_seqs) if max_seqs > 1 else (1,)  # one sequence, or up to max_seqs
        self.batch = None
        self.segments: dict[tuple[int, int], list] = {}  # (rows, seqs) -> its segments, set by capture
        self.grids: dict[tuple[int, int], CapturedGrid] = {}  # (rows, seqs) -> its attention launch
        self.graphs: dict[tuple[int, int], list] = {}  # (rows, seqs) -> its segments' CUDA graphs, in order
        self.pools: CachePools | None = None

    def covers(self, step: StepInput) -> bool:
        return (bool(self.graphs) and GEMV_MAX_ROWS < step.num_tokens <= self.buckets[-1]
                and step.num_seqs <= self.max_seqs and step.page_table.shape[1] <= self.max_pages
                and step.position_slots is None  # a verify step keeps per-token GDN states: eager
                and (self.batch is None or step.cu_seqlens_host is not None))

    def _captured(self, rows: int, seqs: int) -> list[bool]:
        """Which layers' cores the (rows, seqs) graphs hold: the GDN cores on the Triton op (the reference plans on
        the host), the attention cores where the router's choice for the captured step captures."""
        gdn = ops.backend_table()["gated_deltanet"] == "triton"
        step, d = self._device_steps(rows, seqs)["full_attention"], self.config.head_dim
        q = self.residual.new_empty(1, self.config.num_attention_heads, d).expand(rows, -1, -1)  # (rows, H, D)
        k_pages, v_pages = self.pools.k_pages[0], self.pools.v_pages[0]
        attention = registry.chosen("paged_attention", q, k_pages, v_pages, step, d ** -0.5, q).captures
        return [attention if layer.layer_type == "full_attention" else gdn for layer in self.layers]

    def _device_steps(self, rows: int, seqs: int) -> dict[str, StepInput]:
        """The steps the captured cores of a (rows, seqs) graph see, by layer type: the GDN cores the device batch
        and its plan (all max_seqs sequences), the attention cores the static buffers and the batch's first seqs."""
        from kernels.gdn_prefill import hold_plan
        b = self.batch
        gdn = StepInput(token_ids=self.tokens[:rows], positions=self.positions[:rows], cu_seqlens=b.cu_seqlens,
                        max_seqlen_q=rows, seqused_k=self.seqused_k, page_table=self.page_table,
                        slot_mapping=self.slot_mapping[:rows], state_slots=b.state_slots,
                        snapshot_slots=b.snapshot_slots)
        hold_plan(gdn, b.plan(rows))
        attention = replace(gdn, cu_seqlens=b.cu_seqlens[:seqs + 1], seqused_k=self.seqused_k[:seqs],
                            page_table=self.page_table[:seqs], cos=self.cos[:rows], sin=self.sin[:rows],
                            # before _plan sizes the grids, the key is only routed (_captured): any grid will do
                            kv_splits=self.grids.get((rows, seqs), CapturedGrid(1, self.kv_splits)), plans={})
        return {"linear_attention": gdn, "full_attention": attention}

    def _stretch(self, i: int, rows: int) -> None:
        """Row-wise stretch i over the first `rows` rows of the static buffers."""
        residual = self.residual[:rows]
        if i == 0:
            if self.grids:  # captured attention cores read the static RoPE
                cos, sin = R.rope_cos_sin(self.positions[:rows], self.config.rotary_dim, self.config.rope_theta)
                self.cos[:rows].copy_(cos)
                self.sin[:rows].copy_(sin)
            residual.copy_(self.model.embed(self.tokens[:rows]))
            x, res = residual, None  # layer 0 norms the embedding, which is the residual
        else:
            prev = self.layers[i - 1]
            x, res = prev.mixer_out(self.mixed[prev.layer_type][:rows], residual)
        if i == len(self.layers):
            norm = self.model.model.norm
            h, res = ops.add_rms_norm(x, res, norm.weight, norm.eps)
            self.final[:rows].copy_(h)
        else:
            layer = self.layers[i]
            projected, res = layer.mixer_in(x, res)
            self.projected[layer.layer_type][:rows].copy_(projected)
        if res.data_ptr() != residual.data_ptr():  # the fused add writes in place; any other op gets copied
            residual.copy_(res)

    def _core(self, i: int, rows: int, step: StepInput, pools: CachePools) -> None:
        """Layer i's mixer core over the first `rows` rows of the static buffers (step: the real step, or the
        captured step over the static buffers)."""
        kind = self.layers[i].layer_type
        o = self.layers[i].mixer.core(self.projected[kind][:rows], step, *self.model.layer_caches(i, pools))
        self.mixed[kind][:rows].copy_(o)

    def _segment(self, key: tuple[int, int], k: int) -> None:
        """Segment k of the key's graphs: its stretches and the cores between them (and after the last one, where
        the segment ends at a slice cut)."""
        rows, seqs = key
        first, last, core_last = self.segments[key][k]
        steps = self._device_steps(rows, seqs) if last > first or core_last else None
        if k == 0 and self.batch is not None:
            self.batch.build(rows)
        for i in range(first, last + 1):
            self._stretch(i, rows)
            if i < last or core_last:
                self._core(i, rows, steps[self.layers[i].layer_type], self.pools)

    def _plan(self, pools: CachePools) -> None:
        """Each key's segments and attention splits (what the router takes at the captured steps)."""
        self.pools, self.grids = pools, {}
        keys = [(rows, seqs) for rows in reversed(self.buckets) for seqs in self.variants]
        captured = {}
        if ops.get_backend() == "triton":  # Triton's kernels: imported only where they run (no Triton on a CPU)
            from kernels.varlen import DeviceBatch
            self.batch = DeviceBatch(self.max_seqs, self.buckets[-1], self.tokens.device)
            captured = {key: self._captured(*key) for key in keys}
        if not any(any(c) for c in captured.values()):
            self.batch, captured = None, {key: [False] * len(self.layers) for key in keys}
        self.segments = {key: _segments(captured[key], self.cuts) for key in keys}
        attention = [i for i, layer in enumerate(self.layers) if layer.layer_type == "full_attention"]
        keys = [key for key in keys if attention and captured[key][attention[0]]]
        if keys:
            from kernels.paged_decode_attention import captured_splits, captured_work_grid
            heads, k_pages = self.config.num_attention_heads, pools.k_pages[0]
            lows = dict(zip(self.buckets, (GEMV_MAX_ROWS, *self.buckets)))  # each bucket's steps: (low, rows] tokens
            for rows, seqs in keys:
                tokens, grid = range(lows[rows] + 1, rows + 1), (heads, k_pages, self.max_pages, k_pages.device)
                if seqs == 1:
                    self.grids[rows, seqs] = CapturedGrid(captured_splits(1, tokens, *grid), self.kv_splits)
                else:
                    splits, *programs = captured_work_grid(seqs, tokens, *grid)
                    self.grids[rows, seqs] = CapturedGrid(splits, self.kv_splits, tuple(programs))

    @torch.no_grad()
    def capture(self, pools: CachePools, eager: bool = False) -> None:
        """Capture every segment of every key (largest rows first, one memory pool, so the device plans' workspaces
        are sized once), after running each eagerly on a side stream so that Triton compiles and cuBLAS picks its
        kernels outside the capture (the device batch is empty then: its cores compute nothing). eager: record the
        segments to run eagerly instead (any device; the CPU tests of the segments and their buffers)."""
        self._plan(pools)
        keys = list(self.segments)
        if eager:
            self.graphs = {key: [_EagerSegment(self, key, k) for k in range(len(self.segments[key]))] for key in keys}
            return
        dev = self.tokens.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for key in keys:
                for k in range(len(self.segments[key])):
                    self._segment(key, k)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        pool = None
        for key in keys:
            graphs = []
            for k in range(len(self.segments[key])):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(key, k)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[key] = graphs
        torch.cuda.synchronize(dev)

    def _fill(self, step: StepInput, key: tuple[int, int]) -> None:
        """Copy the step's batch into the static buffers the key's captured cores read."""
        n, b = step.num_tokens, step.num_seqs
        self.tokens[:n].copy_(step.token_ids)
        if self.batch is None:
            return
        self.batch.fill(step.cu_seqlens_host, step.state_slots, step.snapshot_offsets, step.snapshot_slots)
        if key not in self.grids:
            return
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[n:key[0]].fill_(-1)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.page_table[:b, :step.page_table.shape[1]].copy_(step.page_table)
        self.seqused_k[:b].copy_(step.seqused_k)
        from kernels.paged_decode_attention import step_splits, work_items
        k_pages, heads, grid = self.pools.k_pages[0], self.config.num_attention_heads, self.grids[key]
        used = min(grid.splits, step_splits(b, step.max_seqlen_q, heads, k_pages,
                                            step.max_seqlen_k or self.max_pages * k_pages.shape[1], k_pages.device))
        if grid.programs is not None:  # a work list: the step's items x splits within its programs
            cu = step.cu_seqlens_host
            items = work_items([e - s for s, e in zip(cu, cu[1:])], heads // k_pages.shape[2], k_pages.shape[3],
                               k_pages.element_size(), key[0])
            used = min(used, *(p // max(i, 1) for p, i in zip(grid.programs, items)))
        self.kv_splits.fill_(used)

    @torch.no_grad()
    def forward_step_layers(self, step: StepInput, pools: CachePools, *, with_hidden: bool = False,
                            logit_rows: torch.Tensor | None = None):
        """model.forward_step_layers (not all_logits) with the segments replayed: None after each layer's core,
        then the logits of each sequence's last token (B, vocab), or of logit_rows (R,); with_hidden: (logits, every
        token's hidden state after the final norm (N, hidden), a copy: the buffer is the next step's)."""
        n = step.num_tokens
        key = (row_bucket(n), 1 if step.num_seqs == 1 else self.max_seqs)
        segments, layers = self.segments[key], len(self.layers)
        if any(last < layers and not core_last for _, last, core_last in segments):  # eager cores read its RoPE
            self.model.prepare_rope(step)
        self._fill(step, key)
        for graph, (first, last, core_last) in zip(self.graphs[key], segments):
            graph.replay()
            yield from (None for _ in range(first, last + core_last))
            if last < layers and not core_last:
                self._core(last, n, step, pools)
                yield None
        h = self.final[:n]
        logits = self.model.logits(h[logit_rows if logit_rows is not None else step.last_token_indices])
        yield (logits, h.clone()) if with_hidden else logits


def _segments(captured: list[bool], cuts: frozenset[int]) -> list[tuple[int, int, bool]]:
    """(first stretch, last stretch, whether core `last` ends the segment) of each graph: a segment ends before an
    eager core (captured[i] False), after a captured core at a slice cut (the mixed step's decodes run before layer
    i in cuts), and at the final norm (stretch L)."""
    segments, first = [], 0
    for i, in_graph in enumerate(captured):
        if not in_graph:
            segments.append((first, i, False))
            first = i + 1
        elif i + 1 in cuts:
            segments.append((first, i, True))
            first = i + 1
    return segments + [(first, len(captured), False)]


class _EagerSegment:
    """A segment that `replay` runs eagerly (PrefillGraphs.capture(eager=True))."""

    def __init__(self, graphs: PrefillGraphs, key: tuple[int, int], k: int):
        self.graphs, self.key, self.k = graphs, key, k

    def replay(self) -> None:
        self.graphs._segment(self.key, self.k)
