"""Speculative decoding with the model's MTP head: K drafts a sequence, verified by the trunk K+1 tokens at a time.

A decoding sequence brings its last token and up to K drafts (ScheduledChunk.drafts). One trunk step runs them, and
every GDN layer also keeps the state after each draft-less token in the sequence's K position slots
(StepInput.position_slots). Acceptance keeps L of the K+1 (reference.greedy_accept's rule; speculative_accept when
sampling): the step emits the kept drafts and one token of the target's own. The sequence's GDN state then rolls
back to the state after its L-th token (a slot copy, where L < K+1); its KV past them is never read, as the next
verify step writes those positions before attending.

The head runs in every step over the rows whose next token the step knows. Row p reads token p+1 and the trunk's
hidden state of token p; for a chunk of tokens [start, end) the rows are start-1 .. end-2, plus row end-1 where
the chunk emitted a token (a prompt's tail, a verify step): that row's prediction is draft 1, and K-1 more rows,
each reading the head's own output and the draft before, give drafts 2..K. Row start-1 reads the hidden state that
the slot keeps beside the GDN state (CachePools.hidden), so the head's KV covers every computed position but the
last, in the trunk's pages, and a prefix hit of n tokens computes only row n-1 again (its snapshot's hidden state).

Two paths. A step whose chunks are all greedy decodes with K drafts runs on the device (launch, read): its shapes
do not depend on what it accepts, because the head takes rows start-1 .. start+K with the target's own tokens as their
next tokens (the kept drafts, the target's token, then rows past it that the next step computes again), and the
rollback and the drafting start are gathers by L. Those steps are padded to the batch ladder and replayed from CUDA
graphs, with one read of their tokens. Each also writes the next step's inputs on the device (its last kept token, the
next drafts, the start moved by L), so the engine launches the next step before reading this one (launch_ahead,
EngineConfig.decode_ahead). For that, a running sequence has two sets of K+1 position slots, which greedy steps take
in turn: the step ahead writes one set while the host reads the step before's states from the other (the commit's
snapshots at page boundaries, the state after a stop token). Other steps (prompts, sampled requests, fewer drafts)
take the host path: verify, accept, advance, draft.
"""
import random
from dataclasses import dataclass

import torch

import reference as R
from model import ops
from model.cache import CachePools
from model.model import Qwen35ForCausalLM
from model.step import StepInput
from serving.batch import ScheduledChunk, flatten_chunks, step_from_lists
from serving.block_manager import KVBlockManager
from serving.sampler import is_greedy, sampling_probs
from serving.sequence import Sequence


def position_slots_each(num_drafts: int, sets: int) -> int:
    """GDN slots a running sequence (and the padding) holds for the states after each token of its verify steps:
    `sets` sets of K+1, two where greedy steps are launched ahead (see the module's docstring), else one."""
    return sets * (num_drafts + 1)


@dataclass
class DeviceStep:
    """A greedy step launched on the device and not read yet: its sequences (its first rows; padding follows up to
    `batch`), which set of position slots it writes, and its results (rows of the target's K+1 tokens, L and the next
    K drafts) where they land once `done` (None: already there)."""
    seqs: list[Sequence]
    half: int
    batch: int
    results: torch.Tensor
    done: "torch.cuda.Event | None"


@dataclass
class Verified:
    """A trunk step's results: logits at the rows each chunk reads (logit_spans[i]: chunk i's range of them), every
    token's normed hidden state (N, H), and the step."""
    step: StepInput
    logits: torch.Tensor
    hidden: torch.Tensor
    logit_spans: list[tuple[int, int]]


@dataclass
class Head:
    """Where a sequence's drafting starts: its first draft's logits (1, V) and the head's output there (1, H)."""
    seq: Sequence
    logits: torch.Tensor
    hidden: torch.Tensor


def is_verify(c: ScheduledChunk) -> bool:
    """Whether the chunk starts at its sequence's last token (a decode, with or without drafts)."""
    return c.start == c.seq.num_tokens - 1


def emits(c: ScheduledChunk) -> bool:
    """Whether the chunk reaches its sequence's end, so the step emits tokens for it."""
    return c.end - len(c.drafts) == c.seq.num_tokens


