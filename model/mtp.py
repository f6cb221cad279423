"""Qwen3.5's multi-token prediction (MTP) head, `mtp.*` in the checkpoints.

Row t joins the embedding of token t+1 with the trunk's hidden state of token t (after the trunk's final norm):
fc(concat(norm_e(embed), norm_h(hidden))), then one full-attention decoder layer at position t, then a norm; the
model's lm_head turns that into a prediction of token t+2. The layer's KV lives in the page pool as one more
attention layer, under the same pages as the trunk's: its entry at position t depends on token t+1. Drafting
chains the head on its own output: draft k+1 reads draft k's output hidden state and token.
"""
import torch
from torch import nn

from model import ops
from model.config import Qwen35Config
from model.layers import DecoderLayer, Linear, RMSNorm
from model.parallel import ShardPlan
from model.step import StepInput


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: Qwen35Config, plan: ShardPlan):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.fc = Linear(2 * h, h)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention", plan)
                                    for _ in range(cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(h, eps)

    def forward(self, embeddings, hidden, step: StepInput, k_pages, v_pages, layer: int = 0):
        # embeddings: (N, H) of the rows' next tokens; hidden: (N, H) normed; k_pages, v_pages: the head's KV layer
        # -> the head's normed output (N, H)
        joined = torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x, residual = self.layers[layer](self.fc(joined), None, step, k_pages, v_pages)
        out, _ = ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return out
