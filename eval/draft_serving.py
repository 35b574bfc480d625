"""Drafting as the serving engine drafts: vLLM 0.32's MTP proposer, step by step.

`eval.draft_convention=serving` (the default) drafts depths 2..K the way vLLM's proposer does
(`vllm/v1/spec_decode/llm_base_proposer.py` with `Glm4MoeMTP` / `DeepSeekMTP`, and `Qwen4ExpMTP` in
`vllm/models/qwen4_exp/nvidia/mtp.py`), so the evaluator's acceptance is the figure a user gets when
serving the exported checkpoint; `tandem` drafts as the module was trained (eval/drafting.py, which
also holds the `Drafter` protocol this file implements).
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
keeps: the last accepted token's), read k - 1 positions before its own
(`SelectionShare.read_offset`), and attends exactly what vLLM attends there: that query's whole row,
its selected blocks and ITS tail [m // r * r, m - 1] (r: the compress ratio). vLLM's row is a packed
list of token indices (`vllm/models/qwen4_exp/nvidia/ops/qsa_indexer.py`,
`_expand_qsa_indices_kernel`: blocks' tokens, then the tail of the query's own position),
`QSAIndexer.forward` returns it untouched under `skip_topk` (`nvidia/indexer_qsa.py`), and
`qsa_sparse_paged_attention` attends only the listed tokens. So depth k at m + k - 2 attends no
block completed after m - 1, nothing at m..m+k-2 (depths 2..k-1's entries) and not its own key: with
r = 4, m - 1 = 6 and k = 3, positions 0..6, not 7 or 8. That gap is serving's, kept here so the
acceptance measured is the one serving gets (tests/unit/test_draft_conventions.py checks it against
a cache-free re-derivation).

The convention is defined for the looped style with one physical MTP layer (every recipe's, and
what vLLM's proposer fills: with L > 1 its later layers' caches are never written for the earlier
positions), so other shapes draft as trained (drafting.resolve_convention).
"""

from __future__ import annotations

from functools import partial
from typing import Iterator

import torch

from tandem.models.state import DecodeCache

from .decode_batch import DecodeBatch


def serving_step(model, cache, k: int, h_prev: torch.Tensor, tokens: torch.Tensor,
                 pos: torch.Tensor, span: int) -> torch.Tensor:
    """MTP depth k of `model` (which holds the MTP layer) on the serving convention's shared
    `cache`: the layer on h_prev and the tokens' embedding, zeroed at position 0 for the
    concat_proj combine, with depth k's reused QSA selection read from depth 1's query at m - 1,
    k - 1 positions back, attended with that query's tail, as vLLM does. `span`: the cache's key
    prefix (host int). A pipeline rank holding the layer runs this for a driver that does not
    (trainer/parallel/pipeline_decode.py)."""
    cache.cache.span = span
    layer = model.mtp.layer_for_step(k)
    emb = model.embed_tokens(tokens)
    if model.mtp.layer_for_step(1).combine_style == "concat_proj":
        emb = emb.masked_fill((pos == 0).unsqueeze(-1), 0.0)
    model.mtp.select_for_step(k)  # with index reuse: depth 1 records, depths 2..K reuse
    share = getattr(model.mtp, "selection_share", None)
    if share is None:
        return layer(h_prev, emb, pos, cache)
    share.read_offset = k - 1
    try:
        return layer(h_prev, emb, pos, cache)
    finally:
        # the tandem convention and training read at the query's own position
        share.read_offset = 0


class ServingDrafter:
    """The serving convention's draft state for one DecodeBatch: one KV cache of the MTP layer and
    the depth-1 valid prefix per row. Implements drafting.Drafter."""

    def __init__(self, batch: DecodeBatch):
        self.batch = batch
        model = batch.model
        self.cache = DecodeCache(1, batch.B, batch.cap, batch.dtype, batch.device,
                                 ring=batch.ring).layer(0)
        self.valid = torch.full((batch.B,), -1, dtype=torch.long, device=batch.device)
        """[B] last position whose shared-cache entry depth 1 computed from committed inputs."""
        self.final_norm = model.mtp_cfg.trunk_input == "final_norm"
        # a pipeline driver's view of the model runs the step where the MTP layer is, on that
        # rank's shared cache (trainer/parallel/pipeline_decode.PipelinedModel.serving_step)
        self.run_step = getattr(model, "serving_step", None) or partial(serving_step, model)

    def step(self, k: int, h_prev: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
             span: int) -> torch.Tensor:
        """MTP depth k on the shared cache (`serving_step`), h_prev normed first at depth 1 under
        mtp.trunk_input=final_norm (vLLM hands its proposer the trunk's normed output)."""
        if k == 1 and self.final_norm:
            h_prev = self.batch.model.norm(h_prev)
        return self.run_step(self.cache, k, h_prev, tokens, pos, span)

    def depth_logits(self) -> Iterator[torch.Tensor]:
        """Depth 1 over the committed positions it has not seen, then depth k = 2..K one token
        each."""
        b = self.batch
        model, B, H, m = b.model, b.B, b.H, b.m
        start = torch.minimum(self.valid + 1, m - 1)
        r = m - start
        R = b.range_length(behind=0)  # a host bound: int(r.max()) would stall the round
        pos = (start.unsqueeze(1) + b.arange[:R]).clamp_(max=b.cap - 1)
        h0 = b.hidden.gather(1, pos.unsqueeze(-1).expand(B, R, H))
        out = self.step(1, h0, b.seq.gather(1, pos + 1), pos, b.range_span(R))
        last = out.gather(1, (r - 1).view(B, 1, 1).expand(B, 1, out.shape[-1]))
        for k in range(1, b.K + 1):
            if k > 1:  # one token at position m + k - 2: the previous depth's output and its draft
                p = (m + k - 2).unsqueeze(1)
                last = self.step(k, last, b.seq.gather(1, p + 1), p, b.span_to(b.m_hi + k - 2))
            yield model.logits(k, last)[:, 0]
        self.valid = m - 1
