"""QSA ("indexed attention", Qwen4-Exp): gated GQA attention over the positions an indexer selects.

The indexer reads the same hidden states as the attention and scores *blocks* of past tokens:

* `index_qk_proj` gives I query heads and one raw key per token (width D_i). Queries get a
  zero-centred RMSNorm and RoPE at their own positions (the main attention's rotary table, applied to
  the first rotary_dim channels); raw keys are kept un-normalised.
* The visible tokens 0..t of a query at t split into complete blocks of r tokens (block j covers
  [j*r, (j+1)*r)) and an incomplete tail. A block's key is k_layernorm(mean of its raw keys, in
  fp32), roped at the block's start position, and its score is
      score(t, j) = sum_h relu(q_h(t) . k_j) / sqrt(D_i)          (fp32).
* Each query keeps its top min(budget / r, complete blocks) blocks plus every tail token, and the
  main attention (q/k zero-centred RMSNorm, partial RoPE, softmax scale head_dim^-0.5) attends only to
  those. Its output is gated per channel by sigmoid(gate), the second half of each q_proj head.

Selection ties are common (relu makes many scores exactly 0); they break toward the earlier
block, the same way in every form, so training, decoding and verification select alike.

Packed documents (training with `documents`, models/documents.py): every document computes what it
computes alone from position 0. Its blocks start at its first token (block j covers its positions
[j*r, (j+1)*r)), so no block straddles two documents, and one cut short by the document's end is no
block. A row lists its blocks by the row of their first token (`_DocumentBlocks`: at most S // r, the
same count as without documents, padded); a query scores them all but may select only the complete
blocks of its own document visible at its position p, attends them plus its document's tail
[(p+1)//r*r, p], and the dense warm-up, the indexer's KL target and the recall are block-diagonal
causal. Without documents a row is one document and the blocks are [j*r, (j+1)*r) of the row.

Two vectorised training forms give identical results; both pay O(B * S^2 / r) for the block scores:
* `mask`: a [B, S, S] selection mask and one masked SDPA call. O(B * S^2) mask memory, dense
  O(B * H * S^2 * d) compute, but a fused attention kernel.
* `gather`: each query gathers its L = budget + r - 1 candidate key/value rows (invalid slots masked)
  and attends over them: O(B * H * S * L * d) compute. The gathered copies cost B * S * L * kvh * d
  elements, so queries run in chunks of about `chunk_elems` elements, each recomputed in backward
  (activation checkpointing): besides the [B, S, L] slot indices, peak memory stays about
  `chunk_elems` instead of growing with S^2.
`auto` uses gather once the mask would exceed 2^26 elements (an 8k-token row) and the candidates are
at most a quarter of the sequence; below that the fused masked kernel is both smaller and faster.

Decoding (`cache` given) writes keys/values with `cache.update` and the raw indexer keys into the
full-length buffer `qsa_index_keys` [B, max_len, D_i] at their positions. Block keys are recomputed
from the cached prefix in every forward, using only blocks complete at the query ((j+1)*r - 1 <= p),
so rolling back to an accepted prefix needs nothing beyond the caller lowering its lengths.

Indexer training (DeepSeek-V3.2; the reference has none) is set by the trainer through attributes:
`indexer_loss_coef` > 0 attaches KL(main attention || indexer) (see qsa_loss.py) with `AuxLossGrad`;
`dense` is the warm-up stage (dense attention, KL over every complete visible block); otherwise the
KL covers the selected blocks. The indexer always reads detached hidden states: its only gradient
is its own loss (the top-k selection carries none), and that loss never reaches the trunk.

Tensor parallelism (trainer/parallel/tensor_hybrid.py) shards q/k/v/o by heads (head counts are
read from projection widths at run time). The indexer stays replicated and reads the whole input on
every rank, so every rank scores and selects the same positions. Its loss target and the recall sum
over all heads, so the per-rank head sums (`attention_block_mass`) go through `reduce_heads` (the
identity here, an all-reduce over tp in the tensor-parallel module) before they are normalised.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .documents import Documents
from .layers import RMSNorm, RotaryEmbedding
from .moe import AuxLossGrad
from .qsa_index import QSAIndexer, QSASelection, SelectionShare, _DocumentBlocks
from .qsa_loss import attention_block_mass, indexer_kl
from .state import LayerCache

MASK_ELEMS_LIMIT = 1 << 26
"""`auto` switches to the gather form above this many [B, S, S] mask elements."""


def map_query_chunks(fn: Callable, chunk: int, sliced: Tuple[torch.Tensor, ...], shared: Tuple = ()):
    """fn(*sliced, *shared) with `sliced` cut along dim 1 (queries) into chunks, concatenated back.
    Chunks are recomputed in backward, so only one chunk's intermediates are alive at a time."""
    s = sliced[0].shape[1]
    if chunk >= s:
        return fn(*sliced, *shared)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*sliced, *shared) if torch.is_tensor(t))
    outs = []
    for c0 in range(0, s, chunk):
        part = tuple(t[:, c0:c0 + chunk] for t in sliced)
        outs.append(checkpoint(fn, *part, *shared, use_reentrant=False) if grad else fn(*part, *shared))
    return torch.cat(outs, 1)


