"""CUDA graphs for prefill steps: everything but the attention cores is replayed.

A returning agent turn (a few hundred new tokens over a long cached context) is one eager step of ~330 launches,
and on the H200 its host side (~30 ms for 2B) is two to three times its GPU time: the step is launch-bound. Most
of those launches depend only on the step's token count: the row-wise ops (projections, norms, the MLP), and the
Gated DeltaNet cores once their batch layout is planned on the device (kernels.varlen.DeviceBatch: the step's
cu_seqlens, slots and snapshot points are copied into static buffers, and a kernel inside the graph lays out the
piece tables that the host would have built). The attention cores read the step's page table and context
lengths, which size their grids, so they run eagerly between the replays.

Stretch i (0 <= i <= L, for L layers) ends where layer i's mixer core begins:
    stretch 0:      embed(tokens) -> layer 0's mixer_in
    stretch i:      layer i-1's mixer_out (its out projection and MLP) -> layer i's mixer_in
    stretch L:      layer L-1's mixer_out -> the final norm
A segment is a run of stretches joined by the cores captured with them (the GDN cores); each segment is one
graph, and an eager attention core follows a segment that ends at one. A segment also ends after a GDN core where
a mixed step's prefill slice ends (`cuts`, EngineConfig.slice_cuts), so that its decode step waits for no more
prefill work than the slice's. For Qwen3.5's pattern (three GDN layers, then an attention layer) without cuts a
step is L/4 + 1 replays and L/4 eager cores, then lm_head on the sequences' last rows (eager: B rows).
The graphs read and write static buffers: the tokens, the residual stream (updated in place by the fused add +
norm), each mixer kind's projected input and core output, and the final norm's output. Captured
for every row bucket up to `max_tokens` (kernels.row_buckets): an eager step of N rows runs its projections on
exactly its bucket's rows, so a replayed step computes the very same products as the eager one. Rows past N hold
what an earlier step left there; every op on them is row-wise (the cores' piece tables end at the step's last
token), so they never reach a real row. Steps of at most GEMV_MAX_ROWS tokens (the GEMV's) and above max_tokens
run eagerly.

Not under tensor parallelism (the stretches hold the all-reduces) or the reference MoE (its routing syncs with the
host); the reference GDN's cores run eagerly.
"""
import torch

from kernels.row_buckets import GEMV_MAX_ROWS, MATMUL_ROW_BUCKET, row_bucket, row_buckets_up_to
from model import ops
from model.cache import CachePools
from model.model import Qwen35ForCausalLM
from model.step import StepInput


def prefill_graphs_unsupported(model: Qwen35ForCausalLM) -> str | None:
    """Why this model's prefill stretches cannot be captured, or None."""
    if model.config.is_moe and ops.backend_table()["moe"] == "reference":
        return "the reference MoE's expert loop syncs with the host; use the triton backend"
    if model.plan.sharded:
        return "tensor-parallel stretches hold collectives"
    return None


