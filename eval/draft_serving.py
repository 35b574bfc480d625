"""Drafting as the serving engine drafts: vLLM 0.32's MTP proposer, step by step.

`eval.draft_convention=serving` (the default) drafts depths 2..K the way vLLM's proposer does
(`vllm/v1/spec_decode/llm_base_proposer.py` with `Glm4MoeMTP` / `DeepSeekMTP`, and `Qwen4ExpMTP` in
`vllm/models/qwen4_exp/nvidia/mtp.py`), so the evaluator's acceptance is the figure a user gets when
serving the exported checkpoint; `tandem` drafts as the module was trained (eval/spec_decode.py).
With committed tokens x_0..x_m and trunk states h_0[t] for t <= m-1, one round is:

* depth 1 runs the MTP layer over the positions [valid+1, m-1] not yet seen (inputs h_0[t] and
  x_{t+1}; the trunk's normed state under `mtp.trunk_input=final_norm`) and drafts d_1 from the
  row at m-1, as vLLM's first proposer pass does over the verified tokens;
* depth k = 2..K runs ONE token at position m + k - 2 on the previous depth's output at the last
  row and the token d_{k-1}, and drafts d_k;
* every depth reads and writes ONE KV cache of the MTP layer: depth k's query attends to depth 1's
  entries of positions 0..m-1 and to depths 2..k-1's entries at m..m+k-3 (vLLM's single draft KV
  cache; Tandem's own decoder keeps one cache per depth, as trained);
* for the GLM-4.5 / DeepSeek-V3 combine (`mtp.combine=concat_proj`) the embedding input is zeroed at
  position 0 (`Glm4MoeMultiTokenPredictorLayer`, `DeepSeekMultiTokenPredictorLayer`); Qwen4-Exp's
  drafter (`mtp.combine=qwen4_exp`) does not zero it, and hands the next depth its multi-stream
  (pre-mixer) output while its own stream mixer feeds the head, as `Qwen4ExpMultiTokenPredictor`.

Rollback (models/state.py): the shared cache is position-indexed; after a round its entries are
valid (computed from committed inputs only) up to m-1, where depth 1 stopped. Depths 2..K wrote
m..m+K-2, beyond that prefix, and the next round's depth-1 pass starts at m and rewrites them before
any query reads them, so every forward covers a contiguous range right after the valid prefix.
Batched rows pad their depth-1 range past m-1 (positions continuing past the row's end): those
rows are rewritten by depths 2..K or by the next round before a query at or after them runs.

QSA index reuse (`mtp.qsa_reuse_indices`, vLLM's `index_share_for_mtp_iteration`): depth 1 runs the
MTP layer's indexer and records each query's selection (position-indexed, over committed inputs);
depth k reuses the selection of depth 1's query at m - 1 (the row vLLM's `compact_topk_indices`
keeps: the last accepted token's), read k - 1 positions before its own (`SelectionShare.read_offset`),
and attends exactly what vLLM attends there: that query's whole row, its selected blocks and ITS tail
[m // r * r, m - 1] (r: the compress ratio). vLLM's row is a packed list of token indices
(`vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py`, `_expand_qsa_indices_kernel`: blocks' tokens,
then the tail of the query's own position), `QSAIndexer.forward` returns it untouched under
`skip_topk` (`nvidia/indexer_qsa.py`), and `qsa_sparse_paged_attention` attends only the listed
tokens. So depth k at m + k - 2 attends no block completed after m - 1, nothing at m..m+k-2 (depths
2..k-1's entries) and not its own key: with r = 4, m - 1 = 6 and k = 3, positions 0..6, not 7 or 8.
That gap is serving's, kept here so the acceptance measured is the one serving gets
(tests/unit/test_draft_conventions.py checks it against a cache-free re-derivation).

The convention is defined for the looped style with one physical MTP layer (every recipe's, and
what vLLM's proposer fills: with L > 1 its later layers' caches are never written for the earlier
positions), so other shapes draft as trained (`resolve_convention`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tandem.models.state import DecodeCache

DRAFT_CONVENTIONS = ("serving", "tandem")
"""`serving`: vLLM's proposer (this file); `tandem`: one cache and hidden store per depth, as trained."""


