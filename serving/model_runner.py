"""ModelRunner: the engine's chunks in, logits out, over Qwen35ForCausalLM.forward_step.

Two paths.
- Eager: any mix of prefill chunks and decodes, flattened by serving.batch.build_step_input (host lists), with
  the page tables of the persistent slot table below.
- Decode (every sequence brings one token): static-shape inputs, replayed from a CUDA graph on CUDA devices.
  The host writes five int32 rows for the batch into one pinned buffer (DECODE_INPUT_ROWS: token, position,
  state slot, KV slot = pages[pos // page_size] * page_size + pos % page_size, seqused_k = pos + 1), and one
  non-blocking copy moves them; a decode launched ahead (EngineConfig.decode_ahead) then overwrites the token row
  on the device with the last step's samples, which the host has not read. With EngineConfig.fed_decode the greedy
  argmax at the end of each decode step writes the next step's rows itself (reference.advance_decode_inputs), and
  a step launched ahead whose rows are exactly those (the same sequences one position on, every token the greedy
  one, the next page already in the table) copies nothing before its graph. The rest is gathered on the device
  inside the graph (three launches; deriving the KV slots and seqused_k there took eight more small ones a step):
    page_table   = table[state_slots]                       (B, W) int32, W = ceil(max_model_len / page_size)
    cu_seqlens = arange(B + 1);  cos, sin = rope tables at pos
  `table` is a persistent device page table with one row per GDN state slot: a running sequence owns its slot,
  so its row is its page list. Rows are synced lazily: the runner remembers, per slot, which pages list object
  it copied and how far; a sequence that was released and readmitted gets a new list (block_manager.free and
  share_prefix replace it), which forces a full rewrite; pages appended in place are copied as a tail.
  Batch sizes come from a ladder (EngineConfig.graph_batch_sizes); a batch of B is padded to the next captured
  size with rows that point at a dummy KV page and a dummy GDN slot, which the block manager and the scheduler
  never hand out, so padding never touches real state (the dummy slot's state is zeroed once, before capture,
  and stays finite; batch 1 is never padded). Because the page table always has width W, the paged
  decode kernel's split count (chosen from W * page_size) is fixed per captured shape, and eager decode steps use
  the very same inputs: with and without graphs a batch-1 decode runs the same kernels on the same shapes.
- Mixed steps with graphs: the decode rows replay their graph and the other chunks run eagerly; rows come back
  in that order (execute returns the chunks in row order).
- Prefill graphs (serving.prefill_graphs): an eager step of 5..EngineConfig.prefill_graph_tokens tokens replays
  CUDA graphs of its layers (projections, norms, MLPs, the GDN and split-KV attention cores planned on the device);
  only attention cores that the router sends to a forward run eagerly between them.

Graphs need the decode ops free of host syncs: the "triton" ops backend (kernels/paged_decode_attention.py,
kernels/gdn_decode.py, norms, attention_prep) is; the reference ops and MoE routing (its .tolist()) are not, so
graphs are switched off, with a log line, when the backend or the model is not capturable.

Tensor parallel (serving.tp_link): on rank 0 `link` sends each step's host inputs (page-table updates, the decode
rows, or an eager step's flat lists) to the workers before the step runs; a worker's runner runs the very same
`write_table`, `decode_values` and `eager_lists` on them, so every rank replays the same graphs (collectives
inside) on the same inputs. At world size 1 link is None and nothing is sent.
"""
import logging

import torch

import reference as R
from kernels.row_buckets import decode_step_rows
from model import ops
from model.cache import CachePools
from model.model import Qwen35ForCausalLM
from model.step import StepInput
from serving.batch import ScheduledChunk, StepLists, flatten_chunks, step_from_lists
from serving.prefill_graphs import PrefillGraphs
from serving.token_ring import GreedyTokens, TokenRing

log = logging.getLogger("serving")