class PrefillGraphs:
    """The prefill graphs of a model for steps of up to max_tokens tokens and max_seqs sequences."""

    def __init__(self, model: Qwen35ForCausalLM, max_tokens: int, max_seqs: int, cuts: frozenset[int] = frozenset()):
        if max_tokens < MATMUL_ROW_BUCKET:
            raise ValueError(f"max_tokens must be at least {MATMUL_ROW_BUCKET}, got {max_tokens}")
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {max_seqs}")
        self.model = model
        self.layers = model.model.layers
        self.buckets = row_buckets_up_to(max_tokens)
        weight = model.lm_head.weight
        rows, hidden = self.buckets[-1], model.config.hidden_size
        zeros = lambda width, dtype=weight.dtype: torch.zeros(rows, width, dtype=dtype, device=weight.device)
        self.tokens = zeros(1, torch.int64)[:, 0]
        self.residual, self.final = zeros(hidden), zeros(hidden)
        kinds = {layer.layer_type: layer.mixer.widths for layer in self.layers}
        self.projected = {kind: zeros(w_in) for kind, (w_in, _) in kinds.items()}  # mixer_in's output, per kind
        self.mixed = {kind: zeros(w_out) for kind, (_, w_out) in kinds.items()}  # the core's output, per kind
        # the GDN cores join the graphs where their op is the Triton one (the reference plans on the host)
        gdn_in_graphs = ops.backend_table()["gated_deltanet"] == "triton"
        captured = [gdn_in_graphs and layer.layer_type == "linear_attention" for layer in self.layers]
        self.segments = _segments(captured, cuts)
        self.batch = None
        if any(captured):  # Triton's kernels: imported only where they run (a CPU install has no Triton)
            from kernels.varlen import DeviceBatch
            self.batch = DeviceBatch(max_seqs, rows, weight.device)
        self.max_seqs = max_seqs
        self.graphs: dict[int, list] = {}  # rows -> its segments' CUDA graphs, in order
        self.pools: CachePools | None = None

    def covers(self, step: StepInput) -> bool:
        return (bool(self.graphs) and GEMV_MAX_ROWS < step.num_tokens <= self.buckets[-1]
                and step.num_seqs <= self.max_seqs and (self.batch is None or step.cu_seqlens_host is not None))

    def _stretch(self, i: int, rows: int) -> None:
        """Row-wise stretch i over the first `rows` rows of the static buffers."""
        residual = self.residual[:rows]
        if i == 0:
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
        captured step over the device batch)."""
        kind = self.layers[i].layer_type
        o = self.layers[i].mixer.core(self.projected[kind][:rows], step, *self.model.layer_caches(i, pools))
        self.mixed[kind][:rows].copy_(o)

    def _device_step(self, rows: int) -> StepInput:
        """The step the captured GDN cores of a `rows`-token graph see: the device batch's tensors and its plan."""
        from kernels.gdn_prefill import hold_plan
        b, dev = self.batch, self.tokens.device
        unused = torch.zeros(1, dtype=torch.int32, device=dev)  # what GDN cores never read (pages, positions)
        step = StepInput(token_ids=self.tokens[:rows], positions=self.tokens[:rows], cu_seqlens=b.cu_seqlens,
                         max_seqlen_q=rows, seqused_k=unused, page_table=unused.view(1, 1), slot_mapping=unused,
                         state_slots=b.state_slots, snapshot_slots=b.snapshot_slots)
        hold_plan(step, b.plan(rows))
        return step

    def _segment(self, k: int, rows: int) -> None:
        """Segment k at `rows` rows: its stretches and the GDN cores between them (and after the last one, where
        the segment ends at a slice cut)."""
        first, last, core_last = self.segments[k]
        step = self._device_step(rows) if last > first or core_last else None
        if k == 0 and self.batch is not None:
            self.batch.build(rows)
        for i in range(first, last + 1):
            self._stretch(i, rows)
            if i < last or core_last:
                self._core(i, rows, step, self.pools)

    @torch.no_grad()
    def capture(self, pools: CachePools, eager: bool = False) -> None:
        """Capture every segment at every bucket (largest first, one memory pool, so the device plans' workspaces
        are sized once), after running each eagerly on a side stream so that Triton compiles and cuBLAS picks its
        kernels outside the capture (the device batch is empty then: its cores compute nothing). eager: record the
        segments to run eagerly instead (any device; the CPU tests of the segments and their buffers)."""
        self.pools = pools
        order = tuple(reversed(self.buckets))
        if eager:
            self.graphs = {rows: [_EagerSegment(self, k, rows) for k in range(len(self.segments))] for rows in order}
            return
        dev = self.tokens.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for rows in order:
                for k in range(len(self.segments)):
                    self._segment(k, rows)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        pool = None
        for rows in order:
            graphs = []
            for k in range(len(self.segments)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(k, rows)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[rows] = graphs
        torch.cuda.synchronize(dev)

    def forward_step_layers(self, step: StepInput, pools: CachePools):
        """model.forward_step_layers (not all_logits) with the segments replayed: None after each layer's core,
        then the logits of each sequence's last token (B, vocab)."""
        n = step.num_tokens
        rows = row_bucket(n)
        graphs = self.graphs[rows]
        self.model.prepare_rope(step)
        self.tokens[:n].copy_(step.token_ids)
        if self.batch is not None:
            self.batch.fill(step.cu_seqlens_host, step.state_slots, step.snapshot_offsets, step.snapshot_slots)
        for graph, (first, last, core_last) in zip(graphs, self.segments):
            graph.replay()
            yield from (None for _ in range(first, last + core_last))
            if last < len(self.layers) and not core_last:
                self._core(last, n, step, pools)
                yield None
        yield self.model.lm_head(self.final[:n][step.last_token_indices])


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

    def __init__(self, graphs: PrefillGraphs, k: int, rows: int):
        self.graphs, self.k, self.rows = graphs, k, rows

    def replay(self) -> None:
        self.graphs._segment(self.k, self.rows)
