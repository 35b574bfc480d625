"""QSA's training-time selection and indexer target, streamed so no [B, S, S / r] tensor ever
exists.

`stream_select` scores a chunk of queries at a time against the blocks that can be visible to them,
and within a chunk, block chunk by block chunk, keeps a running top-k: the keys of the running top
and of the next block chunk are concatenated and their top-k kept. Every key is unique (see
`selection_keys`), so the merged top-k is the whole row's top-k, slot for slot.

`stream_target` computes the main attention's block mass a chunk of queries at a time
(qsa_loss.block_mass_chunk) and reduces each chunk at once to its recall and KL terms: in the sparse
stage over the k selected blocks only (the scores of those blocks are recomputed from the gathered
block keys, with autograd), in the dense warm-up over every block. Each chunk's KL is recomputed in
backward (activation checkpointing), so only [B, C] values per chunk outlive it.

Queries may be a subset of the key rows (context parallelism: a rank's rows; keys are the window's):
`query_at_bs` and the layout's per-query fields are the queries', block indices the window's.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from .qsa_loss import block_mass_chunk, indexer_kl_terms


def map_query_chunks(fn: Callable, chunk: int, sliced: Tuple[torch.Tensor, ...],
                     shared: Tuple = ()):
    """fn(*sliced, *shared) with `sliced` cut along dim 1 (queries) into chunks, concatenated back.
    Chunks are recomputed in backward, so only one chunk's intermediates are alive at a time (fn
    draws no random numbers: no RNG state is kept per chunk)."""
    s = sliced[0].shape[1]
    if chunk >= s:
        return fn(*sliced, *shared)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*sliced,
                                                                     *shared) if torch.is_tensor(t))
    outs = []
    # cut once (split's backward is one cat): a slice per chunk of a tensor that needs a gradient
    # zero-fills the whole tensor in backward, once per chunk, quadratic in the chunks
    for part in zip(*(t.split(chunk, 1) for t in sliced)):
        outs.append(checkpoint(fn, *part, *shared, use_reentrant=False,
                               preserve_rng_state=False) if grad
                    else fn(*part, *shared))
    return torch.cat(outs, 1)


def selection_keys(scores_bcn: torch.Tensor, block0: int,
                   visible_bcn: torch.Tensor) -> torch.Tensor:
    """int64 keys whose top-k is the selection, for blocks block0 .. block0 + n - 1 of a row.

    Scores are >= 0, so their fp32 bit patterns order like the values; the block index in the low
    bits makes every key unique (ties -> the earlier block). Blocks a query may not select get -1 -
    block (below every selectable one, the earlier first), so the unused slots of a query with fewer
    than k selectable blocks name the earliest unselectable blocks: still unique, and the same in
    every form."""
    bits = scores_bcn.detach().float().contiguous().view(torch.int32).long()
    block = torch.arange(block0, block0 + scores_bcn.shape[-1], device=scores_bcn.device)
    return torch.where(visible_bcn, (bits << 31) | (2**31 - 1 - block), -1 - block)


def _chunks(total: int, size: int):
    return [(c0, min(total, c0 + size)) for c0 in range(0, total, size)]


@torch.no_grad()
def stream_select(attn, q_idx_bsid: torch.Tensor, k_bnd: torch.Tensor, query_at_bs: torch.Tensor,
                  reach_bs: torch.Tensor, visible_fn: Callable[[int, int, int, int], torch.Tensor]):
    """(blocks [B, S_q, k], counts [B, S_q]) as `attn.select_blocks` gives them over the whole score
    matrix.

    `reach_bs`: how many leading blocks may be visible to each query (later ones are never
    selected); `visible_fn(c0, c1, n0, n1)` [B, C, n1 - n0]: which of blocks n0..n1 queries c0..c1
    may select."""
    b, s_q, i, _ = q_idx_bsid.shape
    r, n = attn.compress_ratio, k_bnd.shape[1]
    k = min(attn.budget // r, n)
    count_bs = ((query_at_bs + 1) // r).clamp(max=k)
    if k == 0:
        return query_at_bs.new_zeros(b, s_q, 0), count_bs
    width = min(n, max(k, attn.chunk_elems // (b * i)))  # blocks scored at once
    q_chunk = max(1, attn.chunk_elems // (b * i * width))
    spans = _chunks(s_q, q_chunk)
    # columns each chunk reads: its furthest reach, and at least k (the unused slots' blocks); all
    # of them under torch.compile, where a data-dependent count broke the block's graph (and ran
    # this function eagerly). The same selection either way: the keys of the columns past a
    # query's reach are below every visible one's (`selection_keys`).
    cols = ([n] * len(spans) if torch.compiler.is_compiling() else
            torch.stack([reach_bs[:, c0:c1].max() for c0, c1 in spans]).clamp(min=k,
                                                                              max=n).tolist())
    out = []
    for (c0, c1), n_c in zip(spans, cols):
        q_c, at_c = q_idx_bsid[:, c0:c1], query_at_bs[:, c0:c1]
        if n_c <= width:  # one block chunk: the plain top-k (what decoding runs)
            scores = attn.indexer.block_scores(q_c, k_bnd[:, :n_c])
            out.append(attn.select_blocks(scores, at_c, visible_fn(c0, c1, 0, n_c))[0])
            continue
        top_key = top_block = None
        for n0, n1 in _chunks(n_c, width):
            key = selection_keys(attn.indexer.block_scores(q_c, k_bnd[:, n0:n1]), n0,
                                 visible_fn(c0, c1, n0, n1))
            block = torch.arange(n0, n1, device=key.device).expand_as(key)
            if top_key is not None:
                key, block = torch.cat([top_key, key], -1), torch.cat([top_block, block], -1)
            top_key, pick = key.topk(min(k, key.shape[-1]), dim=-1)
            top_block = block.gather(-1, pick)
        out.append(top_block)
    return torch.cat(out, 1), count_bs


def selected_scores(q_bcid: torch.Tensor, blocks_bck: torch.Tensor,
                    k_bnd: torch.Tensor) -> torch.Tensor:
    """Block scores [B, C, k] of the blocks each query selected (QSAIndexer.block_scores' value),
    fp32."""
    b, c, i, d = q_bcid.shape
    rows = (blocks_bck + torch.arange(b, device=blocks_bck.device)[:, None, None]
            * k_bnd.shape[1]).reshape(-1)
    with torch.autocast(q_bcid.device.type, enabled=False):
        k_g = k_bnd.float().reshape(-1, d).index_select(0, rows).view(b, c, -1, d)
        dots = torch.einsum("bcid,bckd->bcik", q_bcid.float(), k_g)
    return dots.relu().sum(2) / math.sqrt(d)


def _sparse_kl(q_bcid, blocks_bck, mass_bck, real_bck, k_bnd):
    return indexer_kl_terms(selected_scores(q_bcid, blocks_bck, k_bnd), mass_bck, real_bck)[0]


def _dense_kl(indexer, q_bcid, mass_bcn, allowed_bcn, k_bnd):
    return indexer_kl_terms(indexer.block_scores(q_bcid, k_bnd), mass_bcn, allowed_bcn)[0]


def stream_target(attn, q_bhsd, k_bksd, q_idx_bsid, k_bnd, blocks_bsk, count_bs, docs,
                  selected: Optional[Callable[[int, int], torch.Tensor]], want_loss: bool,
                  visible_fn: Callable[[int, int, int, int], torch.Tensor],
                  rows_s: Optional[torch.Tensor], dense: bool = False,
                  counted: Optional[torch.Tensor] = None):
    """(sum over this forward's queries of their KL terms, or None; recall [B, S_q] or None). The
    caller divides the sum by the number of queries with a candidate block (the window's, under
    context parallelism, so the ranks' losses sum to one process's). `dense`: the warm-up's target,
    over every complete visible block instead of the selected ones. `counted` [B, S_q]: the
    queries that count (False on padding; None: all).

    Queries go in KL chunks sized by the KL's own intermediates (scores [B, C, I, columns], columns
    the K selected blocks or, dense, all N), each one checkpointed: few checkpoints, whose
    bookkeeping would otherwise grow with S^2 / chunk_elems; within one, the mass is computed in
    smaller pieces bounded by their logits [B, H, C, S]."""
    b, h, s_q, _ = q_bhsd.shape
    s_k, r = k_bksd.shape[2], attn.compress_ratio
    n = s_k // r
    cols = n if dense else max(1, blocks_bsk.shape[-1])
    mass_rows = max(1, attn.chunk_elems // (b * h * s_k))
    kl_rows = max(1, attn.chunk_elems
                  // (b * q_idx_bsid.shape[2] * cols * 4)) if want_loss else mass_rows
    grad = want_loss and torch.is_grad_enabled()
    total, recalls = None, []
    # the indexer's queries cut once, as map_query_chunks cuts its own
    for q_idx_bcid, (c0, c1) in zip(q_idx_bsid.split(kl_rows, 1), _chunks(s_q, kl_rows)):
        masses = []
        for m0, m1 in _chunks(c1 - c0, mass_rows):
            mass, recall = block_mass_chunk(
                q_bhsd.detach(), k_bksd.detach(), r, n, c0 + m0, c0 + m1, selected,
                sparse_target=not dense,
                query_first_bs=None if docs is None else docs.first_bs,
                block_tokens_bm=None if docs is None else docs.tokens_bm, query_rows_s=rows_s)
            if recall is not None:
                recalls.append(recall)
            if want_loss:  # the sparse stage needs the selected blocks' mass only
                masses.append(mass if dense else mass.gather(-1,
                                                                  blocks_bsk[:, c0 + m0:c0 + m1]))
        if not want_loss:
            continue
        mass = attn.reduce_heads(torch.cat(masses, 1))
        if dense:
            args, fn = (attn.indexer, q_idx_bcid, mass, visible_fn(c0, c1, 0, n),
                        k_bnd), _dense_kl
        else:
            blocks = blocks_bsk[:, c0:c1]
            real = torch.arange(blocks.shape[-1], device=blocks.device) < count_bs[:, c0:c1, None]
            args, fn = (q_idx_bcid, blocks, mass, real, k_bnd), _sparse_kl
        kl = checkpoint(fn, *args, use_reentrant=False,
                        preserve_rng_state=False) if grad else fn(*args)
        kl = (kl if counted is None else kl * counted[:, c0:c1]).sum()  # no padding query
        total = kl if total is None else total + kl
    return total, (torch.cat(recalls, 1) if recalls else None)