class Speculator:
    def __init__(self, model: Qwen35ForCausalLM, pools: CachePools, runner, block_manager: KVBlockManager, *,
                 num_drafts: int, first_position_slot: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 graph_sizes: tuple[int, ...] = (), use_graphs: bool = False, draft_vocab: int = 0,
                 position_sets: int = 2):
        """runner: the engine's ModelRunner (its page-table rows by state slot, its padding slot and page); position
        slots: position_sets of K+1 a running slot from first_position_slot on, then as many for the padding slot (two
        sets let a greedy step be launched ahead of the one before; one: launch_ahead refuses).
        graph_sizes: the batch
        ladder greedy steps are padded to (empty: none); use_graphs: capture them (CUDA). draft_vocab: drafts choose
        among the first draft_vocab token ids (0: all of them); see EngineConfig.draft_vocab_size."""
        if not model.has_mtp:
            raise ValueError("speculative decoding needs the model's MTP head; this model has none (a checkpoint "
                             "without mtp.* tensors)")
        if model.tp.world_size > 1:
            raise ValueError("speculative decoding runs at tensor-parallel world size 1")
        vocab = model.config.vocab_size
        if not 0 <= draft_vocab <= vocab:
            raise ValueError(f"draft_vocab_size must lie in [0, {vocab}] (the model's vocab), got {draft_vocab}")
        # the draft head's logits: the first draft_vocab ids' (the lm_head's first rows, a view), or None: all ids'
        self.draft_vocab = draft_vocab if 0 < draft_vocab < vocab else None
        self.model, self.pools, self.runner, self.block_manager = model, pools, runner, block_manager
        self.k, self.first_position_slot = num_drafts, first_position_slot
        self.page_size, self.max_model_len = page_size, max_model_len
        self.device = model.lm_head.weight.device
        # a test hook: (seq, drafts) -> the drafts to verify instead
        self.replace_drafts = None
        # a benchmark mode (force_lengths): the random.Random that draws greedy steps' acceptance lengths, their mean
        self.forced: tuple[random.Random, float] | None = None
        self.num_verified = self.num_accepted = 0  # drafts verified and kept, since the start
        self.num_device_steps = 0  # greedy steps launched on the device
        self.num_verify_steps = 0  # verify chunks with drafts, since the start
        if position_sets not in (1, 2):
            raise ValueError(f"position_sets must be 1 or 2, got {position_sets!r}")
        self.position_sets = position_sets
        each = position_slots_each(num_drafts, position_sets)
        self.padding_position_slots = list(range(first_position_slot + max_num_seqs * each,
                                                 first_position_slot + (max_num_seqs + 1) * each))
        self.graph_sizes = tuple(sorted(graph_sizes))
        self.use_graphs = use_graphs and self.device.type == "cuda" and bool(graph_sizes)
        self.graphs: dict[int, tuple] = {}  # batch -> (graph, its results)
        rows = max(max(self.graph_sizes, default=0), max_num_seqs)
        # greedy_step_on's inputs, a row a sequence (INPUT_COLUMNS), which each step overwrites with the next step's
        self.inputs = torch.zeros(rows, sum(self.input_columns), dtype=torch.int64, device=self.device)
        cuda = self.device.type == "cuda"
        # where greedy steps' results land on the host, one buffer a set of position slots (a step and the step
        # ahead of it are in flight together)
        self.results = torch.zeros(2, rows, 2 * num_drafts + 2, dtype=torch.int64, pin_memory=cuda) if cuda else None
        self.done = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None

    @property
    def input_columns(self) -> list[int]:
        """The widths of a greedy step's input row: the last token and K drafts, the position of the first, the state
        slot, the K+1 position slots this step writes, the K+1 that the next one writes, a forced acceptance length
        (force_lengths; else unread), and 1 for a sequence (0: padding)."""
        k = self.k
        return [k + 1, 1, 1, k + 1, k + 1, 1, 1]

    @property
    def forced_column(self) -> int:
        """The input row's column of the forced acceptance length (input_columns)."""
        return sum(self.input_columns[:5])

    def position_slots(self, state_slot: int, half: int = 0) -> list[int]:
        """The K+1 slots of set `half` that hold a running sequence's GDN state after each token of a verify step (the
        host path writes the first K of set 0)."""
        each = position_slots_each(self.k, self.position_sets)
        base = self.first_position_slot + state_slot * each + half % self.position_sets * (self.k + 1)
        return list(range(base, base + self.k + 1))

    # ---- the trunk -------------------------------------------------------------------------------------------

    def verify(self, chunks: list[ScheduledChunk]) -> Verified:
        """One trunk step of the chunks: logits at every row of a verify chunk and at the last row of the others."""
        self.runner.sync_page_tables([c.seq for c in chunks])
        self.runner.num_eager_steps += 1
        lists = flatten_chunks(chunks, self.page_size, self.position_slots)
        step = step_from_lists(lists, self.device, slot_page_table=self.runner.table)
        rows, spans = [], []
        for c, lo, hi in zip(chunks, lists.cu_seqlens, lists.cu_seqlens[1:]):
            first = lo if is_verify(c) else hi - 1
            spans.append((len(rows), len(rows) + hi - first))
            rows += range(first, hi)
        logit_rows = torch.tensor(rows, dtype=torch.int64).to(self.device)
        # a step without drafts replays the prefill graphs (covers refuses per-token GDN states)
        *_, (logits, hidden) = self.runner.step_layers(step, with_hidden=True, logit_rows=logit_rows)
        return Verified(step, logits, hidden, spans)

    def accept(self, chunks: list[ScheduledChunk], v: Verified) -> list[list[int]]:
        """The tokens the step emits for each chunk: none for a prompt's middle, one sampled token for a prompt's
        tail, the kept drafts and the target's next token for a verify chunk."""
        greedy = ops.argmax(v.logits).tolist()  # the step's one sync
        out = []
        for c, (lo, hi) in zip(chunks, v.logit_spans):
            if not emits(c):
                out.append([])
                continue
            params, drafts = c.seq.params, list(c.drafts)
            if is_greedy(params):
                target = greedy[lo:hi]
                kept = next((i for i, d in enumerate(drafts) if d != target[i]), len(drafts))
                out.append(target[:kept + 1])
                continue
            p = sampling_probs(v.logits[lo:hi], params).cpu()  # the request's generator draws on the host
            if not drafts:
                out.append([int(torch.multinomial(p[-1], 1, generator=c.seq.generator))])
                continue
            q = c.seq.draft_probs[:len(drafts)].cpu()
            n, tokens = R.speculative_accept(torch.tensor([drafts]), q[None], p[None], generator=c.seq.generator)
            out.append(tokens[0, :int(n[0])].tolist())
        for c, e in zip(chunks, out):
            if c.drafts:
                self.count_verified(len(c.drafts), len(e))
        return out

    def count_verified(self, drafts: int, emitted: int) -> None:
        """The drafts counts of one verify row that emitted tokens: its drafts, and the kept ones among what it
        emitted (a stop or max_tokens may cut a row short of L)."""
        self.num_verify_steps += 1
        self.num_verified += drafts
        self.num_accepted += min(emitted, drafts + 1) - 1

    # ---- after acceptance: the head's rows, the slots' hidden states, the rollback ---------------------------

    def advance(self, chunks: list[ScheduledChunk], kept: list[int], emitted: list[list[int]],
                v: Verified) -> list[Head]:
        """Run the head over each chunk's rows (kept[i] of chunk i's tokens were kept; emitted[i] its tokens), store
        each slot's hidden state, and roll verify chunks back to their kept tokens. Returns where each emitting
        chunk's drafting starts."""
        cu = v.step.cu_seqlens_host
        heads = self._head_rows(chunks, kept, emitted, v.hidden, cu)
        self._store_hidden(chunks, kept, v, cu)
        for c, n in zip(chunks, kept):
            if is_verify(c) and n < c.num_tokens:
                self.roll_back(c.seq, n)
        return heads

    def roll_back(self, seq: Sequence, kept: int) -> None:
        """seq's GDN state (and hidden state) back to the one after its verify step's first `kept` tokens."""
        self.pools.copy_slot(self.position_slots(seq.state_slot)[kept - 1], seq.state_slot)

    def _head_rows(self, chunks, kept, emitted, trunk_hidden, cu) -> list[Head]:
        """The head's rows of the step (see the module's docstring), in one MTP step; returns the drafting starts of
        the emitting chunks. Rows are built a chunk at a time (list slices and ranges, KV slots on the device), not a
        token at a time: a prompt's every token is a row."""
        tokens, positions, seq_of, cu_rows, seqused, slots = [], [], [], [0], [], []
        trunk_rows, trunk_at, slot_at, slot_src = [], [], [], []  # hidden inputs: trunk rows, slots' hidden states
        logit_rows, emitting = [], []
        for i, c in enumerate(chunks):
            start = c.start
            known = c.input_ids[:kept[i]] + emitted[i][-1:]  # the tokens at positions start, start + 1, ...
            first, end = (start - 1 if start > 0 else 0), start + len(known) - 1  # rows first .. end - 1
            if end <= first:
                continue
            at = len(tokens)
            tokens += known[first + 1 - start:]  # row p reads token p + 1
            positions.extend(range(first, end))
            seq_of += [len(slots)] * (end - first)
            if start > 0:  # row start - 1: the slot's hidden state of its last token
                slot_at.append(at)
                slot_src.append(c.seq.state_slot)
            trunk_at.extend(range(at + start - first, at + end - first))
            trunk_rows.extend(range(cu[i], cu[i] + end - start))
            cu_rows.append(len(tokens))
            seqused.append(end)
            slots.append(c.seq.state_slot)
            if emitted[i]:
                logit_rows.append(len(tokens) - 1)
                emitting.append(c.seq)
        if not tokens:
            return []
        dev, ps = self.device, self.page_size
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(dev)
        hidden = trunk_hidden.new_empty(len(tokens), trunk_hidden.shape[1])
        if trunk_at:
            hidden[as_tensor(trunk_at)] = trunk_hidden[as_tensor(trunk_rows)]
        if slot_at:
            hidden[as_tensor(slot_at)] = self.pools.hidden[as_tensor(slot_src)]
        state_slots, pos = as_tensor(slots), as_tensor(positions)
        table = self.runner.table.index_select(0, state_slots)  # (B, W) the sequences' pages
        kv_slots = table[as_tensor(seq_of), pos // ps].long() * ps + pos % ps
        step = StepInput(token_ids=as_tensor(tokens), positions=pos, cu_seqlens=as_tensor(cu_rows).int(),
                         max_seqlen_q=max(b - a for a, b in zip(cu_rows, cu_rows[1:])),
                         cu_seqlens_host=tuple(cu_rows), max_seqlen_k=max(seqused), seqused_k=as_tensor(seqused).int(),
                         page_table=table, slot_mapping=kv_slots, state_slots=state_slots)
        rows = as_tensor(logit_rows)
        logits, out = self.model.forward_mtp(step, hidden, self.pools, logit_rows=rows, vocab=self.draft_vocab)
        return [Head(seq, logits[j:j + 1], out[rows[j:j + 1]]) for j, seq in enumerate(emitting)]

    def _store_hidden(self, chunks, kept, v: Verified, cu) -> None:
        """Each slot's hidden state: the state slot's of its last kept token, a verify chunk's position slots' of
        theirs (a rollback copies one over the state slot), an in-chunk snapshot's of the token before its point."""
        rows, dst = [], []
        offsets = v.step.snapshot_offsets or (0,) * len(chunks)
        snapshot_slots = v.step.snapshot_slots.tolist() if v.step.snapshot_offsets else None
        for i, c in enumerate(chunks):
            rows.append(cu[i] + kept[i] - 1)
            dst.append(c.seq.state_slot)
            if c.drafts:
                for j, slot in enumerate(self.position_slots(c.seq.state_slot)[:len(c.drafts)]):
                    rows.append(cu[i] + j)
                    dst.append(slot)
            if offsets[i]:
                rows.append(cu[i] + offsets[i] - 1)
                dst.append(snapshot_slots[i])
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(self.device)
        self.pools.hidden[as_tensor(dst)] = v.hidden[as_tensor(rows)]

    # ---- a greedy decode step on the device ------------------------------------------------------------------

    def on_device(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether greedy_step runs the step: every chunk a greedy sequence's verify chunk of K drafts, with pages
        for its head's rows up to 2K tokens on (taken here)."""
        return all(is_verify(c) and len(c.drafts) == self.k and is_greedy(c.seq.params)
                   and c.start + 2 * self.k <= self.max_model_len for c in chunks) and all(
            self.block_manager.allocate(c.seq, c.start + 2 * self.k) for c in chunks)

    def launch(self, chunks: list[ScheduledChunk]) -> DeviceStep:
        """Launch the greedy step of on_device's chunks (their inputs from the host; position slots of set 0): the
        verify step, acceptance, the head's rows, the rollback and the next drafts, all on the device with static
        shapes (no host value depends on what the step accepts). read() waits for its results."""
        self.runner.sync_page_tables([c.seq for c in chunks])
        n = len(chunks)
        rows = [[c.seq.token_slice(c.start, c.start + 1)[0], *c.drafts, c.start, c.seq.state_slot,
                 *self.position_slots(c.seq.state_slot, 0), *self.position_slots(c.seq.state_slot, 1),
                 self._forced_length(), 1] for c in chunks]
        bs = next((size for size in self.graph_sizes if size >= n), n)
        rows += [self.padding_row] * (bs - n)
        pinned = self.device.type == "cuda"
        values = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=True)
        self.inputs[:bs].copy_(values)
        return self._run([c.seq for c in chunks], bs, 0)

    def launch_ahead(self, step: DeviceStep) -> DeviceStep | None:
        """Launch the greedy step after `step`, of the same sequences, before step is read: its inputs are the ones
        step wrote on the device, and it writes the other set of position slots. None with one set of position slots,
        or where a sequence's next step could pass max_model_len or its pages (the next step's tokens and their
        head's rows) are short."""
        reach = 3 * self.k + 1  # step's K+1 tokens at most, then the next one's 2K (on_device)
        seqs = step.seqs
        if self.position_sets < 2 or any(s.num_computed_tokens + reach > self.max_model_len for s in seqs):
            return None
        if not all(self.block_manager.allocate(s, s.num_computed_tokens + reach) for s in seqs):
            return None  # pages allocated so far stay: the next steps need them anyway
        self.runner.sync_page_tables(seqs)
        if self.forced is not None:
            pinned = self.device.type == "cuda"
            lengths = torch.tensor([self._forced_length() for _ in seqs], dtype=torch.int64, pin_memory=pinned)
            self.inputs[:len(seqs), self.forced_column].copy_(lengths, non_blocking=True)
        return self._run(seqs, step.batch, 1 - step.half)

    def _run(self, seqs: list[Sequence], bs: int, half: int) -> DeviceStep:
        """Run greedy_step_on over self.inputs[:bs] (a graph's replay where one was captured) and start its results'
        copy to the host."""
        self.num_device_steps += 1
        graph = self.graphs.get(bs)
        if graph is not None:
            graph[0].replay()
            results = graph[1]
        else:
            self.runner.num_eager_steps += 1
            results = self.greedy_step_on(self.inputs[:bs])
        if self.results is None:
            return DeviceStep(seqs, half, bs, results, None)
        self.results[half, :bs].copy_(results, non_blocking=True)
        self.done[half].record()
        return DeviceStep(seqs, half, bs, self.results[half, :bs], self.done[half])

    def read(self, step: DeviceStep) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """Wait for a greedy step's results (its one sync): each sequence's target tokens (K+1), how many of them it
        keeps (L), and its next K drafts."""
        if step.done is not None:
            step.done.synchronize()
        k = self.k
        out = step.results[:len(step.seqs)].tolist()
        return [r[:k + 1] for r in out], [r[k + 1] for r in out], [r[k + 2:] for r in out]

    @property
    def padding_row(self) -> list[int]:
        """greedy_step_on's input row of a padding sequence: token 0 from position 1 of the padding slot (and page)."""
        return [0] * (self.k + 1) + [1, self.runner.dummy_slot, *self.padding_position_slots, 1, 0]

    def force_lengths(self, mean_length: float, seed: int = 0) -> None:
        """A benchmark mode: each greedy step keeps a drawn number of tokens, floor(mean_length) or the next integer
        (mean mean_length, 1..K+1), whatever the target says, so that the machinery runs as at that acceptance
        length with random weights; the tokens it emits are not the model's greedy output. Greedy steps are captured
        again (the choice is inside their graphs)."""
        if not 1 <= mean_length <= self.k + 1:
            raise ValueError(f"mean_length must lie in [1, K + 1 = {self.k + 1}], got {mean_length}")
        self.forced = (random.Random(seed), mean_length)
        if self.graphs:
            self.graphs.clear()
            self.capture()

    def _forced_length(self) -> int:
        if self.forced is None:
            return 0
        rng, mean = self.forced
        return int(mean) + (rng.random() < mean - int(mean))

    def greedy_step_on(self, values: torch.Tensor) -> torch.Tensor:
        """values (B, sum(input_columns)) int64 on the device, a row a sequence (input_columns). Returns (B, 2K+2): the
        target's argmax (K+1), L, the next K drafts; and overwrites each sequence's row with its next step's inputs
        (padding rows stay). Static shapes and no host read: what a CUDA graph of the step captures."""
        k, ps, model, pools = self.k, self.page_size, self.model, self.pools
        tokens, starts, slots, written, other, forced, real = values.split(self.input_columns, dim=1)
        b, q, dev = tokens.shape[0], k + 1, tokens.device
        table = self.runner.table.index_select(0, slots[:, 0])  # (B, W) the sequences' pages

        def kv_slots(positions):  # (B, n) -> the flat KV slots of those positions
            return table.gather(1, positions // ps).long() * ps + positions % ps

        def step_of(positions, token_ids, position_slots=None):  # B sequences of n tokens at positions (B, n)
            n = positions.shape[1]
            return StepInput(token_ids=token_ids.reshape(-1), positions=positions.reshape(-1),
                             cu_seqlens=torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=dev),
                             max_seqlen_q=n, cu_seqlens_host=tuple(range(0, (b + 1) * n, n)),
                             seqused_k=(positions[:, -1] + 1).int(), page_table=table,
                             slot_mapping=kv_slots(positions).reshape(-1), state_slots=slots[:, 0],
                             position_slots=position_slots)

        positions = starts + torch.arange(q, device=dev)  # (B, K+1)
        # every token's state to its position slot, the last one's too (not to the state slot: a step launched
        # ahead overwrites that before the host reads this step)
        logits, hidden = model.forward_step(step_of(positions, tokens, written.reshape(-1)), pools,
                                            all_logits=True, with_hidden=True)
        target = ops.argmax(logits).view(b, q)
        lengths = (tokens[:, 1:] == target[:, :k]).long().cumprod(1).sum(1) + 1  # (B,) 1..K+1
        if self.forced is not None:
            lengths = forced[:, 0].clamp(1, k + 1)
        # the head's rows start-1 .. start+K: tokens [last, target 0..K] (the kept drafts, the target's own token,
        # then rows past it that the next step computes again), hidden [the slot's, the trunk's rows]
        hidden = hidden.view(b, q, -1)
        head_in = torch.cat([pools.hidden.index_select(0, slots[:, 0])[:, None], hidden], 1).reshape(b * (q + 1), -1)
        head_pos = starts - 1 + torch.arange(q + 1, device=dev)
        rows = torch.arange(b, device=dev) * (q + 1) + lengths  # row start-1+L: its prediction is draft 1
        head_logits, head_out = model.forward_mtp(step_of(head_pos, torch.cat([tokens[:, :1], target], 1)), head_in,
                                                  pools, logit_rows=rows, vocab=self.draft_vocab)
        # each position slot's hidden state (its token's), then the state slot: the state after token L-1 (the
        # rollback where a draft was rejected)
        pools.hidden[written.reshape(-1)] = hidden.reshape(b * q, -1)
        src = written.gather(1, lengths[:, None] - 1)[:, 0]
        for pool in (pools.conv_states, pools.recurrent_states):
            pool[:, slots[:, 0]] = pool[:, src]
        pools.hidden[slots[:, 0]] = pools.hidden[src]
        drafts = [ops.argmax(head_logits)]
        out = head_out[rows]
        for j in range(1, k):  # draft j+1 from the row at start-1+L+j: draft j and the head's output before it
            chain_pos = starts - 1 + lengths[:, None] + j
            logits_j, out = model.forward_mtp(step_of(chain_pos, drafts[-1][:, None]), out, pools, all_logits=True,
                                              vocab=self.draft_vocab)
            drafts.append(ops.argmax(logits_j))
        drafts = torch.stack(drafts, 1)
        # the next step: the last kept token and the drafts after it, L positions on, the other set of slots
        last = target.gather(1, lengths[:, None] - 1)
        after = torch.cat([last, drafts, starts + lengths[:, None], slots, other, written, forced, real], 1)
        values.copy_(torch.where(real.bool(), after, values))
        return torch.cat([target, lengths[:, None], drafts], 1)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture greedy_step_on at each batch of the ladder (largest first, one memory pool), each warmed up first
        on padding rows (which touch only the padding slot, its position slots and the padding page)."""
        if not self.use_graphs:
            return
        padding = torch.tensor(self.padding_row, device=self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in self.graph_sizes:
                self.inputs[:bs].copy_(padding.expand(bs, -1))
                self.greedy_step_on(self.inputs[:bs])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        pool = None
        for bs in sorted(self.graph_sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.greedy_step_on(self.inputs[:bs])
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)

    def set_drafts(self, seqs: list[Sequence], drafts: list[list[int]]) -> None:
        """greedy_step's drafts for the sequences still running (through replace_drafts where set)."""
        for seq, d in zip(seqs, drafts):
            seq.draft_ids, seq.draft_probs = list(d), None
            if self.replace_drafts is not None:
                seq.draft_ids = list(self.replace_drafts(seq, list(d)))[:len(d)]

    # ---- drafting --------------------------------------------------------------------------------------------

    def draft(self, heads: list[Head]) -> None:
        """Draft up to K tokens for each head's sequence (pages, max_tokens and max_model_len allowing): draft 1 from
        the head's row, then one MTP row a draft on the head's own output. Sets seq.draft_ids (and draft_probs)."""
        todo = []
        for h in heads:
            seq = h.seq
            seq.draft_ids, seq.draft_probs = [], None
            n = min(self.k, seq.params.max_tokens - len(seq.output_ids) - 1,
                    self.max_model_len - seq.num_computed_tokens - 1)
            while n > 0 and not self.block_manager.allocate(seq, seq.num_computed_tokens + 1 + n):
                n -= 1  # pages for the next verify step's tokens (and the chain's KV before them)
            if n > 0:
                todo.append((h, n))
        if not todo:
            return
        self.runner.sync_page_tables([h.seq for h, _ in todo])
        logits, hidden = torch.cat([h.logits for h, _ in todo]), torch.cat([h.hidden for h, _ in todo])
        self._choose_drafts([h.seq for h, _ in todo], logits)
        for j in range(1, max(n for _, n in todo)):
            keep = [i for i, (_, n) in enumerate(todo) if n > j]
            if len(keep) < len(todo):
                hidden = hidden[torch.tensor(keep, dtype=torch.int64).to(self.device)]
                todo = [todo[i] for i in keep]
            # row num_computed - 1 + j reads draft j and the head's output at the row before
            logits, hidden = self._chain([h.seq for h, _ in todo], hidden)
            self._choose_drafts([h.seq for h, _ in todo], logits)
        if self.replace_drafts is not None:  # as many as were drafted (each has its position slot)
            for h in heads:
                drafted = len(h.seq.draft_ids)
                h.seq.draft_ids = list(self.replace_drafts(h.seq, list(h.seq.draft_ids)))[:drafted]

    def _chain(self, seqs: list[Sequence], hidden: torch.Tensor):
        # one row a sequence: its last draft at position num_computed - 1 + len(drafts) -> (logits (B, V), out (B, H))
        positions = [s.num_computed_tokens - 1 + len(s.draft_ids) for s in seqs]
        dev = self.device
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64).to(dev)
        state_slots = as_tensor([s.state_slot for s in seqs])
        b = len(seqs)
        step = StepInput(token_ids=as_tensor([s.draft_ids[-1] for s in seqs]), positions=as_tensor(positions),
                         cu_seqlens=torch.arange(b + 1, dtype=torch.int32).to(dev), max_seqlen_q=1,
                         cu_seqlens_host=tuple(range(b + 1)), max_seqlen_k=max(positions) + 1,
                         seqused_k=as_tensor([p + 1 for p in positions]).int(),
                         page_table=self.runner.table.index_select(0, state_slots),
                         slot_mapping=as_tensor([s.kv_slot(p, self.page_size) for s, p in zip(seqs, positions)]),
                         state_slots=state_slots)
        return self.model.forward_mtp(step, hidden, self.pools, all_logits=True, vocab=self.draft_vocab)

    def _choose_drafts(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Append each sequence's next draft: the argmax, or a draw from its sampling distribution (kept in
        draft_probs for the verify step, over the whole vocab: zero past a reduced draft vocab)."""
        greedy = ops.argmax(logits).tolist()
        for i, seq in enumerate(seqs):
            if is_greedy(seq.params):
                seq.draft_ids.append(greedy[i])
                continue
            q = sampling_probs(logits[i:i + 1], seq.params)
            q = torch.nn.functional.pad(q, (0, self.model.config.vocab_size - q.shape[1]))
            seq.draft_ids.append(int(torch.multinomial(q[0].cpu(), 1, generator=seq.generator)))
            seq.draft_probs = q if seq.draft_probs is None else torch.cat([seq.draft_probs, q])
