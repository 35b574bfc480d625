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


@torch.no_grad()
def chunked_argmax(h_nh: torch.Tensor, weight_vh: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """argmax of `h @ weight.T` per row, one chunk of logits at a time (self-distillation targets)."""
    out = torch.empty(h_nh.shape[0], dtype=torch.long, device=h_nh.device)
    for i in range(0, h_nh.shape[0], chunk_tokens):
        out[i : i + chunk_tokens] = F.linear(h_nh[i : i + chunk_tokens], weight_vh).argmax(-1)
    return out


def _chunk_soft_ce_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        p = F.linear(teacher_nh, weight_vh).float().softmax(-1)
    return -(p * F.linear(h_nh, weight_vh).float().log_softmax(-1)).sum()


def chunked_soft_cross_entropy_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                                   chunk_tokens: int) -> torch.Tensor:
    """Sum over rows of the soft cross-entropy -sum_v p_teacher(v) log p_student(v) (KL to the teacher plus
    its constant entropy), with teacher and student logits both `h @ weight.T`; chunked and recomputed in
    backward like `chunked_cross_entropy_sum`, so no [tokens x vocab] tensor outlives one chunk."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0
    total = None
    for i in range(0, h_nh.shape[0], chunk_tokens):
        args = (h_nh[i : i + chunk_tokens], teacher_nh[i : i + chunk_tokens], weight_vh)
        part = checkpoint(_chunk_soft_ce_sum, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_soft_ce_sum(*args)
        total = part if total is None else total + part
    return total
