"""CUDA graphs for prefill steps, piecewise: the row-wise stretches between the mixer cores are replayed.

A returning agent turn (a few hundred new tokens over a long cached context) is one eager step of ~330 launches,
and on the H200 its host side (~30 ms for 2B) is two to three times its GPU time: the step is launch-bound. Most
of those launches are row-wise: each token's row goes through the projections, norms and the MLP on its own. Such
a stretch depends only on the step's token count, so it can be captured once per count and replayed. The mixer
cores (attention over the paged KV, the Gated DeltaNet's conv and chunked delta rule) read the step's sequences
and caches, so they keep running eagerly between the replays.

Stretch i (0 <= i <= L, for L layers) ends where layer i's mixer core begins:
    stretch 0:      embed(tokens) -> layer 0's mixer_in
    stretch i:      layer i-1's mixer_out (its out projection and MLP) -> layer i's mixer_in
    stretch L:      layer L-1's mixer_out -> the final norm
and a step runs: stretch 0, core 0, stretch 1, core 1, ..., core L-1, stretch L, then lm_head on the sequences'
last rows (eager: B rows). The stretches read and write static buffers: the tokens, the residual stream (updated
in place by the fused add + norm), each mixer kind's projected input and core output, and the final norm's
output. Captured for every row count that is a multiple of kernels.row_buckets.MATMUL_ROW_BUCKET up to
`max_tokens`: an eager step of N rows runs its projections on exactly that bucket's rows (kernels.row_buckets), so
a replayed step computes the very same products as the eager one, bit for bit. Rows past N hold what an earlier
step left there; every op in a stretch is row-wise, so they never reach a real row. Steps of at most
GEMV_MAX_ROWS tokens (the GEMV's) and above max_tokens run eagerly.

Not under tensor parallelism (the stretches hold the all-reduces) or MoE (its routing syncs with the host).
"""
import torch

from kernels.row_buckets import GEMV_MAX_ROWS, MATMUL_ROW_BUCKET
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
    def __init__(self, model: Qwen35ForCausalLM, max_tokens: int):
        if max_tokens < MATMUL_ROW_BUCKET:
            raise ValueError(f"max_tokens must be at least {MATMUL_ROW_BUCKET}, got {max_tokens}")
        self.model = model
        self.layers = model.model.layers
        self.buckets = tuple(range(MATMUL_ROW_BUCKET, max_tokens + 1, MATMUL_ROW_BUCKET))
        weight = model.lm_head.weight
        rows, hidden = self.buckets[-1], model.config.hidden_size
        zeros = lambda width, dtype=weight.dtype: torch.zeros(rows, width, dtype=dtype, device=weight.device)
        self.tokens = zeros(1, torch.int64)[:, 0]
        self.residual, self.final = zeros(hidden), zeros(hidden)
        kinds = {layer.layer_type: layer.mixer.widths for layer in self.layers}
        self.projected = {kind: zeros(w_in) for kind, (w_in, _) in kinds.items()}  # mixer_in's output, per kind
        self.mixed = {kind: zeros(w_out) for kind, (_, w_out) in kinds.items()}  # the core's output, per kind
        self.graphs: dict[int, list] = {}  # rows -> its stretches' CUDA graphs, in order

    def covers(self, step: StepInput) -> bool:
        return bool(self.graphs) and GEMV_MAX_ROWS < step.num_tokens <= self.buckets[-1]

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

    @torch.no_grad()
    def capture(self, eager: bool = False) -> None:
        """Capture every stretch at every bucket (largest first, one memory pool), after running each eagerly on a
        side stream so that Triton compiles and cuBLAS picks its kernels outside the capture. eager: record the
        stretches to run eagerly instead (any device; the CPU tests of the stretches and their buffers)."""
        if eager:
            self.graphs = {rows: [_EagerStretch(self, i, rows) for i in range(len(self.layers) + 1)]
                           for rows in self.buckets}
            return
        dev = self.tokens.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for rows in self.buckets:
                for i in range(len(self.layers) + 1):
                    self._stretch(i, rows)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        pool = None
        for rows in reversed(self.buckets):
            graphs = []
            for i in range(len(self.layers) + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._stretch(i, rows)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[rows] = graphs
        torch.cuda.synchronize(dev)

    def forward_step_layers(self, step: StepInput, pools: CachePools):
        """model.forward_step_layers (not all_logits) with the stretches replayed: None after each layer's core,
        then the logits of each sequence's last token (B, vocab)."""
        n = step.num_tokens
        graphs = self.graphs[-(-n // MATMUL_ROW_BUCKET) * MATMUL_ROW_BUCKET]
        self.model.prepare_rope(step)
        self.tokens[:n].copy_(step.token_ids)
        for i, layer in enumerate(self.layers):
            graphs[i].replay()
            o = layer.mixer.core(self.projected[layer.layer_type][:n], step, *self.model.layer_caches(i, pools))
            self.mixed[layer.layer_type][:n].copy_(o)
            yield None
        graphs[-1].replay()
        yield self.model.lm_head(self.final[:n][step.last_token_indices])


class _EagerStretch:
    """A stretch that `replay` runs eagerly (PrefillGraphs.capture(eager=True))."""

    def __init__(self, graphs: PrefillGraphs, i: int, rows: int):
        self.graphs, self.i, self.rows = graphs, i, rows

    def replay(self) -> None:
        self.graphs._stretch(self.i, self.rows)
