"""Device memory for the model's state: a paged KV pool for the full-attention layers and a slot pool
for the Gated DeltaNet layers, plus `SequenceCache`, a small allocator that drives them for plain use."""
import random
from dataclasses import dataclass

import torch

from model.config import Qwen35Config
from model.step import StepInput


@dataclass
class CachePools:
    """k_pages, v_pages: (full_layers [+ MTP layers], num_pages, page_size, kv_heads, head_dim) in the model dtype;
    conv_states: (linear_layers, num_slots, conv_dim, kernel-1) in the model dtype;
    recurrent_states: (linear_layers, num_slots, value_heads, key_dim, value_dim) fp32;
    hidden: with an MTP layer, (num_slots, hidden_size) in the model dtype: beside each slot's GDN state, the trunk's
    normed hidden state of the last token that state has seen (the MTP head's input for that token's row), so that
    a snapshot restored at a prefix hit of n tokens gives the head its row n-1."""
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    conv_states: torch.Tensor
    recurrent_states: torch.Tensor
    hidden: torch.Tensor | None = None

    @classmethod
    def allocate(cls, cfg: Qwen35Config, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device, mtp_layers: int = 0) -> "CachePools":
        """mtp_layers: KV layers of the MTP head after the trunk's attention layers (0: no speculation)."""
        if not 1 <= page_size <= 4096 or num_pages < 1 or num_slots < 1:
            raise ValueError(f"bad pool sizes: num_pages={num_pages}, page_size={page_size}, num_slots={num_slots}")
        kv_layers = len(cfg.full_attention_layers) + mtp_layers
        kv_shape = (kv_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        n_lin = len(cfg.linear_attention_layers)
        return cls(
            k_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
            v_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
            conv_states=torch.zeros(n_lin, num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1,
                                    dtype=dtype, device=device),
            recurrent_states=torch.zeros(n_lin, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                         cfg.linear_value_head_dim, dtype=torch.float32, device=device),
            hidden=torch.zeros(num_slots, cfg.hidden_size, dtype=dtype, device=device) if mtp_layers else None)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.conv_states.shape[1]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot src's GDN state (every linear layer's conv window and recurrent state) into slot dst."""
        self.conv_states[:, dst].copy_(self.conv_states[:, src])
        self.recurrent_states[:, dst].copy_(self.recurrent_states[:, src])
        if self.hidden is not None:
            self.hidden[dst].copy_(self.hidden[src])

    def reset_slots(self, slots: list[int]) -> None:
        """Zero the GDN state of the given slots (a new sequence starts from nothing); host ints, so no index
        tensor is copied to the device (a pageable copy can wait for the stream)."""
        for slot in slots:
            self.conv_states[:, slot].zero_()
            self.recurrent_states[:, slot].zero_()
            if self.hidden is not None:
                self.hidden[slot].zero_()


class SequenceCache:
    """The cache of a fixed batch of sequences that grow together: `model(input_ids, cache)` uses it.

    Pages come from a free list (shuffled when `shuffle_pages`, to exercise page tables); sequence b owns
    GDN state slot b. `plan` builds the StepInput of the next T tokens and `advance` commits them.
    """

    def __init__(self, cfg: Qwen35Config, batch: int, max_tokens: int, *, page_size: int = 16,
                 dtype=torch.float32, device="cpu", shuffle_pages: bool = False, seed: int = 0,
                 mtp_layers: int = 0):
        if batch < 1 or max_tokens < 1:
            raise ValueError(f"batch and max_tokens must be positive, got {batch} and {max_tokens}")
        self.cfg, self.batch, self.max_tokens, self.device = cfg, batch, max_tokens, torch.device(device)
        self.pages_per_seq = -(-max_tokens // page_size)
        self.pools = CachePools.allocate(cfg, batch * self.pages_per_seq, page_size, batch, dtype, device,
                                         mtp_layers)
        free = list(range(self.pools.num_pages))
        if shuffle_pages:
            random.Random(seed).shuffle(free)
        self.page_table = torch.tensor(free, dtype=torch.int32).view(batch, self.pages_per_seq).to(self.device)
        self.lengths = [0] * batch

    def plan(self, token_ids: torch.Tensor) -> StepInput:
        """token_ids: (batch, T) -> the StepInput that appends them to every sequence."""
        if token_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(token_ids.shape)}")
        b, t = token_ids.shape
        if b != self.batch:
            raise ValueError(f"input_ids has batch {b} but the cache was made for batch {self.batch}")
        if t < 1 or max(self.lengths) + t > self.max_tokens:
            raise ValueError(f"{t} new tokens do not fit: cache holds {max(self.lengths)} of {self.max_tokens}")
        start = torch.tensor(self.lengths, dtype=torch.int64, device=self.device)
        positions = (start[:, None] + torch.arange(t, device=self.device)[None, :])  # (b, t)
        ps = self.pools.page_size
        pages = torch.gather(self.page_table.long(), 1, positions // ps)
        return StepInput(
            token_ids=token_ids.reshape(-1).to(self.device, torch.int64),
            positions=positions.reshape(-1),
            cu_seqlens=torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=self.device),
            max_seqlen_q=t,
            cu_seqlens_host=tuple(range(0, (b + 1) * t, t)),
            max_seqlen_k=max(self.lengths) + t,
            seqused_k=(start + t).to(torch.int32),
            page_table=self.page_table,
            slot_mapping=(pages * ps + positions % ps).reshape(-1),
            state_slots=torch.arange(b, dtype=torch.int64, device=self.device))

    def advance(self, step: StepInput) -> None:
        self.lengths = step.seqused_k.tolist()
