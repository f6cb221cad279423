"""Greedy decoding's reduction: the argmax of each row of logits."""
import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    # logits: (B, V) -> (B,) int64: each row's first maximum, a NaN counting as the largest (torch.argmax)
    return logits.argmax(-1)
