"""QSA indexer training signals: the main attention's block mass, the indexer's KL loss, recall.

DeepSeek-V3.2 trains its indexer to predict where the main attention looks. For a query at t let
p_h(u) be head h's attention probability on visible token u. The target over the query's candidate
blocks is the head-summed mass of each block's tokens, renormalised over those blocks:

    target(j) = sum_h sum_{u in block j} p_h(u) / (the same summed over every candidate block)

and the indexer's distribution is softmax(score(t, j)) over the same candidates. The loss is
KL(target || indexer), averaged over queries with at least one candidate. Candidates are every
complete visible block in the dense warm-up and only the selected blocks in the sparse stage, where
p_h is the sparse attention the model actually runs (over the selected tokens).

Recall is the share of the *dense* attention mass (mean over heads) that lands on the selected
tokens: 1.0 means the sparse attention loses nothing.

With packed documents a query's visible tokens and candidate blocks are those of its own document
(blocks aligned to the document's start), so each document's target is what it would be alone.

Everything here needs probabilities [B, heads, S, S]; they are computed a chunk of queries at a time
under no_grad so memory stays bounded (`block_mass_chunk`; models/qsa_stream.py also computes the KL
a chunk at a time, over the selected blocks only in the sparse stage, so no [B, S, S / r] tensor
exists). Under tensor parallelism a rank holds only its own heads: the head sums returned by
`attention_block_mass` are the quantities to all-reduce before normalising
(`IndexedAttention.reduce_heads`, which the TP wrapper makes an all-reduce over tp).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch

_RECALL_MEASURED = False  # a global read in forward: dynamo guards on it (`measuring_recall`)


@contextlib.contextmanager
def measuring_recall():
    """Within it, every uncached QSA forward also measures its recall, the share of the dense
    attention's probability mass inside its selection (`IndexedAttention.last_recall`). A mode of
    the forwards run inside it, as `torch.no_grad` is: evaluation only (a backward's recomputation
    outside it would not measure)."""
    global _RECALL_MEASURED
    before, _RECALL_MEASURED = _RECALL_MEASURED, True
    try:
        yield
    finally:
        _RECALL_MEASURED = before


def recall_measured() -> bool:
    """Whether QSA forwards measure their recall now (`measuring_recall`)."""
    return _RECALL_MEASURED


@torch.no_grad()
def attention_block_mass(
    q_bhsd: torch.Tensor,
    k_bksd: torch.Tensor,
    ratio: int,
    num_blocks: int,
    chunk_elems: int,
    selected_fn: Optional[Callable[[int, int], torch.Tensor]] = None,
    sparse_target: bool = False,
    query_first_bs: Optional[torch.Tensor] = None,
    block_tokens_bm: Optional[torch.Tensor] = None,
    query_rows_s: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal attention of q over k, a chunk of queries at a time (`block_mass_chunk` says what).

    Returns (mass_bsn, recall_bs): the head-summed probability of each complete block's tokens [B,
    S, num_blocks] fp32 and the head-summed dense mass on the selected tokens [B, S] (None without
    `selected_fn`). The training forward streams `block_mass_chunk` instead (models/qsa_stream.py),
    so it never holds [B, S, num_blocks]; this whole-window form is the reference its tests compare
    to."""
    b, h, s_q, _ = q_bhsd.shape
    chunk = max(1, chunk_elems // (b * h * k_bksd.shape[2]))
    masses, recalls = [], []
    for c0 in range(0, s_q, chunk):
        mass, recall = block_mass_chunk(q_bhsd, k_bksd, ratio, num_blocks, c0, min(s_q, c0 + chunk),
                                        selected_fn,
                                        sparse_target, query_first_bs, block_tokens_bm,
                                        query_rows_s)
        masses.append(mass)
        if recall is not None:
            recalls.append(recall)
    return torch.cat(masses, 1), (torch.cat(recalls, 1) if recalls else None)


@torch.no_grad()
def block_mass_chunk(q_bhsd: torch.Tensor, k_bksd: torch.Tensor, ratio: int, num_blocks: int,
                     c0: int, c1: int,
                     selected_fn: Optional[Callable[[int, int], torch.Tensor]] = None,
                     sparse_target: bool = False,
                     query_first_bs: Optional[torch.Tensor] = None,
                     block_tokens_bm: Optional[torch.Tensor] = None,
                     query_rows_s: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor,
                                                                           Optional[torch.Tensor]]:
    """Queries c0..c1 of q's causal attention over k (GQA): (mass [B, C, num_blocks], recall [B, C]
    or None).

    mass: the head-summed probability of each complete block's tokens, fp32, from the attention
    restricted to `selected_fn(c0, c1)` [B, C, S_k] when `sparse_target`, else the dense one;
    recall: the head-summed dense mass on the selected tokens (None without `selected_fn`).

    Query i is key row `query_rows_s[i]` (context parallelism: a rank's rows of the window, whose
    keys k holds in full; None: row i). Packed documents (both given, or neither): `query_first_bs`
    [B, S_q] is the row where each query's document starts, so the dense attention is block-diagonal
    causal, and `block_tokens_bm` [B, num_blocks * ratio] lists the key rows of each block's tokens
    (block j's are entries [j * ratio, (j + 1) * ratio)). Without them block j covers rows [j *
    ratio, (j + 1) * ratio). The mass of a padding block (its listed rows are arbitrary) means
    nothing: the caller never allows it."""
    b, h, _, d = q_bhsd.shape
    s_k = k_bksd.shape[2]
    k_bhsd = k_bksd.repeat_interleave(h // k_bksd.shape[1], dim=1)
    key_u = torch.arange(s_k, device=q_bhsd.device)
    query_c = (torch.arange(c0, c1,
                            device=key_u.device) if query_rows_s is None else query_rows_s[c0:c1])
    with torch.autocast(q_bhsd.device.type, enabled=False):
        logits = torch.matmul(q_bhsd[:, :, c0:c1].float(),
                              k_bhsd.float().transpose(-1, -2)) * d ** -0.5
    causal_cs = key_u[None, :] <= query_c[:, None]
    if query_first_bs is not None:  # [B, C, S]: nor any key before the query's document
        causal_cs = causal_cs & (key_u >= query_first_bs[:, c0:c1, None])
    # summed over heads
    dense_bcs = logits.masked_fill(~causal_cs.unsqueeze(-3), float("-inf")).softmax(-1).sum(1)
    mass, recall = dense_bcs, None
    if selected_fn is not None:
        sel_bcs = selected_fn(c0, c1)
        recall = (dense_bcs * sel_bcs).sum(-1)
        if sparse_target:
            mass = logits.masked_fill(~sel_bcs[:, None], float("-inf")).softmax(-1).sum(1)
    if block_tokens_bm is None:
        mass = mass[..., : num_blocks * ratio]
    else:  # the blocks' tokens in block order, so each block sums its r tokens as above
        mass = mass.gather(-1, block_tokens_bm[:, None].expand(-1, c1 - c0, -1))
    return mass.reshape(b, c1 - c0, num_blocks, ratio).sum(-1), recall


def indexer_kl_terms(scores_bsn: torch.Tensor, mass_bsn: torch.Tensor,
                     allowed_bsn: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per query: (KL(mass renormalised over allowed || softmax(scores) over allowed) [B, S],
    whether it has an allowed block [B, S]). The last dim may be every block or only some (the
    selected ones): the disallowed columns contribute exactly 0 either way. Differentiable in
    `scores_bsn` only; fp32."""
    target = mass_bsn.float().masked_fill(~allowed_bsn, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    # A finite fill (not -inf) keeps rows without any allowed block NaN-free in forward and
    # backward.
    logp = scores_bsn.float().masked_fill(~allowed_bsn, -1e30).log_softmax(-1)
    has_bs = allowed_bsn.any(-1)
    return (torch.xlogy(target, target) - target * logp).sum(-1) * has_bs, has_bs


def indexer_kl(scores_bsn: torch.Tensor, mass_bsn: torch.Tensor,
               allowed_bsn: torch.Tensor) -> torch.Tensor:
    """Mean over queries with an allowed block of KL(mass renormalised over allowed ||
    softmax(scores) over allowed). Differentiable in `scores_bsn` only; fp32."""
    kl_bs, has_bs = indexer_kl_terms(scores_bsn, mass_bsn, allowed_bsn)
    return kl_bs.sum() / has_bs.sum().clamp_min(1)
