"""Tensor-parallel serving, the step messages: rank 0's engine tells the worker ranks what to run.

Every rank builds the same LLMEngine over its slice of the model (model.parallel): pools of its own heads, a
ModelRunner with the same decode graphs. Only rank 0's engine schedules, samples and serves; each step it sends
the workers what its ModelRunner is about to run, as host data over a gloo group (one broadcast of a fixed-size
int64 buffer per model call, a second one only for a message longer than the buffer; encode / decode below):
- the cache edits since the last message, in order: GDN slot resets and snapshot copies (the scheduler's, through
  RecordingPools) and page-table row updates;
- then the call: a decode of n rows padded to bs (its DECODE_INPUT_ROWS rows of bs ints), or an eager step's
  flat lists (serving.batch.StepLists), or "stop".
A worker (serve_worker) applies the edits to its own pools and runs the same ModelRunner method on the same host
data, so every rank enqueues the same kernels and collectives, graphs included; the logits (gathered on every
rank) are used by rank 0 only. The processes themselves are serving.tp_worker's.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.cache import CachePools
from model.parallel import ParallelContext
from serving.batch import StepLists
from serving.model_runner import DECODE_INPUT_ROWS


@dataclass
class RecordingPools(CachePools):
    """Rank 0's pools: every slot reset and snapshot copy is applied here and queued for the workers."""
    link: "StepBroadcaster | None" = None

    def reset_slots(self, slots: list[int]) -> None:
        super().reset_slots(slots)
        self.link.pending.append(("reset", list(slots)))

    def copy_slot(self, src: int, dst: int) -> None:
        super().copy_slot(src, dst)
        self.link.pending.append(("copy", src, dst))


class StepBroadcaster:
    """Rank 0's link to the workers."""

    def __init__(self, tp: ParallelContext):
        self.tp = tp
        self.pending: list[tuple] = []  # cache edits not yet sent
        self.stopped = False
        self.channel = Channel(tp)

    def recording(self, pools: CachePools) -> RecordingPools:
        return RecordingPools(pools.k_pages, pools.v_pages, pools.conv_states, pools.recurrent_states, link=self)

    def table(self, rows: list[int], cols: list[int], vals: list[int]) -> None:
        self.pending.append(("table", rows, cols, vals))

    def send(self, kind: str, payload) -> None:
        message, self.pending = encode(kind, self.pending, payload), []
        self.channel.send(message)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.send("stop", None)


def leader_link(model) -> StepBroadcaster | None:
    """Rank 0's link when the model is tensor parallel, else None (TP=1, or a worker rank)."""
    tp = model.tp
    return StepBroadcaster(tp) if tp.world_size > 1 and tp.rank == 0 else None


def serve_worker(engine) -> int:
    """A worker rank's loop over rank 0's messages, until "stop". Returns the number of model calls run."""
    runner, pools, tp = engine.runner, engine.pools, engine.model.tp
    calls, channel = 0, Channel(tp)
    while True:
        kind, edits, payload = decode(channel.receive())
        for edit in edits:
            if edit[0] == "table":
                runner.write_table(*edit[1:])
            elif edit[0] == "reset":
                pools.reset_slots(edit[1])
            elif edit[0] == "copy":
                pools.copy_slot(edit[1], edit[2])
            else:
                raise ValueError(f"unknown cache edit {edit[0]!r}")
        if kind == "stop":
            return calls
        if kind == "decode":
            runner.decode_values(*payload)
        elif kind == "eager":
            runner.eager_lists(payload)
        else:
            raise ValueError(f"unknown step message {kind!r}")
        calls += 1


# ---- the wire: messages as int64 lists, broadcast from rank 0 ----------------------------------------------------

CAPACITY = 1024  # int64s in the buffer every message is broadcast in: decode steps up to batch ~300 fit
_KINDS = ("stop", "decode", "eager")
_EDITS = ("table", "reset", "copy")