# A decode step computes its logits' argmax inside its CUDA graph (kernels.argmax), so a greedy step's sampler
# launches nothing. Padded rows decode token 0 from the dummy slot, whose state stays bounded (the delta rule's decay
# <= 1 along normed keys) without zeroing it; the warm-up before capture zeroes it once.
# must not be the reference ops in a graph (they check on the host)
GRAPH_OPS = ("paged_attention", "gated_deltanet", "attention_prep", "gather_rows")


def graphs_unsupported(model: Qwen35ForCausalLM) -> str | None:
    """Why decode steps of this model cannot be captured with the active ops backend, or None."""
    table = ops.backend_table()
    ref = [op for op in GRAPH_OPS + (("moe",) if model.config.is_moe else ()) if table[op] == "reference"]
    if ref:
        return f"ops {ref} run the reference backend (host syncs); use the triton backend"
    return None


DECODE_INPUT_ROWS = 5  # a decode step's host-built rows: token, position, state slot, KV slot, cached tokens


class ModelRunner:
    def __init__(self, model: Qwen35ForCausalLM, pools: CachePools, *, page_size: int, max_model_len: int,
                 max_num_seqs: int, dummy_page: int, dummy_slot: int, graph_sizes: tuple[int, ...] = (),
                 use_graphs: bool = False, link=None, prefill_graphs: PrefillGraphs | None = None,
                 fed_decode: bool = False, token_ring: bool = False):
        """graph_sizes: the ladder decode batches are padded to (empty: no padding); use_graphs: capture them
        (CUDA only). Padding without graphs runs the same shapes eagerly (tests of the padding on the CPU).
        prefill_graphs: the row-wise stretches of eager steps, captured by capture() (serving.prefill_graphs).
        fed_decode: EngineConfig.fed_decode (world size 1 only); token_ring: EngineConfig.token_ring (fed only)."""
        self.model, self.pools, self.page_size = model, pools, page_size
        self.link = link  # rank 0's serving.tp_link.StepBroadcaster under tensor parallelism, else None
        self.cfg = model.config
        self.device = model.lm_head.weight.device
        self.dummy_page, self.dummy_slot = dummy_page, dummy_slot
        # the DECODE_INPUT_ROWS values of a padding row: token 0 at position 0 of the dummy slot and dummy page
        self.padding_row = (0, 0, dummy_slot, dummy_page * page_size, 1)
        self.width = -(-max_model_len // page_size)  # pages per sequence in decode page tables
        self.graph_sizes = tuple(sorted(graph_sizes))
        self.use_graphs = use_graphs and self.device.type == "cuda" and bool(graph_sizes)
        self.max_decode = max(max_num_seqs, *self.graph_sizes) if self.graph_sizes else max_num_seqs
        cuda = self.device.type == "cuda"
        dev = self.device
        self.table = torch.full((pools.num_slots, self.width), dummy_page, dtype=torch.int32, device=dev)
        self._synced: list[tuple[list[int], int] | None] = [None] * pools.num_slots
        # a batch of bs reads inputs[:ROWS * bs] as (DECODE_INPUT_ROWS, bs) int32 rows: token, position, state
        # slot, KV slot (slot_mapping) and cached tokens (seqused_k), all from the host, so the graph computes none
        # of them (contiguous: one plain copy from the pinned host buffer fills it; each captured size has its own
        # fixed view)
        self.inputs = torch.zeros(DECODE_INPUT_ROWS * self.max_decode, dtype=torch.int32, device=dev)
        self._host = torch.zeros(DECODE_INPUT_ROWS * self.max_decode, dtype=torch.int32, pin_memory=cuda)
        self._upd = torch.zeros(0, dtype=torch.int64)  # page-table updates (3, k) flat: row, column, page
        self._events: dict[int, torch.cuda.Event] = {}  # staging buffer -> the event after its last copy
        self.cu_seqlens = torch.arange(self.max_decode + 1, dtype=torch.int32, device=dev)
        self.rope = None  # (cos, sin) tables over positions on CUDA; the CPU computes them per step
        if cuda:
            pos = torch.arange(max_model_len, device=dev)
            self.rope = R.rope_cos_sin(pos, self.cfg.rotary_dim, self.cfg.rope_theta)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.prefill_graphs = prefill_graphs
        self.fed_decode = fed_decode and model.tp.world_size == 1  # workers have no link either
        # where a fed decode's argmax also leaves its tokens in host memory (serving.token_ring)
        self.token_ring = TokenRing(self.max_decode, dev) if self.fed_decode and token_ring else None
        self._moved_on: tuple | None = None  # (bs, n, inputs past the first n tokens) the last decode's argmax left
        self._last_greedy: torch.Tensor | None = None  # the last decode step's greedy tokens (bs,)
        self.num_graph_steps = self.num_eager_decode_steps = self.num_eager_steps = self.num_graph_prefill_steps = 0
        self.num_fed_steps = 0

    # ---- the engine's entry point ------------------------------------------------------------------------

    @torch.no_grad()
    def execute(self, chunks: list[ScheduledChunk], device_tokens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, GreedyTokens | None, list[ScheduledChunk]]:
        """Run one step. Returns logits (len(chunks), vocab), one row per chunk's last token, their argmax (the
        greedy tokens (len(chunks),) int64 of a decode step that computed them, and where they land on the host;
        else None) and the chunks in the order of those rows. device_tokens: a decode step launched ahead
        (decode_rows)."""
        decode = [c for c in chunks if c.num_tokens == 1]
        if device_tokens is not None:
            if len(decode) != len(chunks):
                raise ValueError("device_tokens is for decode steps: every chunk must be one token")
            return *self.decode_rows(chunks, device_tokens), chunks
        if len(decode) == len(chunks) and len(chunks) <= self.max_decode:
            return *self.decode_rows(chunks), chunks
        if self.graph_sizes and decode and len(decode) <= self.max_decode:
            rest = [c for c in chunks if c.num_tokens != 1]
            # the sampler's one argmax over every row, not the graph's for the decode rows and another for the rest
            return torch.cat([self.decode_rows(decode)[0], self._eager(rest)]), None, decode + rest
        return self._eager(chunks), None, chunks

    def _eager(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Any chunks, eagerly, over the same width-W page tables as decode steps (so attention kernels that pick
        their split count from the table's capacity do the same with and without graphs)."""
        lists = self._eager_inputs(chunks)
        if self.link is not None:
            self.link.send("eager", lists)
        return self.eager_lists(lists)

    def _eager_inputs(self, chunks: list[ScheduledChunk]) -> StepLists:
        self.sync_page_tables([c.seq for c in chunks])
        return flatten_chunks(chunks, self.page_size)

    def eager_lists(self, lists: StepLists) -> torch.Tensor:
        *_, logits = self.step_layers(self._eager_step(lists))
        return logits

    def eager_layers(self, chunks: list[ScheduledChunk]):
        """_eager as a generator (model.forward_step_layers): None after each layer's launches, then the logits,
        one row per chunk. World size 1 only (workers replay whole steps)."""
        if self.link is not None:
            raise ValueError("a prefill in slices is not broadcast to tensor-parallel workers")
        return self.step_layers(self._eager_step(self._eager_inputs(chunks)))

    def _eager_step(self, lists: StepLists) -> StepInput:
        self.num_eager_steps += 1
        return step_from_lists(lists, self.device, slot_page_table=self.table)

    def step_layers(self, step: StepInput, **outputs):
        """The step's layers from the prefill graphs when they cover it, else eagerly (forward_step_layers;
        outputs: its with_hidden and logit_rows)."""
        if self.prefill_graphs is not None and self.prefill_graphs.covers(step):
            self.num_graph_prefill_steps += 1
            return self.prefill_graphs.forward_step_layers(step, self.pools, **outputs)
        return self.model.forward_step_layers(step, self.pools, **outputs)

    # ---- decode steps ------------------------------------------------------------------------------------

    def padded_size(self, n: int) -> int:
        """The batch a decode of n sequences runs at: the smallest ladder size >= n, else n."""
        for b in self.graph_sizes:
            if b >= n:
                return b
        return n

    def decode_rows(self, rows: list[ScheduledChunk],
                    device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, GreedyTokens | None]:
        """One token of each row (a decode step, from its CUDA graph when captured): logits (len(rows), vocab)
        and their argmax (len(rows),) int64 with where it lands on the host.
        device_tokens: (len(rows),) the rows' input tokens on the device (a decode launched ahead: the step before
        sampled them and the host has not read them); else the sequences' own tokens."""
        n = len(rows)
        bs = self.padded_size(n)
        if device_tokens is not None and (self.link is not None or device_tokens.shape != (n,)):
            raise ValueError(f"device_tokens must be ({n},) at world size 1, got {tuple(device_tokens.shape)}")
        self.sync_page_tables([c.seq for c in rows])
        tokens, positions, slots, kv_slots = [], [], [], []
        for c in rows:
            seq, p = c.seq, c.start
            n_prompt = len(seq.prompt_ids)
            if device_tokens is None:
                tokens.append(seq.prompt_ids[p] if p < n_prompt else seq.output_ids[p - n_prompt])
            else:
                tokens.append(0)  # overwritten on the device
            positions.append(p)
            slots.append(seq.state_slot)
            kv_slots.append(seq.kv_slot(p, self.page_size))
        pad = bs - n
        rows_of = (tokens, positions, slots, kv_slots, [p + 1 for p in positions])
        values = [v for row, padding in zip(rows_of, self.padding_row) for v in row + [padding] * pad]
        if self.link is not None:
            self.link.send("decode", (bs, n, values))
        fed = (device_tokens is not None and self._moved_on == (bs, n, values[n:])
               and device_tokens.data_ptr() == self._last_greedy.data_ptr())
        out = self.decode_values(bs, n, values, device_tokens, fed=fed)
        self._moved_on = self._next_inputs(rows, bs, n, values) if self.fed_decode else None
        return out

    def _next_inputs(self, rows: list[ScheduledChunk], bs: int, n: int, values: list[int]) -> tuple | None:
        """(bs, n, the decode inputs past the first n tokens) that this step's argmax leaves for the next one (fed
        decode): each row one position on, its KV slot from its page list; None where a row's next page is not in
        its list (so not in the page table the argmax read)."""
        nxt = values[n:]  # value i of values is nxt[i - n]
        for r, c in enumerate(rows):
            p = values[bs + r] + 1
            if p // self.page_size >= len(c.seq.pages):
                return None
            nxt[bs + r - n], nxt[3 * bs + r - n], nxt[4 * bs + r - n] = p, c.seq.kv_slot(p, self.page_size), p + 1
        return bs, n, nxt

    def decode_values(self, bs: int, n: int, values: list[int], device_tokens: torch.Tensor | None = None,
                      fed: bool = False) -> tuple[torch.Tensor, GreedyTokens | None]:
        """The decode step of n rows padded to bs: values holds the (DECODE_INPUT_ROWS, bs) rows token, position,
        state slot, KV slot, cached tokens (padding rows: token 0 at position 0 of the dummy slot and page); the
        first n tokens come from device_tokens instead when given. fed: the inputs on the device already hold
        values and device_tokens (the last decode's argmax wrote them): nothing is copied."""
        size = DECODE_INPUT_ROWS * bs
        if fed:
            self.num_fed_steps += 1
        else:
            self._wait(self._host)
            self._host.numpy()[:size] = values
            self.inputs[:size].copy_(self._host[:size], non_blocking=True)
            if device_tokens is not None:
                self.inputs[:n].copy_(device_tokens)  # the token row comes first
            self._record(self._host)
        positions = values[bs:bs + n]
        if self.token_ring is not None:
            self.token_ring.before_launch(positions)
        graph = self.graphs.get(bs)
        if graph is not None:
            self.num_graph_steps += 1
            graph[0].replay()
            logits, greedy = graph[1]
        else:
            self.num_eager_decode_steps += 1
            logits, greedy = self._decode_forward(bs, zero_dummy=False)
        self._last_greedy = greedy
        return logits[:n], GreedyTokens(greedy[:n], self.token_ring.land(positions) if self.token_ring else None)

    def _record(self, staging: torch.Tensor) -> None:
        """Note that a non-blocking copy out of this pinned staging buffer is in flight."""
        if self.device.type == "cuda":
            event = self._events.setdefault(staging.data_ptr(), torch.cuda.Event())
            event.record()

    def _wait(self, staging: torch.Tensor) -> None:
        """Before the host rewrites a staging buffer: its last copy must have been read (free when it has)."""
        event = self._events.get(staging.data_ptr())
        if event is not None:
            event.synchronize()

    def _decode_forward(self, bs: int, zero_dummy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode step of inputs[:, :bs] (what a graph captures): logits (bs, vocab) and their argmax (bs,)
        int64."""
        tokens, positions, slots, slot_mapping, seqused_k = self.inputs[:DECODE_INPUT_ROWS * bs].view(-1, bs)
        if zero_dummy:
            self.pools.conv_states[:, self.dummy_slot].zero_()
            self.pools.recurrent_states[:, self.dummy_slot].zero_()
        # one launch gathers the page-table rows (bs, W), the RoPE rows and (unsharded) the token embeddings, right
        # before the first projection, which it lets launch early (PDL)
        tables, indices = [self.table], [slots]
        if self.rope is not None:
            tables, indices = tables + list(self.rope), indices + [positions, positions]
        if not self.model.plan.sharded:
            tables, indices = tables + [self.model.model.embed_tokens.weight], indices + [tokens]
        page_table, *rows = ops.gather_rows(tables, indices)
        embeddings = rows.pop() if not self.model.plan.sharded else None
        cos, sin = rows if rows else R.rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        step = StepInput(token_ids=tokens, positions=positions, cu_seqlens=self.cu_seqlens[:bs + 1], max_seqlen_q=1,
                         seqused_k=seqused_k, page_table=page_table, slot_mapping=slot_mapping,
                         state_slots=slots, cos=cos, sin=sin, embeddings=embeddings)
        with decode_step_rows():  # eager: the projections' kernels of the captured step
            logits = self.model.forward_step(step, self.pools, all_logits=True)
        if self.fed_decode:  # the argmax writes the next step's inputs too
            advance = R.DecodeAdvance(self.inputs[:DECODE_INPUT_ROWS * bs].view(-1, bs), self.table, self.page_size,
                                      self.dummy_slot, self.token_ring.view(bs) if self.token_ring else None)
            return logits, ops.argmax(logits, advance)
        return logits, ops.argmax(logits)

    def sync_page_tables(self, seqs) -> None:
        """Bring the device page-table rows of these sequences' state slots up to date with seq.pages."""
        rows, cols, vals = [], [], []
        for seq in seqs:
            slot, pages = seq.state_slot, seq.pages
            rec = self._synced[slot]
            start = rec[1] if rec is not None and rec[0] is pages else 0
            end = len(pages)
            if end > self.width:
                raise ValueError(f"sequence {seq.id} holds {end} pages; decode page tables have {self.width}")
            if end > start:
                rows += [slot] * (end - start)
                cols += range(start, end)
                vals += pages[start:end]
            self._synced[slot] = (pages, end)
        if not rows:
            return
        if self.link is not None:
            self.link.table(rows, cols, vals)
        self.write_table(rows, cols, vals)

    def write_table(self, rows: list[int], cols: list[int], vals: list[int]) -> None:
        """table[rows[i], cols[i]] = vals[i], through one pinned staging copy."""
        k = len(rows)
        if self._upd.numel() < 3 * k:
            self._upd = torch.zeros(max(3 * k, 2 * self._upd.numel(), 768), dtype=torch.int64,
                                    pin_memory=self.device.type == "cuda")
        self._wait(self._upd)
        self._upd.numpy()[:3 * k] = rows + cols + vals
        dev = self._upd[:3 * k].to(self.device, non_blocking=True).view(3, k)
        self._record(self._upd)
        self.table[dev[0], dev[1]] = dev[2].to(torch.int32)

    # ---- CUDA graphs -------------------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self) -> None:
        """Capture one decode graph per ladder size (largest first, sharing one memory pool), and the prefill
        graphs. Each is warmed up eagerly first, on a side stream, so Triton compiles and cuBLAS picks its kernels
        outside the capture."""
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(self.pools)
        if not self.use_graphs:
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            padding = torch.tensor(self.padding_row)[:, None]
            for bs in self.graph_sizes:  # every row a padding row
                self.inputs[:DECODE_INPUT_ROWS * bs].view(-1, bs).copy_(padding.expand(-1, bs))
                self._decode_forward(bs, zero_dummy=True)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pool = None
        for bs in sorted(self.graph_sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._decode_forward(bs, zero_dummy=False)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)


# ---- sizing the pools from memory -------------------------------------------------------------------------

def kv_page_bytes(model: Qwen35ForCausalLM, page_size: int, mtp_layers: int = 0) -> int:
    cfg, elt = model.cache_config, model.lm_head.weight.element_size()  # this rank's heads
    layers = len(cfg.full_attention_layers) + mtp_layers
    return layers * 2 * page_size * cfg.num_key_value_heads * cfg.head_dim * elt


def state_slot_bytes(model: Qwen35ForCausalLM) -> int:
    cfg, elt = model.cache_config, model.lm_head.weight.element_size()  # this rank's heads
    per_layer = (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * elt
                 + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    return len(cfg.linear_attention_layers) * per_layer


@torch.no_grad()
def profile_step_peak(model: Qwen35ForCausalLM, page_size: int, max_model_len: int, num_tokens: int) -> int:
    """Activation bytes (beyond what is allocated now) of the worst eager step: one chunk of num_tokens at the
    end of a max_model_len context, on a temporary pool. CUDA only."""
    dev = model.lm_head.weight.device
    n = max(1, min(num_tokens, max_model_len))
    pages = -(-max_model_len // page_size)
    pools = CachePools.allocate(model.cache_config, pages, page_size, 1, model.lm_head.weight.dtype, dev)
    positions = torch.arange(max_model_len - n, max_model_len, device=dev)
    step = StepInput(token_ids=torch.zeros(n, dtype=torch.int64, device=dev), positions=positions,
                     cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=dev), max_seqlen_q=n,
                     cu_seqlens_host=(0, n),
                     seqused_k=torch.tensor([max_model_len], dtype=torch.int32, device=dev),
                     page_table=torch.arange(pages, dtype=torch.int32, device=dev)[None],
                     slot_mapping=positions.clone(), state_slots=torch.zeros(1, dtype=torch.int64, device=dev))
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model.forward_step(step, pools)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del pools, step
    torch.cuda.empty_cache()
    return peak


def split_budget(budget: float, *, page_bytes: int, slot_bytes: int, state_cache_fraction: float,
                 state_cache_gb: float | None) -> tuple[int, int]:
    """Split `budget` bytes (what is left for the KV pages and the snapshot slots) into (KV pages, snapshot slots):
    the snapshots take state_cache_gb GiB when given, else state_cache_fraction of the budget; the KV pool the
    rest, less its padding page. The pages may come out < 1: the caller refuses them."""
    share = state_cache_gb * 2**30 if state_cache_gb is not None else state_cache_fraction * max(budget, 0)
    snapshot_slots = int(max(share, 0) // slot_bytes)
    num_pages = int((budget - snapshot_slots * slot_bytes) // page_bytes) - 1  # one page is the decode padding's
    return num_pages, snapshot_slots


def pages_for_memory(model: Qwen35ForCausalLM, *, utilization: float, page_size: int, num_slots: int,
                     max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                     state_cache_fraction: float = 0.0, state_cache_gb: float | None = None, graph_rows: int = 0,
                     mtp_layers: int = 0) -> tuple[int, int, dict]:
    """KV pages and GDN snapshot slots that fit in `utilization` of the card next to the weights, the profiled peak
    step, num_slots GDN slots (the running sequences' and the padding's) and a reserve for the sampler, the decode
    graphs and the prefill graphs of up to graph_rows tokens (their private pool holds a step of that size: the
    peak's share); the snapshots take their share first (split_budget). Returns (num_pages, snapshot_slots, a
    record of the sizing). mtp_layers: the MTP head's KV layers in each page (speculating)."""
    dev = model.lm_head.weight.device
    peak = profile_step_peak(model, page_size, max_model_len, max_num_batched_tokens)
    free, total = torch.cuda.mem_get_info(dev)
    reserve = 512 * 2**20 + max_num_seqs * model.config.vocab_size * 32  # sampler (fp32 sort) and graph pool
    reserve += peak * min(graph_rows, max_num_batched_tokens) / max_num_batched_tokens
    slot_bytes = state_slot_bytes(model)
    budget = free - (1 - utilization) * total - peak - reserve - num_slots * slot_bytes
    num_pages, snapshot_slots = split_budget(budget, page_bytes=kv_page_bytes(model, page_size, mtp_layers),
                                             slot_bytes=slot_bytes,
                                             state_cache_fraction=state_cache_fraction, state_cache_gb=state_cache_gb)
    # tensor parallel: every rank's pools have the same pages and slots (each rank fits the least of both)
    snapshot_slots = model.tp.min_over_ranks(snapshot_slots)
    num_pages = model.tp.min_over_ranks(num_pages)
    if num_pages < -(-max_model_len // page_size):
        raise ValueError(f"after the weights, a {peak / 2**30:.2f} GiB activation peak and "
                         f"{snapshot_slots * slot_bytes / 2**30:.2f} GiB of GDN snapshots ({snapshot_slots} slots), "
                         f"{utilization:.0%} of the card leaves {max(num_pages, 0)} KV pages, fewer than one "
                         f"{max_model_len}-token sequence needs; raise gpu_memory_utilization, or lower max_model_len, "
                         f"max_num_batched_tokens or the state cache (state_cache_fraction, state_cache_gb)")
    return num_pages, snapshot_slots, dict(free_GiB=free / 2**30, total_GiB=total / 2**30, peak_GiB=peak / 2**30,
                                           reserve_GiB=reserve / 2**30,
                                           snapshot_GiB=snapshot_slots * slot_bytes / 2**30)


def describe_pools(model: Qwen35ForCausalLM, num_pages: int, page_size: int, running_slots: int,
                   snapshot_slots: int, position_slots_each: int = 0, mtp_layers: int = 0) -> str:
    """The pools, for the start-up log: the GDN slots as running_slots (max_num_seqs), snapshot_slots and, speculating,
    position_slots_each position slots a running sequence and the padding's, plus the padding's one slot."""
    slot = state_slot_bytes(model)
    kv = num_pages * kv_page_bytes(model, page_size, mtp_layers)
    position = (running_slots + 1) * position_slots_each
    st = (running_slots + snapshot_slots + position + 1) * slot
    mtp = ", with the MTP head's layer" if mtp_layers else ""
    positions = f", position_slots {position}" if position_slots_each else ""
    return (f"KV pool {num_pages} pages x {page_size} = {num_pages * page_size} tokens ({kv / 2**30:.2f} GiB{mtp}); "
            f"GDN state running_slots {running_slots}, snapshot_slots {snapshot_slots}{positions} (+1 padding; "
            f"{st / 2**30:.2f} GiB, {slot / 2**20:.1f} MiB each)")