class IndexedAttention(nn.Module):
    """transformers' `Qwen4ExpTextAttention`: forward(x [B, S, hidden], positions [B, S], cache=None).
    Without a cache the rows are whole sequences from position 0 (training, evaluation), or packed
    documents each from position 0 when `documents` is given; with one, a `models.state.LayerCache`
    slot (decoding, verification: one sequence per row). See the module docstring."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 partial_rotary_factor: float, rope_theta: float, max_seq_len: int, eps: float,
                 indexer_heads: int, indexer_head_dim: int, budget: int, compress_ratio: int, form: str = "auto"):
        super().__init__()
        rotary_dim = int(head_dim * partial_rotary_factor)
        if budget % compress_ratio or budget <= 0:
            raise ValueError(f"QSA budget {budget} must be a positive multiple of compress_ratio {compress_ratio}")
        if rotary_dim > indexer_head_dim:
            raise ValueError(f"QSA indexer head dim {indexer_head_dim} must hold the rotary width {rotary_dim}")
        if form not in ("auto", "mask", "gather"):
            raise ValueError(f"QSA form must be auto, mask or gather, got {form!r}")
        self.head_dim, self.budget, self.compress_ratio, self.form = head_dim, budget, compress_ratio, form
        self.num_heads = num_heads  # all heads, whatever a rank holds: the recall's normaliser
        # q_proj emits [query | gate] per head (transformers' Qwen3.5 gated attention)
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered=True)
        self.indexer = QSAIndexer(hidden_size, indexer_heads, indexer_head_dim, eps)
        self.rotary = RotaryEmbedding(head_dim, rotary_dim, rope_theta, max_seq_len)
        # Set by the trainer / evaluator (plain attributes, not config):
        self.indexer_loss_coef: float = 0.0
        """Weight of the indexer's KL loss (0: none)."""
        self.dense: bool = False
        """Dense warm-up stage: attend to every visible token; the KL covers all complete blocks."""
        self.measure_recall: bool = False
        """Compute `last_recall` (dense attention mass inside the selection) in uncached forwards."""
        self.selection_share: Optional[SelectionShare] = None
        """Set on the MTP's QSA layers with mtp.qsa_reuse_indices, for decoding: depth 1 records its
        selection, later depths reuse it instead of running the indexer (None: every forward selects
        for itself). Training hands the selection over explicitly (`QSASelection`)."""
        self.chunk_elems: int = 1 << 26
        """Largest intermediate (elements) a chunked computation may build at once."""
        self.last_indexer_loss: Optional[torch.Tensor] = None
        self.last_recall: Optional[torch.Tensor] = None

    def reduce_heads(self, head_sums: torch.Tensor) -> torch.Tensor:
        """Sum of per-head quantities over every head of the layer. One process holds them all: the
        identity; tensor parallelism overrides it with an all-reduce over its ranks' heads."""
        return head_sums

    # ---- the main attention's projections -------------------------------------------------------
    def _qkv(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor):
        b, s, _ = x_bsh.shape
        # head counts come from the projection widths, so tensor parallelism needs no change here
        q, gate = self.q_proj(x_bsh).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x_bsh).view(b, s, -1, self.head_dim)
        v = self.v_proj(x_bsh).view(b, s, -1, self.head_dim)
        q_bhsd = self.rotary(self.q_norm(q).transpose(1, 2), positions_bs)
        k_bksd = self.rotary(self.k_norm(k).transpose(1, 2), positions_bs)
        return q_bhsd, k_bksd, v.transpose(1, 2), gate.reshape(b, s, -1)

    def _block_scores(self, q_idx_bsid, raw_bsd, starts_bn) -> torch.Tensor:
        """Block scores [B, S, N] over the N = len(starts_bn) blocks that `raw_bsd` holds, in query chunks."""
        b, s, i, _ = q_idx_bsid.shape
        n = starts_bn.shape[1]
        if n == 0:
            return q_idx_bsid.new_zeros(b, s, 0, dtype=torch.float32)
        k_bnd = self.indexer.block_keys(raw_bsd, starts_bn, self.rotary)
        chunk = max(1, self.chunk_elems // (b * i * n))
        return map_query_chunks(self.indexer.block_scores, chunk, (q_idx_bsid,), (k_bnd,))

    # ---- selection ------------------------------------------------------------------------------
    def _select(self, scores_bsn: torch.Tensor, query_at_bs: torch.Tensor,
                visible_bsn: Optional[torch.Tensor] = None):
        """Top blocks per query among its complete visible ones: indices [B, S, K] and how many of the
        K slots are real, min(budget / r, complete blocks) [B, S]. `query_at_bs`: positions (within the
        document); `visible_bsn`: the selectable blocks under packed documents (there are (p+1) // r
        of them), else blocks 0 .. (p+1) // r - 1."""
        r, n = self.compress_ratio, scores_bsn.shape[-1]
        complete_bs = (query_at_bs + 1) // r
        k = min(self.budget // r, n)
        if k == 0:
            return query_at_bs.new_zeros(*query_at_bs.shape, 0), complete_bs * 0
        # Scores are >= 0, so their fp32 bit patterns order like the values; the block index in the low
        # bits makes every key unique (ties -> the earlier block) and the top-k exactly reproducible.
        bits = scores_bsn.detach().float().contiguous().view(torch.int32).long()
        block = torch.arange(n, device=scores_bsn.device)
        if visible_bsn is None:
            visible_bsn = block < complete_bs[..., None]
        key = torch.where(visible_bsn, (bits << 31) | (2**31 - 1 - block), -1)
        return key.topk(k, dim=-1).indices, complete_bs.clamp(max=k)

    def _token_mask(self, blocks_bsk, count_bs, query_at_bs, num_keys: int,
                    docs: Optional[_DocumentBlocks] = None, c0: int = 0) -> torch.Tensor:
        """[B, S, num_keys]: tokens of the selected blocks plus the visible tail. `docs`: packed
        documents' blocks; the queries are then rows c0 .. c0 + S - 1 of its window."""
        r = self.compress_ratio
        key_u = torch.arange(num_keys, device=query_at_bs.device)
        at = query_at_bs[..., None]
        if docs is None:
            mask = (key_u >= (at + 1) // r * r) & (key_u <= at)
        else:
            first = docs.first_bs[:, c0:c0 + query_at_bs.shape[1], None]
            mask = (key_u >= first + (at + 1) // r * r) & (key_u <= first + at)
        n, k = num_keys // r, blocks_bsk.shape[-1]
        if k:
            real = torch.arange(k, device=key_u.device) < count_bs[..., None]
            chosen = blocks_bsk.new_zeros(*blocks_bsk.shape[:-1], n + 1, dtype=torch.bool)
            chosen.scatter_(-1, torch.where(real, blocks_bsk, n), True)  # unused slots land in column n
            if docs is None:
                mask[..., : n * r] |= chosen[..., :n].repeat_interleave(r, dim=-1)
            else:
                chosen[..., n] = False  # the column of the tokens in no block
                mask |= chosen.gather(-1, docs.key_block_bs[:, None].expand(-1, mask.shape[1], -1))
        return mask

    def _token_slots(self, blocks_bsk, count_bs, query_at_bs, docs: Optional[_DocumentBlocks] = None):
        """The gather form's candidates: token indices [B, S, L] (L <= budget + r - 1) and validity.
        `docs`: packed documents' blocks (the indices are rows; the queries, the window's S rows)."""
        r, k = self.compress_ratio, blocks_bsk.shape[-1]
        dev = query_at_bs.device
        if docs is None:
            block_row = blocks_bsk * r
            tail_row, last_row = (query_at_bs + 1) // r * r, query_at_bs
        else:
            block_row = docs.rows_bn.gather(1, blocks_bsk.flatten(1)).view_as(blocks_bsk)
            tail_row = docs.first_bs + (query_at_bs + 1) // r * r
            last_row = docs.first_bs + query_at_bs
        block_tok = (block_row[..., None] + torch.arange(r, device=dev)).flatten(-2)
        block_ok = (torch.arange(k, device=dev) < count_bs[..., None]).repeat_interleave(r, dim=-1)
        tail_tok = tail_row[..., None] + torch.arange(r - 1, device=dev)
        tail_ok = tail_tok <= last_row[..., None]
        ok = torch.cat([block_ok, tail_ok], -1)
        return torch.where(ok, torch.cat([block_tok, tail_tok], -1), 0), ok

    # ---- attention forms --------------------------------------------------------------------------
    @staticmethod
    def _gather_attend(q_bshd, idx_bsl, ok_bsl, k_bskd, v_bskd):
        """Each query attends over its own gathered key/value rows (the gather form)."""
        b, c, h, d = q_bshd.shape
        s, kvh, L = k_bskd.shape[1], k_bskd.shape[2], idx_bsl.shape[-1]
        rows = (idx_bsl + torch.arange(b, device=idx_bsl.device)[:, None, None] * s).reshape(-1)
        k_g = k_bskd.reshape(b * s, kvh * d).index_select(0, rows).view(b, c, L, kvh, d)
        v_g = v_bskd.reshape(b * s, kvh * d).index_select(0, rows).view(b, c, L, kvh, d)
        q5 = q_bshd.reshape(b, c, kvh, h // kvh, d)
        # Logits, softmax and the weighted sum in fp32 from the (bf16) rows, as the mask form's SDPA
        # accumulates: a bf16 einsum rounded every logit to bf16 first, so `auto`'s switch of form at
        # MASK_ELEMS_LIMIT changed the numerics. The fp32 copies live for one checkpointed query chunk;
        # autocast is off around them (einsum's bmm would cast them back).
        acc = torch.promote_types(q_bshd.dtype, torch.float32)
        with torch.autocast(q_bshd.device.type, enabled=False):
            att = torch.einsum("bckgd,bclkd->bckgl", q5.to(acc), k_g.to(acc)) * d ** -0.5
            att = att.masked_fill(~ok_bsl[:, :, None, None, :], float("-inf")).softmax(-1)
            out = torch.einsum("bckgl,bclkd->bckgd", att, v_g.to(acc))
        return out.reshape(b, c, h * d).to(q_bshd.dtype)

    def _use_gather(self, b: int, s: int) -> bool:
        if self.form != "auto":
            return self.form == "gather"
        return b * s * s > MASK_ELEMS_LIMIT and 4 * (self.budget + self.compress_ratio - 1) <= s

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor, cache: Optional[LayerCache] = None,
                selection: Optional[QSASelection] = None, return_selection: bool = False,
                documents: Optional[Documents] = None) -> Union[torch.Tensor, Tuple[torch.Tensor,
                                                                                    Optional[QSASelection]]]:
        """`selection` (training, sparse stage): attend over these blocks instead of running the indexer
        (MTP depths 2..K reusing depth 1's). `return_selection`: also return the selection attended
        (None in the dense stage, where nothing is selected). `documents` (training only): the packed
        documents each row holds, kept apart; `positions_bs` then count from each document's start
        (`documents.positions()`). None: each row is one document."""
        q_bhsd, k_bksd, v_bksd, gate_bsz = self._qkv(x_bsh, positions_bs)
        # The selection carries no gradient and the indexer learns only from its own loss.
        q_idx_bsid, raw_bsd = self.indexer(x_bsh.detach(), positions_bs, self.rotary)
        used = None
        if cache is not None:
            if documents is not None:
                raise ValueError("QSA decodes one document per row: documents are for training forwards")
            out_bsz, loss = self._decode(q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs, cache), None
        else:
            out_bsz, loss, used = self._train(q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs, selection,
                                              documents)
        y_bsh = self.o_proj(out_bsz * torch.sigmoid(gate_bsz))
        if loss is not None:
            # gradient injected in backward (as the MoE's aux loss): return values stay unchanged
            y_bsh = AuxLossGrad.apply(y_bsh, loss, float(self.indexer_loss_coef))
        return (y_bsh, used) if return_selection else y_bsh

    def _train(self, q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs, reused: Optional[QSASelection],
               documents: Optional[Documents] = None):
        s = q_bhsd.shape[2]
        n = s // self.compress_ratio
        # the dense warm-up attends to everything: a handed-over selection has nothing to restrict
        reused = reused if not self.dense else None
        # a reusing depth runs no indexer, so it has no indexer loss either; a query needs a complete
        # block before the indexer has anything to learn
        want_loss = (self.indexer_loss_coef > 0 and self.training and torch.is_grad_enabled() and n > 0
                     and reused is None)
        select = not self.dense or self.measure_recall
        docs, query_at_bs = self._training_layout(q_bhsd, reused, documents)
        scores_bsn, blocks_bsk, count_bs = self._training_selection(q_idx_bsid, raw_bsd, positions_bs, reused, docs,
                                                                    query_at_bs, want_loss, select)

        def selected(c0: int, c1: int) -> torch.Tensor:
            return self._token_mask(blocks_bsk[:, c0:c1], count_bs[:, c0:c1], query_at_bs[:, c0:c1], s, docs, c0)

        out_bsz = self._training_attention(q_bhsd, k_bksd, v_bksd, documents, docs, blocks_bsk, count_bs,
                                           query_at_bs, selected)
        loss = None
        if want_loss or self.measure_recall:
            loss = self._indexer_target(q_bhsd, k_bksd, scores_bsn, blocks_bsk, count_bs, query_at_bs, docs,
                                        selected if select else None, want_loss)
        used = (QSASelection(blocks_bsk, count_bs, None if docs is None else docs.rows_bn)
                if blocks_bsk is not None and not self.dense else None)
        return out_bsz, loss, used

    def _training_layout(self, q_bhsd, reused: Optional[QSASelection], documents: Optional[Documents]):
        """(the packed documents' block layout or None, [B, S] each query's position in its document)."""
        b, _, s, _ = q_bhsd.shape
        if reused is not None and (reused.block_rows_bn is None) != (documents is None):
            raise RuntimeError("QSA: a selection made " + ("without" if documents is not None else "with")
                               + " packed documents was handed to a forward " + ("with" if documents is not None
                                                                                  else "without") + " them")
        if documents is None:
            return None, torch.arange(s, device=q_bhsd.device).expand(b, s)
        # a reused selection's indices name blocks of the layout it was chosen in: read them there
        r = self.compress_ratio
        rows_bn = reused.block_rows_bn if reused is not None else _DocumentBlocks.block_rows(documents.starts_bs, r)
        docs = _DocumentBlocks.build(documents.starts_bs, rows_bn, r)
        return docs, docs.at_bs

    def _training_selection(self, q_idx_bsid, raw_bsd, positions_bs, reused: Optional[QSASelection], docs,
                            query_at_bs, want_loss: bool, select: bool):
        """(block scores or None, selected blocks, their counts): a reused selection as handed over,
        else the indexer's scores (with autograd when its loss trains) and their top blocks."""
        b, s = query_at_bs.shape
        if reused is not None:
            if reused.blocks_bsk.shape[:2] != (b, s):
                raise RuntimeError(f"QSA: a reused selection covers {tuple(reused.blocks_bsk.shape[:2])} queries, "
                                   f"this forward {(b, s)}")
            return None, reused.blocks_bsk, reused.counts_bs
        r = self.compress_ratio
        n = s // r
        scores_bsn = blocks_bsk = count_bs = None
        if want_loss or select:
            with torch.set_grad_enabled(want_loss):
                if docs is None:
                    scores_bsn = self._block_scores(q_idx_bsid, raw_bsd[:, : n * r], positions_bs[:, : n * r : r])
                else:
                    raw_bmd = raw_bsd.gather(1, docs.tokens_bm[..., None].expand(-1, -1, raw_bsd.shape[-1]))
                    scores_bsn = self._block_scores(q_idx_bsid, raw_bmd, docs.positions_bn)
        if select:
            blocks_bsk, count_bs = self._select(scores_bsn, query_at_bs, None if docs is None else docs.visible(r))
        return scores_bsn, blocks_bsk, count_bs

    def _training_attention(self, q_bhsd, k_bksd, v_bksd, documents, docs, blocks_bsk, count_bs, query_at_bs,
                            selected) -> torch.Tensor:
        """[B, S, heads * head_dim]: dense (the warm-up), or over the selected tokens by gathering them
        or by a [B, S, S] mask (`selected(c0, c1)` gives query rows c0..c1 of it)."""
        b, h, s, d = q_bhsd.shape
        groups = h // k_bksd.shape[1]
        if self.dense:
            if documents is None:
                out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, is_causal=True, enable_gqa=groups > 1)
            else:
                out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, attn_mask=documents.attention_mask(),
                                                     enable_gqa=groups > 1)
            return out.transpose(1, 2).reshape(b, s, -1)
        if self._use_gather(b, s):
            idx_bsl, ok_bsl = self._token_slots(blocks_bsk, count_bs, query_at_bs, docs)
            per_query = b * idx_bsl.shape[-1] * (2 * k_bksd.shape[1] * d + h)
            return map_query_chunks(self._gather_attend, max(1, self.chunk_elems // per_query),
                                    (q_bhsd.transpose(1, 2), idx_bsl, ok_bsl),
                                    (k_bksd.transpose(1, 2), v_bksd.transpose(1, 2)))
        mask_b1ss = selected(0, s)[:, None]
        out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, attn_mask=mask_b1ss, enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(b, s, -1)

    def _indexer_target(self, q_bhsd, k_bksd, scores_bsn, blocks_bsk, count_bs, query_at_bs, docs, selected,
                        want_loss: bool):
        """The main attention's block mass: the recall of the selection (measure_recall) and, when the
        indexer trains, its KL loss (None otherwise)."""
        r = self.compress_ratio
        n = q_bhsd.shape[2] // r
        mass_bsn, recall_bs = attention_block_mass(
            q_bhsd.detach(), k_bksd.detach(), r, n, self.chunk_elems, selected,
            sparse_target=not self.dense, query_first_bs=None if docs is None else docs.first_bs,
            block_tokens_bm=None if docs is None else docs.tokens_bm)
        if self.measure_recall:
            self.last_recall = self.reduce_heads(recall_bs).mean() / self.num_heads
        if not want_loss:
            return None
        block = torch.arange(n, device=q_bhsd.device)
        if self.dense:
            allowed_bsn = block < ((query_at_bs + 1) // r)[..., None] if docs is None else docs.visible(r)
        else:
            real = torch.arange(blocks_bsk.shape[-1], device=block.device) < count_bs[..., None]
            allowed_bsn = torch.zeros_like(scores_bsn, dtype=torch.bool)
            allowed_bsn.scatter_(-1, blocks_bsk, real)
        loss = indexer_kl(scores_bsn, self.reduce_heads(mass_bsn), allowed_bsn)
        self.last_indexer_loss = loss.detach()
        return loss

    def _decode(self, q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs, cache: LayerCache):
        r = self.compress_ratio
        k_all, v_all = cache.update(k_bksd, v_bksd, positions_bs)  # [B, kvh, span, d]
        span = k_all.shape[2]
        keys_bld = cache.buffer("qsa_index_keys", (raw_bsd.shape[-1],), length=cache.max_len)
        keys_bld.scatter_(1, positions_bs[..., None].expand(-1, -1, raw_bsd.shape[-1]), raw_bsd.to(keys_bld.dtype))
        if self.dense:
            mask_bts = torch.arange(span, device=positions_bs.device) <= positions_bs[..., None]
        else:
            # Block keys from the cached prefix every time: a block is used only by queries at or after its
            # last token, which this forward (or an earlier one) has just written, so rollback is free.
            share = self.selection_share
            tail_at_bs = positions_bs  # the query whose tail [(t+1) // r * r, t] is attended
            if share is not None and share.mode == "reuse":
                # A reusing query attends the source query's whole selection row, its blocks AND its tail,
                # as vLLM 0.32 does: its reusing draft steps (`set_skip_topk(True)`) attend verbatim the
                # packed token-index row depth 1's query at m - 1 wrote (`expand_qsa_block_indices`: the
                # blocks' tokens, then that query's tail), kept by `compact_topk_indices`. With
                # read_offset k - 1 (the serving convention) depth k at m + k - 2 therefore attends
                # nothing at m or later (not even its own key) and no block completed after m - 1:
                # serving's gap, kept so the acceptance measured here is what serving gets. With
                # read_offset 0 (training, the tandem convention) the source is the query itself.
                tail_at_bs = (positions_bs - share.read_offset).clamp(min=0)
                blocks_bsk, count_bs = self._reused(cache, tail_at_bs)
            else:
                n = span // r
                starts_bn = (torch.arange(n, device=positions_bs.device) * r).expand(positions_bs.shape[0], n)
                scores_bsn = self._block_scores(q_idx_bsid, keys_bld[:, : n * r].to(raw_bsd.dtype), starts_bn)
                blocks_bsk, count_bs = self._select(scores_bsn, positions_bs)
                if share is not None and share.mode == "record":
                    self._record(cache, positions_bs, blocks_bsk, count_bs)
            mask_bts = self._token_mask(blocks_bsk, count_bs, tail_at_bs, span)
        groups = q_bhsd.shape[1] // k_all.shape[1]
        out = F.scaled_dot_product_attention(q_bhsd, k_all.to(q_bhsd.dtype), v_all.to(q_bhsd.dtype),
                                             attn_mask=mask_bts[:, None], enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(q_bhsd.shape[0], q_bhsd.shape[2], -1)

    def _record(self, cache: LayerCache, positions_bs, blocks_bsk, count_bs) -> None:
        """Depth 1 writes each query's selection at its position (padded to budget / r slots)."""
        k = self.budget // self.compress_ratio
        store = cache.shared_buffer("qsa_reuse_blocks", (k,), torch.long)
        counts = cache.shared_buffer("qsa_reuse_counts", (), torch.long)
        padded = F.pad(blocks_bsk, (0, k - blocks_bsk.shape[-1]))
        store.scatter_(1, positions_bs[..., None].expand(-1, -1, k), padded)
        counts.scatter_(1, positions_bs, count_bs)

    def _reused(self, cache: LayerCache, source_bs):
        """Depth 1's selection at positions `source_bs` (blocks complete there are complete here too); the
        caller attends them with the tail of `source_bs`, not of its own position (see `_decode`)."""
        store = cache.shared_buffer("qsa_reuse_blocks", (self.budget // self.compress_ratio,), torch.long)
        counts = cache.shared_buffer("qsa_reuse_counts", (), torch.long)
        src = source_bs.clamp(min=0)
        return store.gather(1, src[..., None].expand(-1, -1, store.shape[-1])), counts.gather(1, src)