def resolve_convention(model: nn.Module, convention: str, num_steps: int) -> str:
    """The convention a decode of `model` with K=num_steps really uses: `serving` needs a looped MTP
    with one physical layer held by the drafting process (else it drafts as trained: `tandem`, e.g. a
    pipeline placement whose head stage holds no MTP depth). ValueError for an unknown name."""
    if convention not in DRAFT_CONVENTIONS:
        raise ValueError(f"draft_convention={convention!r}: must be one of {', '.join(DRAFT_CONVENTIONS)}")
    mtp = getattr(model, "mtp", None)
    if convention == "tandem" or num_steps <= 0 or mtp is None:
        return convention
    if not mtp.chained or len(mtp.layers) != 1:
        return "tandem"
    if not isinstance(mtp.layers[0], nn.Module):
        # a pipeline placement whose head stage holds no MTP depth: the serving cache would have to live
        # where every depth runs, which no rank does here, so the decoder drafts as trained
        return "tandem"
    return "serving"


class ServingDrafter:
    """The serving convention's draft state for one SpecDecoder batch: one KV cache of the MTP layer
    and the depth-1 valid prefix per row. `draft` has SpecDecoder.draft's contract."""

    def __init__(self, dec):
        self.dec = dec
        model = dec.model
        self.cache = DecodeCache(1, dec.B, dec.cap, dec.dtype, dec.device, ring=dec.ring).layer(0)
        self.valid = torch.full((dec.B,), -1, dtype=torch.long, device=dec.device)
        """[B] last position whose shared-cache entry depth 1 computed from committed inputs."""
        self.zero_first = model.mtp.layer_for_step(1).combine_style == "concat_proj"
        self.final_norm = model.mtp_cfg.trunk_input == "final_norm"

    def step(self, k: int, h_prev: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """MTP depth k on the shared cache (TandemModel.mtp_step plus the serving engine's zeroed
        embedding at position 0 for the concat_proj combine, and depth k's reused QSA selection read
        from depth 1's query at m - 1, k - 1 positions back, attended with that query's tail, as vLLM
        does). `span`: the cache's key prefix (host int)."""
        model = self.dec.model
        self.cache.cache.span = span
        if k == 1 and self.final_norm:
            h_prev = model.norm(h_prev)  # vLLM hands its proposer the trunk's normed output
        emb = model.embed_tokens(tokens)
        if self.zero_first:
            emb = emb.masked_fill((pos == 0).unsqueeze(-1), 0.0)
        model.mtp.select_for_step(k)  # with index reuse: depth 1 records, depths 2..K reuse
        share = getattr(model.mtp, "selection_share", None)
        if share is None:
            return model.mtp.layer_for_step(k)(h_prev, emb, pos, self.cache)
        share.read_offset = k - 1
        try:
            return model.mtp.layer_for_step(k)(h_prev, emb, pos, self.cache)
        finally:
            share.read_offset = 0  # the tandem convention and training read at the query's own position

    def draft(self, force: Optional[torch.Tensor] = None, keep_logits: bool = False):
        dec = self.dec
        model, B, H, m = dec.model, dec.B, dec.H, dec.m
        start = torch.minimum(self.valid + 1, m - 1)
        r = m - start
        R = dec.draft_length(1)  # a host bound: int(r.max()) would stall the round
        pos = (start.unsqueeze(1) + dec.arange[:R]).clamp_(max=dec.cap - 1)
        h0 = dec.h[0].gather(1, pos.unsqueeze(-1).expand(B, R, H))
        out = self.step(1, h0, dec.seq.gather(1, pos + 1), pos, dec.draft_span(R))
        last = out.gather(1, (r - 1).view(B, 1, 1).expand(B, 1, out.shape[-1]))
        drafts, qs, all_logits = [], [], []
        for k in range(1, dec.K + 1):
            if k > 1:  # one token at position m + k - 2: the previous depth's output and its draft
                p = (m + k - 2).unsqueeze(1)
                last = self.step(k, last, dec.seq.gather(1, p + 1), p, dec.span_to(dec.m_hi + k - 2))
            logits = model.logits(k, last)[:, 0]
            d, q = dec._choose(logits)
            if force is not None:
                d = force[:, k - 1]
            dec.seq.scatter_(1, (m + k).unsqueeze(1), d.unsqueeze(1))
            drafts.append(d)
            qs.append(q)
            if keep_logits:
                all_logits.append(logits)
        self.valid = m - 1
        dec.mark_drafted()
        q = torch.stack(qs, 1) if dec.temperature > 0 else None
        return torch.stack(drafts, 1), q, all_logits
