"""Memory-bounded cross-entropy over a large vocabulary.

The logits of a [tokens x vocab] head are never resident for more than one chunk of tokens: each
chunk's logits are computed, reduced to a loss and dropped, and recomputed chunk by chunk in backward
(activation checkpointing). With K MTP depths plus the main head, peak memory therefore grows by
O(chunk x vocab), not O(K x tokens x vocab); the price is one extra head matmul per chunk in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss_sum(h_nh: torch.Tensor, weight_vh: torch.Tensor, targets_n: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h_nh, weight_vh).float()
    return F.cross_entropy(logits, targets_n, reduction="sum")


def chunked_cross_entropy_sum(h_nh: torch.Tensor, weight_vh: torch.Tensor, targets_n: torch.Tensor,
                              chunk_tokens: int) -> torch.Tensor:
    """Sum of token cross-entropies of `h @ weight.T` against `targets` (only valid rows passed in)."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0  # keeps both in the graph with zero gradient
    if not torch.is_grad_enabled():
        return sum(_chunk_loss_sum(h_nh[i : i + chunk_tokens], weight_vh, targets_n[i : i + chunk_tokens])
                   for i in range(0, h_nh.shape[0], chunk_tokens))
    total = None
    for i in range(0, h_nh.shape[0], chunk_tokens):
        part = checkpoint(_chunk_loss_sum, h_nh[i : i + chunk_tokens], weight_vh, targets_n[i : i + chunk_tokens],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total
