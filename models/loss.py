"""Memory-bounded cross-entropy over a large vocabulary.

The logits of a [tokens x vocab] head are never resident for more than one chunk of tokens: each
chunk's logits are computed, reduced to a loss and dropped, and recomputed chunk by chunk in backward
(activation checkpointing). With K MTP depths plus the main head, peak memory therefore grows by
O(chunk x vocab), not O(K x tokens x vocab); the price is one extra head matmul per chunk in backward.

Rows without a target stay in: their target is IGNORE (cross-entropy's ignore_index) and they add
nothing to a sum or a gradient. Selecting the valid rows instead (`h[mask]`) has a data-dependent
shape, which costs a device-to-host sync per selection (and one per gradient scatter in backward) and
keeps the loss out of a compiled graph; the masked rows cost only their share of the head matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
"""Target of a row that has none (F.cross_entropy's default ignore_index): it adds nothing to a loss sum."""


def _chunk_loss_sum(h_nh: torch.Tensor, weight_vh: torch.Tensor, targets_n: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h_nh, weight_vh).float()
    return F.cross_entropy(logits, targets_n, reduction="sum", ignore_index=IGNORE)


def chunked_cross_entropy_sum(h_nh: torch.Tensor, weight_vh: torch.Tensor, targets_n: torch.Tensor,
                              chunk_tokens: int) -> torch.Tensor:
    """Sum of token cross-entropies of `h @ weight.T` against `targets` (IGNORE rows count zero)."""
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


class _HeadCrossEntropyGradInForward(torch.autograd.Function):
    """`chunked_cross_entropy_sum` with each chunk's gradients computed in forward (a fused linear
    cross-entropy): d loss / d logits = softmax - onehot is known once the logits are, so each chunk
    adds its share to dL/dh and dL/dW right away and its logits are dropped. Backward only scales
    the two by the incoming gradient: no second head matmul and no second softmax per chunk, for a
    [vocab x hidden] fp32 weight gradient held from forward to backward."""

    @staticmethod
    def forward(ctx, h_nh, weight_vh, targets_n, chunk_tokens: int):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=h_nh.device)
        grad_h = torch.empty_like(h_nh) if need_h else None
        grad_w = torch.zeros(weight_vh.shape, dtype=torch.float32, device=weight_vh.device) if need_w else None
        for i in range(0, h_nh.shape[0], chunk_tokens):
            h, t = h_nh[i : i + chunk_tokens], targets_n[i : i + chunk_tokens]
            valid = t != IGNORE
            t = t.clamp(min=0)  # an IGNORE row reads some logit, then counts zero
            logits = F.linear(h, weight_vh).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += torch.where(valid, lse - logits.gather(1, t[:, None]).squeeze(1), 0.0).sum()
            d_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            d_logits[torch.arange(t.shape[0], device=t.device), t] -= 1.0
            d_logits.mul_(valid[:, None])  # an IGNORE row has no gradient
            if need_h:  # the matmuls run in the compute dtype autocast gives them, as autograd's would
                grad_h[i : i + chunk_tokens] = d_logits @ weight_vh
            if need_w:
                grad_w += d_logits.t() @ h
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight_vh.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_total.to(grad_h.dtype) if grad_h is not None else None,
                (grad_w * grad_total).to(ctx.weight_dtype) if grad_w is not None else None, None, None)


def head_cross_entropy_sum(h_nh: torch.Tensor, weight_vh: torch.Tensor, targets_n: torch.Tensor, chunk_tokens: int,
                           backward: str = "recompute") -> torch.Tensor:
    """Sum of token cross-entropies of `h @ weight.T` (IGNORE rows count zero), chunk by chunk: `recompute`
    recomputes each chunk's logits in backward (`chunked_cross_entropy_sum`), `fused` computes the
    head's gradients in forward (`_HeadCrossEntropyGradInForward`); see MTPConfig.loss_head_backward."""
    if backward == "fused" and h_nh.shape[0] > 0 and torch.is_grad_enabled() \
            and (h_nh.requires_grad or weight_vh.requires_grad):
        return _HeadCrossEntropyGradInForward.apply(h_nh, weight_vh, targets_n, chunk_tokens)
    return chunked_cross_entropy_sum(h_nh, weight_vh, targets_n, chunk_tokens)