def encode(kind: str, edits: list[tuple], payload) -> list[int]:
    """[kind, #edits, edits..., payload...]: table = [0, k, rows, cols, vals], reset = [1, k, slots],
    copy = [2, src, dst]; decode = [bs, n, values (DECODE_INPUT_ROWS * bs)]; eager = [max_seqlen_q, N, B, tokens,
    positions, slot_mapping (N each), cu_seqlens (B + 1), seqused_k, state_slots, snapshot_offsets, snapshot_slots
    (B each)]; stop = []."""
    out = [_KINDS.index(kind), len(edits)]
    for edit in edits:
        out.append(_EDITS.index(edit[0]))
        if edit[0] == "table":
            out += [len(edit[1]), *edit[1], *edit[2], *edit[3]]
        elif edit[0] == "reset":
            out += [len(edit[1]), *edit[1]]
        else:
            out += [edit[1], edit[2]]
    if kind == "decode":
        bs, n, values = payload
        out += [bs, n, *values]
    elif kind == "eager":
        s = payload
        out += [s.max_seqlen_q, len(s.tokens), len(s.state_slots), *s.tokens, *s.positions, *s.slot_mapping,
                *s.cu_seqlens, *s.seqused_k, *s.state_slots, *s.snapshot_offsets, *s.snapshot_slots]
    return out


def decode(message: list[int]) -> tuple[str, list[tuple], object]:
    """The inverse of encode: (kind, edits, payload)."""
    i, edits = 2, []
    for _ in range(message[1]):
        what = _EDITS[message[i]]
        if what == "table":
            k = message[i + 1]
            a = i + 2
            edits.append((what, message[a:a + k], message[a + k:a + 2 * k], message[a + 2 * k:a + 3 * k]))
            i = a + 3 * k
        elif what == "reset":
            k = message[i + 1]
            edits.append((what, message[i + 2:i + 2 + k]))
            i += 2 + k
        else:
            edits.append((what, message[i + 1], message[i + 2]))
            i += 3
    kind, payload = _KINDS[message[0]], None
    if kind == "decode":
        bs, n = message[i], message[i + 1]
        payload = (bs, n, message[i + 2:i + 2 + DECODE_INPUT_ROWS * bs])
    elif kind == "eager":
        q, n, b = message[i:i + 3]
        i += 3
        cuts = [n, n, n, b + 1, b, b, b, b]
        parts = []
        for c in cuts:
            parts.append(message[i:i + c])
            i += c
        tokens, positions, slot_mapping, cu_seqlens, seqused_k, state_slots, offsets, snap_slots = parts
        payload = StepLists(tokens, positions, slot_mapping, cu_seqlens, seqused_k, state_slots, q, offsets,
                            snap_slots)
    return kind, edits, payload


class Channel:
    """Rank 0 -> every rank over the control group: one broadcast of a fixed (1 + CAPACITY) int64 buffer holding
    [length, message...]; a longer message follows whole in a second broadcast."""

    def __init__(self, tp: ParallelContext):
        self.group, self.capacity = tp.cpu_group, CAPACITY  # every rank's must be equal
        self.buffer = torch.zeros(1 + self.capacity, dtype=torch.int64)

    def send(self, message: list[int]) -> None:
        n = len(message)
        view = self.buffer.numpy()
        view[0] = n
        if n <= self.capacity:
            view[1:1 + n] = message
        dist.broadcast(self.buffer, src=0, group=self.group)
        if n > self.capacity:
            dist.broadcast(torch.tensor(message, dtype=torch.int64), src=0, group=self.group)

    def receive(self) -> list[int]:
        dist.broadcast(self.buffer, src=0, group=self.group)
        n = int(self.buffer[0])
        if n <= self.capacity:
            return self.buffer[1:1 + n].tolist()
        whole = torch.empty(n, dtype=torch.int64)
        dist.broadcast(whole, src=0, group=self.group)
        return whole.tolist()
