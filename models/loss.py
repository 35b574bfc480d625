"""Memory-bounded cross-entropy over a large vocabulary.

The logits of a [tokens x vocab] head are never resident for more than one chunk of tokens: each
chunk's logits are computed, reduced to a loss and dropped. The trunk's head and every MTP depth go
through the head in one chunked pass (`head_cross_entropy_sums`), which by default computes each
chunk's gradients right away (a fused linear cross-entropy: no logits recomputed in backward) and,
told the gradient each depth's sum will receive, accumulates every depth's weight gradient into one
fp32 [vocab x hidden] buffer; `recompute` instead recomputes each chunk's logits in backward.
Either way peak memory grows by O(chunk x vocab), not O(K x tokens x vocab).

Rows without a target stay in: their target is IGNORE (cross-entropy's ignore_index) and they add
nothing to a sum or a gradient. Selecting the valid rows instead (`h[mask]`) has a data-dependent
shape, which costs a device-to-host sync per selection (and one per gradient scatter in backward)
and keeps the loss out of a compiled graph; the masked rows cost only their share of the head
matmul.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
"""Target of a row that has none (F.cross_entropy's default ignore_index): it adds nothing to a loss
sum."""


class VocabReduce:
    """How a loss combines per-row values over the vocabulary. On one device the rows already span
    the whole vocabulary, so every reduction is the identity; a vocabulary-parallel head
    (trainer/parallel/) passes one that all-reduces over its tensor-parallel group. The two sums
    differ only in backward, by who consumes the result: `sum` feeds computation every rank repeats
    (the loss itself), so its gradient is already whole on each rank; `sum_for_shards` (the softmax
    normaliser of a per-vocabulary quantity) feeds each rank's own vocabulary slice, so the slices'
    gradients must be summed."""

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Not differentiated (used only to stabilise exponentials)."""
        return x

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum_for_shards(self, x: torch.Tensor) -> torch.Tensor:
        return x


WHOLE_VOCAB = VocabReduce()


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on (as autograd's would), else
    h's. Explicit, because a custom backward runs outside the forward's autocast region."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype


CPU_SOFTMAX_BLOCK_BYTES = 2 << 20
"""On a CPU the softmax passes over a chunk's logits run over blocks of rows of at most this many
fp32 bytes: one block stays in the caches through its passes, where a whole chunk's (2048 tokens x
4096 vocabulary: 32 MiB) went to memory and back on each. An accelerator runs each pass as one
kernel over the chunk (blocks would multiply its launches), so there a block is the chunk."""


def _softmax_block_rows(rows: int, vocab: int, device_type: str) -> int:
    if device_type != "cpu":
        return rows
    return max(1, min(rows, CPU_SOFTMAX_BLOCK_BYTES // (4 * vocab)))


class _ChunkBuffers:
    """The buffers every chunk of one pass through the head writes into: its logits [chunk x vocab
    shard] in the matmuls' dtype, which the logit gradients overwrite, and, below fp32, one fp32
    block of rows for the softmax (`_softmax_block_rows`). On a CPU a fresh buffer that size is
    fresh pages from the kernel, and each 4 KiB costs a page fault when first written: as much as a
    pass over it (a GPU's caching allocator reuses its blocks anyway)."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.logits = torch.empty(rows, vocab, dtype=dtype, device=device)
        self.block_rows = _softmax_block_rows(rows, vocab, device.type)
        self.block = (torch.empty(self.block_rows, vocab, dtype=torch.float32, device=device)
                      if dtype != torch.float32 else None)


def chunk_buffer_bytes(rows: int, vocab: int, dtype: torch.dtype, device_type: str) -> int:
    """What `_ChunkBuffers(rows, vocab, dtype, device)` allocates on a device of `device_type`
    (trainer/estimate.py counts it without allocating)."""
    block = 0 if dtype == torch.float32 else _softmax_block_rows(rows, vocab,
                                                                 device_type) * vocab * 4
    return rows * vocab * dtype.itemsize + block


@torch.no_grad()
def _chunk_losses_and_logit_grads(h_nh: torch.Tensor, w_vh: torch.Tensor, targets_n: torch.Tensor,
                                  red: VocabReduce,
                                  vocab_start: int, buffers: _ChunkBuffers, with_grad: bool = True):
    """One chunk's per-row losses [n] (fp32; IGNORE rows 0) and d loss / d logits = softmax - onehot
    as `rows[:, None] * grad` from one head matmul and one softmax, in the dtype of `w_vh` (the
    matmuls' operand): `grad` [n, vocab shard] is exp(z) - S * onehot and `rows` [n] (fp32) is valid
    / S, where z are the logits less their row max and S = sum exp(z). The row factor is left to the
    caller to apply on the narrow side of its matmuls ([n x hidden], 1/vocab of the work of scaling
    [n x vocab]). The softmax runs in fp32 over blocks of rows (a max over the logits, then per
    block: subtract, exp, sum, and the gradient written over the block's logits), so every entry of
    `grad` is rounded to the operand dtype once, as rounding softmax - onehot itself would be. Under
    a vocabulary shard the max and the (sum of exponentials, target logit) pair are reduced in two
    collectives. `buffers` (one pass's) holds the logits, which `grad` overwrites (valid until the
    next chunk); `with_grad=False` returns the losses alone."""
    n, h_nh = h_nh.shape[0], h_nh.to(w_vh.dtype)
    # operands already in their dtype; `out=` below
    with torch.autocast(h_nh.device.type, enabled=False):
        logits = torch.mm(h_nh, w_vh.t(), out=buffers.logits[:n])
    row_max = red.max(logits.amax(dim=-1).float())  # exact in any dtype: a max rounds nothing
    local_t = targets_n - vocab_start
    inside = (local_t >= 0) & (local_t < w_vh.shape[0])
    local_t = local_t.clamp(0, w_vh.shape[0] - 1)
    # read before overwritten
    z_at_t = logits.gather(1, local_t.unsqueeze(1)).squeeze(1).float() - row_max
    sum_exp = torch.empty(n, dtype=torch.float32, device=h_nh.device)
    step = buffers.block_rows
    for i in range(0, n, step):
        block = logits[i : i + step]
        z = block.sub_(row_max[i : i + step].unsqueeze(1)) if buffers.block is None else \
            torch.sub(block, row_max[i : i + step].unsqueeze(1),
                      out=buffers.block[: block.shape[0]])
        exp_z = z.exp_()
        sum_exp[i : i + step] = exp_z.sum(dim=-1)
        if with_grad and buffers.block is not None:
            block.copy_(exp_z)  # the gradient's rounding (the one-hot entries are rewritten below)
    sum_exp, target_z = red.sum(torch.stack([sum_exp, torch.where(inside, z_at_t, 0.0)])).unbind(0)
    valid = targets_n != IGNORE
    losses = torch.where(valid, sum_exp.log() - target_z, 0.0)
    if not with_grad:
        return (losses,)
    rows = torch.arange(n, device=targets_n.device)
    # the one-hot (times S) lives in the target's shard only; exp(z) - S rounded once (a clamped
    # position outside the shard gets back its own exp(z))
    logits[rows, local_t] = (z_at_t.exp() - sum_exp * inside).to(logits.dtype)
    return losses, logits, valid / sum_exp


def _add_by_depth(totals_d: torch.Tensor, losses: torch.Tensor, start: int,
                  rows_per_depth: int) -> None:
    """totals[d] += the sum of a chunk's rows of depth d (the chunk starts at row `start` of
    depth-major blocks of `rows_per_depth` rows): one slice per depth the chunk touches, summed in a
    fixed order, where an index_add would sum with CUDA atomics in none."""
    i, end = start, start + losses.shape[0]
    while i < end:
        d = i // rows_per_depth
        j = min(end, (d + 1) * rows_per_depth)
        totals_d[d] += losses[i - start : j - start].sum()
        i = j


_CPU_KEPT_BUFFERS: dict = {}
"""The last pass's `_ChunkBuffers` on a CPU, under the key (rows, vocab shard, dtype, softmax block
rows) they were made for."""


def _pass_buffers(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> _ChunkBuffers:
    """One pass's buffers. On a CPU the last pass's are kept for the next pass of the same shape
    (the next step's): glibc serves a block of 32 MiB or more (2048 tokens x 4096 vocabulary in
    fp32) with a fresh mmap, whose pages fault in again on every step, which cost 4-5% of the fp32
    step of bench/throughput.py. They are needed at the head's point of every step anyway, where
    every activation of the forward is still held, so keeping them does not raise the peak. An
    accelerator's caching allocator reuses its blocks itself. Passes never overlap (each runs to its
    end before the next starts), so one set serves them all."""
    if device.type != "cpu":
        return _ChunkBuffers(rows, vocab, dtype, device)
    key = (rows, vocab, dtype, _softmax_block_rows(rows, vocab, device.type))
    if _CPU_KEPT_BUFFERS.get("key") != key:
        _CPU_KEPT_BUFFERS.clear()  # the old set is freed before the new one is made
        _CPU_KEPT_BUFFERS.update(key=key, buffers=_ChunkBuffers(rows, vocab, dtype, device))
    return _CPU_KEPT_BUFFERS["buffers"]


def _head_chunks(h_rh: torch.Tensor, w_vh: torch.Tensor, targets_r: torch.Tensor, chunk: int,
                 red: VocabReduce, vocab_start: int, with_grad: bool = True):
    """One pass through the head (`w_vh` already in the matmuls' dtype) in chunks of `chunk` rows,
    its buffers made once (`_pass_buffers`): per chunk (its first row, its rows of h, then what
    `_chunk_losses_and_logit_grads` returns for it)."""
    buffers = _pass_buffers(min(chunk, h_rh.shape[0]), w_vh.shape[0], w_vh.dtype, w_vh.device)
    for i in range(0, h_rh.shape[0], chunk):
        h = h_rh[i : i + chunk]
        yield (i, h, *_chunk_losses_and_logit_grads(h, w_vh, targets_r[i : i + chunk], red,
                                                    vocab_start, buffers, with_grad))


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, in place where the dtypes allow (no [vocab x hidden] temporary)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-depth summed cross-entropies of `h @ weight.T` for the rows of every depth at once, one
    chunk of logits at a time; d loss / d logits = softmax - onehot comes from the same matmul and
    softmax as the loss (`_chunk_losses_and_logit_grads`), and the modes differ only in when it is
    used.

    `fused` (`recompute=False`): each chunk adds its share to dL/dh right away and its logits are
    dropped; backward scales dL/dh by the incoming gradient of each row's depth. The weight's
    gradient sums over depths with different incoming gradients, unknown in forward. Given them
    (`grad_scales`, the loss's coefficient over each depth's global target count: known before
    forward), forward accumulates every depth into ONE fp32 [vocab x hidden] buffer, pre-scaled, and
    backward rescales it by the one factor that maps the promised gradients onto the incoming ones
    (the least-squares factor: exact when they are proportional, which `grad_scales` promises; a
    pipeline schedule's 1/micro-batches is such a factor). Without them backward recomputes the
    chunks' logits for the weight's gradient only.

    `recompute`: forward keeps only its inputs; backward recomputes each chunk's logits for both
    gradients (memory: one chunk of logits)."""

    @staticmethod
    def forward(ctx, h_rh, weight_vh, targets_r, row_depth_r, grad_scales_d, num_depths: int,
                chunk: int, red: VocabReduce, vocab_start: int, recompute: bool):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = _compute_dtype(h_rh)
        fuse_h = need_h and not recompute
        fuse_w = need_w and not recompute and grad_scales_d is not None
        if fuse_w:  # fp32 whatever reached it (a wrapper's mixed-precision input cast)
            grad_scales_d = grad_scales_d.float()
        totals = torch.zeros(num_depths, dtype=torch.float32, device=h_rh.device)
        grad_h = torch.empty_like(h_rh) if fuse_h else None
        grad_w = torch.zeros(weight_vh.shape, dtype=torch.float32,
                             device=weight_vh.device) if fuse_w else None
        w = weight_vh.to(dtype)
        for i, h, losses, grad, rows in _head_chunks(h_rh, w, targets_r, chunk, red, vocab_start):
            _add_by_depth(totals, losses, i, h_rh.shape[0] // num_depths)
            if fuse_h:
                grad_h[i : i + chunk] = (grad @ w).float().mul_(rows.unsqueeze(1))
            if fuse_w:
                depth = row_depth_r[i : i + chunk]
                _add_matmul(grad_w, grad.t(),
                            (h.float() * (rows * grad_scales_d[depth]).unsqueeze(1)).to(dtype))
        ctx.chunk, ctx.red, ctx.vocab_start, ctx.dtype = chunk, red, vocab_start, dtype
        ctx.weight_dtype, ctx.fuse_w = weight_vh.dtype, fuse_w
        ctx.recompute_h, ctx.recompute_w = need_h and not fuse_h, need_w and not fuse_w
        keep = (h_rh, weight_vh, targets_r) if ctx.recompute_h or ctx.recompute_w else (None, None,
                                                                                        None)
        ctx.save_for_backward(grad_h, grad_w, grad_scales_d if fuse_w else None, row_depth_r, *keep)
        return totals

    @staticmethod
    def backward(ctx, grad_d):
        grad_h, grad_w, scales, row_depth, h_rh, weight_vh, targets = ctx.saved_tensors
        grad_rows = grad_d.float()[row_depth]
        out_h = grad_h * grad_rows.unsqueeze(1).to(grad_h.dtype) if grad_h is not None else None
        out_w = None
        if ctx.fuse_w:
            factor = (grad_d.float()
                      @ scales) / (scales @ scales).clamp(min=torch.finfo(torch.float32).tiny)
            out_w = (grad_w * factor).to(ctx.weight_dtype)
        if ctx.recompute_h or ctx.recompute_w:
            w = weight_vh.to(ctx.dtype)
            out_h = torch.empty_like(h_rh) if ctx.recompute_h else out_h
            acc = torch.zeros(weight_vh.shape, dtype=torch.float32,
                              device=weight_vh.device) if ctx.recompute_w else None
            for i, h, _, grad, rows in _head_chunks(h_rh, w, targets, ctx.chunk, ctx.red,
                                                    ctx.vocab_start):
                rows = rows.mul_(grad_rows[i : i + ctx.chunk]).unsqueeze(1)
                if ctx.recompute_h:
                    out_h[i : i + ctx.chunk] = (grad @ w).float().mul_(rows)
                if ctx.recompute_w:
                    _add_matmul(acc, grad.t(), (h.float() * rows).to(ctx.dtype))
            out_w = acc.to(ctx.weight_dtype) if ctx.recompute_w else out_w
        return out_h, out_w, None, None, None, None, None, None, None, None


def head_cross_entropy_sums(h_dnh: torch.Tensor, weight_vh: torch.Tensor, targets_dn: torch.Tensor,
                            chunk_tokens: int, backward: str = "fused",
                            grad_scales: Optional[torch.Tensor] = None,
                            red: VocabReduce = WHOLE_VOCAB, vocab_start: int = 0) -> torch.Tensor:
    """[D] sums of token cross-entropies of `h @ weight.T` for D depths' rows (IGNORE targets count
    zero), every depth in one chunked pass, so no [tokens x vocab] logits outlive one chunk.
    `weight_vh` may be one vocabulary shard (rows vocab_start..; `red` then reduces over the shards,
    and the dL/dh returned is this shard's part, which the caller's tp collective sums). `backward`:
    `fused` computes the gradients in forward (`_HeadCrossEntropy`; `grad_scales`, the gradient the
    result will receive up to one factor, lets all depths share one weight-gradient buffer);
    `recompute` recomputes each chunk's logits in backward (memory: one chunk of logits); see
    MTPConfig.loss_head_backward."""
    d, n = targets_dn.shape
    h_rh, targets_r = h_dnh.reshape(d * n, -1), targets_dn.reshape(d * n)
    chunk = chunk_tokens if chunk_tokens > 0 else max(d * n, 1)
    if d * n == 0:
        return (h_rh.sum() + weight_vh.sum()) * torch.zeros(d, device=h_rh.device)
    if torch.is_grad_enabled() and (h_rh.requires_grad or weight_vh.requires_grad):
        # depth-major blocks of n rows
        row_depth = torch.arange(d, device=h_rh.device).repeat_interleave(n)
        return _HeadCrossEntropy.apply(h_rh, weight_vh, targets_r, row_depth, grad_scales, d, chunk,
                                       red,
                                       vocab_start, backward == "recompute")
    with torch.no_grad():
        dtype = _compute_dtype(h_rh)
        totals = torch.zeros(d, dtype=torch.float32, device=h_rh.device)
        for i, _, losses in _head_chunks(h_rh, weight_vh.to(dtype), targets_r, chunk, red,
                                         vocab_start, with_grad=False):
            _add_by_depth(totals, losses, i, n)
        return totals


@torch.no_grad()
def chunked_argmax(h_nh: torch.Tensor, weight_vh: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """argmax of `h @ weight.T` per row, one chunk of logits at a time (self-distillation
    targets)."""
    out = torch.empty(h_nh.shape[0], dtype=torch.long, device=h_nh.device)
    weight_vh = weight_vh.to(_compute_dtype(h_nh))  # a frozen head in train.frozen_dtype
    for i in range(0, h_nh.shape[0], chunk_tokens):
        out[i : i + chunk_tokens] = F.linear(h_nh[i : i + chunk_tokens], weight_vh).argmax(-1)
    return out


def _chunk_soft_ce_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                       valid_n: torch.Tensor) -> torch.Tensor:
    # the head in the student's compute dtype (a frozen trunk's head may be stored in bf16 while
    # the MTP module trains in fp32: train.frozen_dtype)
    dtype = _compute_dtype(h_nh)
    weight_vh = weight_vh.to(dtype)
    with torch.no_grad():
        p = F.linear(teacher_nh.to(dtype), weight_vh).float().softmax(-1)
    rows = -(p * F.linear(h_nh, weight_vh).float().log_softmax(-1)).sum(-1)
    return torch.where(valid_n, rows, 0.0).sum()


def chunked_soft_cross_entropy_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor,
                                   weight_vh: torch.Tensor,
                                   chunk_tokens: int, valid_n: torch.Tensor) -> torch.Tensor:
    """Sum over the rows where `valid_n` holds of the soft cross-entropy -sum_v p_teacher(v) log
    p_student(v) (KL to the teacher plus its constant entropy), with teacher and student logits both
    `h @ weight.T`; chunked and recomputed in backward (activation checkpointing), so no [tokens x
    vocab] tensor outlives one chunk."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0
    total = None
    # cut once: a slice per chunk of a tensor that needs a gradient zero-fills it whole in backward
    for h, teacher, valid in zip(*(x.split(chunk_tokens) for x in (h_nh, teacher_nh, valid_n))):
        args = (h, teacher, weight_vh, valid)
        part = (
            checkpoint(_chunk_soft_ce_sum, *args, use_reentrant=False)
            if torch.is_grad_enabled()
            else _chunk_soft_ce_sum(*args)
        )
        total = part if total is None else total + part
    return total


# --- the acceptance objective ---------------------------------------------------------------------
def _log_softmax(logits_nv: torch.Tensor, red: VocabReduce) -> torch.Tensor:
    m = red.max(logits_nv.detach().amax(dim=-1))
    z = logits_nv - m.unsqueeze(1)
    return z - red.sum_for_shards(z.exp().sum(dim=-1)).log().unsqueeze(1)


def acceptance_loss_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor, weight_vh: torch.Tensor,
                        targets_n: torch.Tensor, ce_weight: float, red: VocabReduce = WHOLE_VOCAB,
                        vocab_start: int = 0) -> torch.Tensor:
    """Sum over rows of -log a(p, q) (+ ce_weight x cross-entropy on `targets`), where a(p, q) =
    sum_v min(p_v, q_v) is the probability that speculative sampling accepts a token drafted from
    the student q (`h @ weight.T`) against the teacher p (`teacher @ weight.T`, no gradient).
    Computed in log space, log a = logsumexp_v min(log p_v, log q_v), so a near-zero overlap neither
    underflows nor divides by zero. `weight_vh` may be one vocabulary shard (rows vocab_start..),
    then `red` reduces over the shards. Rows whose target is IGNORE count zero."""
    dtype = _compute_dtype(h_nh)  # as _chunk_soft_ce_sum
    weight_vh = weight_vh.to(dtype)
    with torch.no_grad():
        log_p = _log_softmax(F.linear(teacher_nh.to(dtype), weight_vh).float(), red)
    log_q = _log_softmax(F.linear(h_nh, weight_vh).float(), red)
    low = torch.minimum(log_p, log_q)
    m = red.max(low.detach().amax(dim=-1))
    log_a = red.sum((low - m.unsqueeze(1)).exp().sum(dim=-1)).log() + m
    loss = -torch.where(targets_n != IGNORE, log_a, 0.0).sum()
    if ce_weight:
        local_t = targets_n - vocab_start
        inside = (local_t >= 0) & (local_t < weight_vh.shape[0])  # IGNORE (< 0) is in no shard
        picked = log_q.gather(1, local_t.clamp(0, weight_vh.shape[0] - 1).unsqueeze(1)).squeeze(1)
        loss = loss - ce_weight * red.sum(torch.where(inside, picked,
                                                      torch.zeros_like(picked))).sum()
    return loss


def chunked_acceptance_loss_sum(h_nh: torch.Tensor, teacher_nh: torch.Tensor,
                                weight_vh: torch.Tensor,
                                targets_n: torch.Tensor, chunk_tokens: int, ce_weight: float = 0.0,
                                red: VocabReduce = WHOLE_VOCAB,
                                vocab_start: int = 0) -> torch.Tensor:
    """`acceptance_loss_sum` one chunk of rows at a time, recomputed in backward like the other
    chunked losses, so no [tokens x vocab] tensor outlives one chunk."""
    if h_nh.shape[0] == 0:
        return (h_nh.sum() + weight_vh.sum()) * 0.0
    chunk = chunk_tokens if chunk_tokens > 0 else h_nh.shape[0]
    total = None
    for h, teacher, targets in zip(*(x.split(chunk) for x in (h_nh, teacher_nh, targets_n))):
        args = (h, teacher, weight_vh, targets, ce_weight, red, vocab_start)
        part = (checkpoint(acceptance_loss_sum, *args,
                           use_reentrant=False) if torch.is_grad_enabled()
                else acceptance_loss_sum(*args))
        total = part if total is None else total + part
    return total