@torch.no_grad()
def chunked_argmax(h_nh: torch.Tensor, weight_vh: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """argmax of `h @ weight.T` per row, one chunk of logits at a time (self-distillation targets)."""
    out = torch.empty(h_nh.shape[0], dtype=torch.long, device=h_nh.device)
    for i in range(0, h_nh.shape[0], chunk_tokens):
        out[i : i + chunk_tokens] = F.linear(h_nh[i : i + chunk_tokens], weight_vh).argmax(-1)
    return out


def _chunk_soft_ce_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                       valid_n: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        p = F.linear(teacher_nh, weight_vh).float().softmax(-1)
    rows = -(p * F.linear(h_nh, weight_vh).float().log_softmax(-1)).sum(-1)
    return torch.where(valid_n, rows, 0.0).sum()


def chunked_soft_cross_entropy_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                                   chunk_tokens: int, valid_n: torch.Tensor) -> torch.Tensor:
    """Sum over the rows where `valid_n` holds of the soft cross-entropy -sum_v p_teacher(v) log p_student(v)
    (KL to the teacher plus its constant entropy), with teacher and student logits both `h @ weight.T`;
    chunked and recomputed in backward like `chunked_cross_entropy_sum`, so no [tokens x vocab] tensor
    outlives one chunk."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0
    total = None
    for i in range(0, h_nh.shape[0], chunk_tokens):
        args = (h_nh[i : i + chunk_tokens], teacher_nh[i : i + chunk_tokens], weight_vh, valid_n[i : i + chunk_tokens])
        part = checkpoint(_chunk_soft_ce_sum, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_soft_ce_sum(*args)
        total = part if total is None else total + part
    return total


# --- the acceptance objective ---------------------------------------------------------------------
class VocabReduce:
    """How a loss combines per-row values over the vocabulary. On one device the rows already span
    the whole vocabulary, so every reduction is the identity; a vocabulary-parallel head
    (trainer/parallel/) passes one that all-reduces over its tensor-parallel group. The two sums differ
    only in backward, by who consumes the result: `sum` feeds computation every rank repeats (the loss
    itself), so its gradient is already whole on each rank; `sum_for_shards` (the softmax normaliser)
    feeds each rank's own vocabulary slice, so the slices' gradients must be summed."""

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Not differentiated (used only to stabilise exponentials)."""
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum_for_shards(self, x: torch.Tensor) -> torch.Tensor:
        return x


WHOLE_VOCAB = VocabReduce()


def _log_softmax(logits_nv: torch.Tensor, red: VocabReduce) -> torch.Tensor:
    m = red.max(logits_nv.detach().amax(dim=-1))
    z = logits_nv - m.unsqueeze(1)
    return z - red.sum_for_shards(z.exp().sum(dim=-1)).log().unsqueeze(1)


def acceptance_loss_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                        targets_n: torch.Tensor, ce_weight: float, red: VocabReduce = WHOLE_VOCAB,
                        vocab_start: int = 0) -> torch.Tensor:
    """Sum over rows of -log a(p, q) (+ ce_weight x cross-entropy on `targets`), where
    a(p, q) = sum_v min(p_v, q_v) is the probability that speculative sampling accepts a token drafted
    from the student q (`h @ weight.T`) against the teacher p (`teacher @ weight.T`, no gradient).
    Computed in log space, log a = logsumexp_v min(log p_v, log q_v), so a near-zero overlap neither
    underflows nor divides by zero. `weight_vh` may be one vocabulary shard (rows vocab_start..), then
    `red` reduces over the shards. Rows whose target is IGNORE count zero."""
    with torch.no_grad():
        log_p = _log_softmax(F.linear(teacher_nh, weight_vh).float(), red)
    log_q = _log_softmax(F.linear(h_nh, weight_vh).float(), red)
    low = torch.minimum(log_p, log_q)
    m = red.max(low.detach().amax(dim=-1))
    log_a = red.sum((low - m.unsqueeze(1)).exp().sum(dim=-1)).log() + m
    loss = -torch.where(targets_n != IGNORE, log_a, 0.0).sum()
    if ce_weight:
        local_t = targets_n - vocab_start
        inside = (local_t >= 0) & (local_t < weight_vh.shape[0])  # IGNORE (< 0) is in no shard
        picked = log_q.gather(1, local_t.clamp(0, weight_vh.shape[0] - 1).unsqueeze(1)).squeeze(1)
        loss = loss - ce_weight * red.sum(torch.where(inside, picked, torch.zeros_like(picked))).sum()
    return loss


def chunked_acceptance_loss_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                                targets_n: torch.Tensor, chunk_tokens: int, ce_weight: float = 0.0,
                                red: VocabReduce = WHOLE_VOCAB, vocab_start: int = 0) -> torch.Tensor:
    """`acceptance_loss_sum` one chunk of rows at a time, recomputed in backward like the other chunked
    losses, so no [tokens x vocab] tensor outlives one chunk."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0
    chunk = chunk_tokens if chunk_tokens > 0 else h_nh.shape[0]
    total = None
    for i in range(0, h_nh.shape[0], chunk):
        args = (h_nh[i : i + chunk], teacher_nh[i : i + chunk], weight_vh, targets_n[i : i + chunk], ce_weight, red,
                vocab_start)
        part = (checkpoint(acceptance_loss_sum, *args, use_reentrant=False) if torch.is_grad_enabled()
                else acceptance_loss_sum(*args))
        total = part if total is None else total + part
    return total
