"""QSA ("indexed attention", Qwen4-Exp): gated GQA attention over the positions an indexer selects.

The indexer reads the same hidden states as the attention and scores *blocks* of past tokens:

* `index_qk_proj` gives I query heads and one raw key per token (width D_i). Queries get a
  zero-centred RMSNorm and RoPE at their own positions (the main attention's rotary table, applied
  to the first rotary_dim channels); raw keys are kept un-normalised.
* The visible tokens 0..t of a query at t split into complete blocks of r tokens (block j covers
  [j*r, (j+1)*r)) and an incomplete tail. A block's key is k_layernorm(mean of its raw keys, in
  fp32), roped at the block's start position, and its score is
      score(t, j) = sum_h relu(q_h(t) . k_j) / sqrt(D_i)          (fp32).
* Each query keeps its top min(budget / r, complete blocks) blocks plus every tail token, and the
  main attention (q/k zero-centred RMSNorm, partial RoPE, softmax scale head_dim^-0.5) attends only
  to those. Its output is gated per channel by sigmoid(gate), the second half of each q_proj head.

Selection ties are common (relu makes many scores exactly 0); they break toward the earlier
block, the same way in every form, so training, decoding and verification select alike.

Packed documents (training with `documents`, models/documents.py): every document computes what it
computes alone from position 0. Its blocks start at its first token (block j covers its positions
[j*r, (j+1)*r)), so no block straddles two documents, and one cut short by the document's end is no
block. A row lists its blocks by the row of their first token (`DocumentBlocks`: at most S // r,
the same count as without documents, padded); a query scores them all but may select only the
complete blocks of its own document visible at its position p, attends them plus its document's tail
[(p+1)//r*r, p], and the dense warm-up, the indexer's KL target and the recall are block-diagonal
causal. Without documents a row is one document and the blocks are [j*r, (j+1)*r) of the row.

Two vectorised training forms give identical results; both pay O(B * S^2 / r) compute for the block
scores, never the memory: selection and the indexer's target stream (models/qsa_stream.py), a chunk
of queries and, within it, of blocks at a time with a running top-k, and the sparse stage's KL
covers only the K = budget / r selected blocks, so no [B, S, S / r] tensor exists.
* `mask`: a [B, S, S] selection mask and one masked SDPA call. O(B * S^2) mask memory, dense
  O(B * H * S^2 * d) compute, but a fused attention kernel.
* `gather`: each query gathers its L = budget + r - 1 candidate key/value rows (invalid slots
  masked) and attends over them: O(B * H * S * L * d) compute. The gathered copies cost B * S * L *
  kvh * d elements, so queries run in chunks of about `chunk_elems` elements, each recomputed in
  the form's own backward (qsa_tokens.GatheredAttention, K and V gradients added into one buffer):
  besides the [B, S, L] slot indices, peak memory stays about `chunk_elems` instead of growing
  with S^2, and the backward's work per query does not grow with the number of chunks.
`auto` uses gather past a 2^26-element mask (an 8k-token row) with candidates at most a quarter of
the sequence; below that the fused masked kernel is smaller and faster.

Context parallelism (`context` a sharded models/context.py window, training only): x holds a rank's
S / cp rows of the window of S. Keys and values (after norm and RoPE), the indexer's raw keys, the
positions and the documents' starts are gathered over the window (`context.gather`; its backward
sums key and value gradients back to their owners); the rank's queries score every block of the
window, so each selects, attends and learns exactly as in one process (the same scores, ties and
budget; the dense warm-up masks keys after the query's window row). The indexer's KL sums this
rank's queries' terms over the window's count of queries with a candidate block, so the ranks'
losses (and indexer gradients) sum to one process's: `last_indexer_loss` is the rank's share,
`last_recall` its mean (equal row counts: the ranks' recalls average to the window's). A
handed-over `QSASelection` holds the rank's queries and the window's block layout; a sparse-stage
forward given one (an MTP depth reusing depth 1's) runs no indexer and gathers no raw keys.

Peak memory of one layer's training step, per rank (bytes, fp32; B rows, D_i indexer width, E =
`chunk_elems`, A = hidden + 4 * heads * head_dim + (I + 1) * D_i the per-row activations):
    B * (S / cp) * (8 * K + 33 * L + 4 * A)           selection, gather slots (and their making),
                                                      activations
  + 4 * B * S * (4 * kvh * head_dim + 2 * D_i)        the gathered window's keys, values, raw keys,
                                                      grads
  + about 16 * E                                      one chunk's transients
in the gather form (the mask form adds its B * (S / cp) * S bool mask); bench/qsa_memory.py measures
it against these terms.

Decoding (`cache` given) writes keys/values with `cache.update` and, where the query selects (not
an MTP depth reusing depth 1's selection), the raw indexer keys into the full-length buffer
`qsa_index_keys` [B, max_len, D_i] at their positions. Block keys are recomputed from the cached
prefix in every forward, using only blocks complete at the query ((j+1)*r - 1 <= p), so rolling back
to an accepted prefix needs nothing beyond the caller lowering its lengths.

Indexer training (DeepSeek-V3.2; the reference has none): `indexer_loss_coef` > 0 (a constructor
argument, model.indexer_loss_coef) attaches KL(main attention || indexer) (see qsa_loss.py) with
`AuxLossGrad`, weighted by the coefficient times the forward's `aux_grad_scale`; the forward
argument `dense` is the warm-up stage (dense attention, KL over every complete visible block);
otherwise the KL covers the selected blocks. Decoding is always sparse, the form that is served.
The indexer always reads detached hidden states: its only gradient is its own loss (the top-k
selection carries none), and that loss never reaches the trunk.

Tensor parallelism (trainer/parallel/tensor_hybrid.py) shards q/k/v/o by heads (head counts are
read from projection widths at run time). The indexer stays replicated and reads the whole input on
every rank, so every rank scores and selects the same positions. Its loss target and the recall sum
over all heads, so the per-rank head sums (`attention_block_mass`) go through `reduce_heads` (the
identity here, an all-reduce over tp in the tensor-parallel module) before they are normalised.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .context import WholeWindow
from .documents import Documents
from .layers import (
    InitRule,
    InitScales,
    RMSNorm,
    RotaryEmbedding,
    cached_attention,
    count_loss,
    loss_counter,
)
from .moe import AuxLossGrad
from .qsa_index import DocumentBlocks, QSAIndexer, QSASelection, SelectionShare
from .qsa_loss import recall_measured
from .qsa_stream import map_query_chunks, selection_keys, stream_select, stream_target
from .qsa_tokens import gather_attend, token_mask, token_slots
from .state import LayerCache

MASK_ELEMS_LIMIT = 1 << 26
"""`auto` switches to the gather form above this many [B, S, S] mask elements."""

class IndexedAttention(nn.Module):
    """transformers' `Qwen4ExpTextAttention`: forward(x [B, S, hidden], positions [B, S],
    cache=None). Without a cache the rows are whole sequences from position 0 (training,
    evaluation), or packed documents each from position 0 when `documents` is given; with one, a
    `models.state.LayerCache` slot (decoding, verification: one sequence per row). See the module
    docstring."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 partial_rotary_factor: float, rope_theta: float, max_seq_len: int, eps: float,
                 indexer_heads: int, indexer_head_dim: int, budget: int, compress_ratio: int,
                 form: str = "auto", indexer_loss_coef: float = 0.0):
        super().__init__()
        rotary_dim = int(head_dim * partial_rotary_factor)
        if budget % compress_ratio or budget <= 0:
            raise ValueError(f"QSA budget {budget} must be a positive multiple of compress_ratio "
                             f"{compress_ratio}")
        if rotary_dim > indexer_head_dim:
            raise ValueError(f"QSA indexer head dim {indexer_head_dim} must hold the rotary width "
                             f"{rotary_dim}")
        if form not in ("auto", "mask", "gather"):
            raise ValueError(f"QSA form must be auto, mask or gather, got {form!r}")
        self.head_dim, self.budget, self.compress_ratio, self.form = (
            head_dim,
            budget,
            compress_ratio,
            form,
        )
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
        self.indexer_loss_coef = indexer_loss_coef
        """Weight of the indexer's KL loss in training forwards (0: none)."""
        self.selection_share: Optional[SelectionShare] = None
        """Set on the MTP's QSA layers with mtp.qsa_reuse_indices, for decoding: depth 1 records its
        selection, later depths reuse it instead of running the indexer (None: every forward selects
        for itself). Training hands the selection over explicitly (`QSASelection`)."""
        self.chunk_elems: int = 1 << 26  # largest intermediate (elements) a chunk may build
        self.last_indexer_loss: Optional[torch.Tensor] = None
        self.register_buffer("indexer_loss_sum", loss_counter(), persistent=False)
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
        """Block scores [B, S, N] over the N = len(starts_bn) blocks that `raw_bsd` holds, in query
        chunks."""
        b, s, i, _ = q_idx_bsid.shape
        n = starts_bn.shape[1]
        if n == 0:
            return q_idx_bsid.new_zeros(b, s, 0, dtype=torch.float32)
        k_bnd = self.indexer.block_keys(raw_bsd, starts_bn, self.rotary)
        chunk = max(1, self.chunk_elems // (b * i * n))
        return map_query_chunks(self.indexer.block_scores, chunk, (q_idx_bsid,), (k_bnd,))

    # ---- selection ------------------------------------------------------------------------------
    def select_blocks(self, scores_bsn: torch.Tensor, query_at_bs: torch.Tensor,
                visible_bsn: Optional[torch.Tensor] = None):
        """Top blocks per query among its complete visible ones: indices [B, S, K] and how many of
        the K slots are real, min(budget / r, complete blocks) [B, S]. `query_at_bs`: positions
        (within the document); `visible_bsn`: the selectable blocks under packed documents (there
        are (p+1) // r of them), else blocks 0 .. (p+1) // r - 1. Ties break toward the earlier
        block and the unused slots name the earliest unselectable blocks
        (qsa_stream.selection_keys)."""
        r, n = self.compress_ratio, scores_bsn.shape[-1]
        complete_bs = (query_at_bs + 1) // r
        k = min(self.budget // r, n)
        if k == 0:
            return query_at_bs.new_zeros(*query_at_bs.shape, 0), complete_bs * 0
        if visible_bsn is None:
            visible_bsn = torch.arange(n, device=scores_bsn.device) < complete_bs[..., None]
        key = selection_keys(scores_bsn, 0, visible_bsn)
        return key.topk(k, dim=-1).indices, complete_bs.clamp(max=k)

    # ---- attention forms -------------------------------------------------------------------------
    def _use_gather(self, b: int, s_q: int, s: Optional[int] = None) -> bool:
        """Whether `s_q` queries over `s` keys (default s_q) attend by gathering (the docstring's
        `auto`)."""
        if self.form != "auto":
            return self.form == "gather"
        s = s_q if s is None else s
        return b * s_q * s > MASK_ELEMS_LIMIT and 4 * (self.budget + self.compress_ratio - 1) <= s

    # ---- forward ---------------------------------------------------------------------------------
    def param_init(self, name: str, scales: InitScales) -> Optional[InitRule]:
        return ("normal", scales.residual_std) if name == "o_proj.weight" else None

    def forward(self, x_bsh: torch.Tensor, positions_bs: torch.Tensor,
                cache: Optional[LayerCache] = None,
                selection: Optional[QSASelection] = None, return_selection: bool = False,
                documents: Optional[Documents] = None, context: Optional[WholeWindow] = None,
                dense: bool = False, aux_grad_scale: float = 1.0,
                counted: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[QSASelection]]]:
        """`selection` (training, sparse stage): attend over these blocks instead of running the
        indexer (MTP depths 2..K reusing depth 1's). `return_selection`: also return the selection
        attended (None in the dense stage, where nothing is selected). `documents` (training only):
        the packed documents each row holds, kept apart; `positions_bs` then count from each
        document's start (`documents.positions()`). None: each row is one document. `context`
        (training only): which rows of the window x holds (models/context.py); when sharded, keys,
        values and indexer keys are gathered over the window and `documents` is
        `Documents.local(context)`. `dense` (training only): the warm-up stage, which attends to
        every visible token. `aux_grad_scale`: the gradient the caller's objective gives the
        indexer's KL per unit of `indexer_loss_coef` (as `MoE.forward`'s); `counted` [B, S_q]: the
        queries it averages over (False on padding, as `MoE.forward`'s; None: all)."""
        q_bhsd, k_bksd, v_bksd, gate_bsz = self._qkv(x_bsh, positions_bs)
        # A forward that attends over a handed-over selection has no use for the indexer: in
        # training one given a selection (sparse stage, unless it measures recall), in decoding a
        # depth reusing depth 1's (whose indexer keys no query ever reads: depth 1 selects over
        # keys it wrote itself, see `_decode`).
        if cache is None:
            reusing = selection is not None and not dense and not recall_measured()
        else:
            reusing = self.selection_share is not None and self.selection_share.mode == "reuse"
        # The selection carries no gradient and the indexer learns only from its own loss.
        q_idx_bsid, raw_bsd = ((None, None) if reusing else
                               self.indexer(x_bsh.detach(), positions_bs, self.rotary))
        used = None
        sharded = context is not None and context.sharded
        self.last_recall = None
        if cache is not None:
            if documents is not None or sharded or dense:
                raise ValueError("QSA decodes one whole document per row, sparse: documents, a "
                                 "sharded context and the dense warm-up are for training forwards")
            out_bsz, loss = self._decode(q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs,
                                         cache), None
        else:
            window = None
            if sharded:  # every rank's keys, values, indexer keys and layout, in window order
                k_bksd = context.gather(k_bksd.transpose(1, 2)).transpose(1, 2)
                v_bksd = context.gather(v_bksd.transpose(1, 2)).transpose(1, 2)
                raw_bsd = None if reusing else context.gather(raw_bsd)
                positions_bs = context.gather(positions_bs)
                window = (context,
                          None if documents is None else context.gather(documents.starts_bs))
            out_bsz, loss, used = self._train(q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd,
                                              positions_bs, selection, documents, window, dense,
                                              counted)
        y_bsh = self.o_proj(out_bsz * torch.sigmoid(gate_bsz))
        if loss is not None:
            # gradient injected in backward (as the MoE's aux loss): return values stay unchanged
            y_bsh = AuxLossGrad.apply(y_bsh, loss, float(self.indexer_loss_coef * aux_grad_scale))
        return (y_bsh, used) if return_selection else y_bsh

    def _train(self, q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs,
               reused: Optional[QSASelection], documents: Optional[Documents] = None, window=None,
               dense: bool = False, counted: Optional[torch.Tensor] = None):
        """Queries are q's rows, keys the window's (k, v, raw keys, positions: all S rows).
        `window`: (sharded context, the window's document starts or None) under context parallelism,
        else None. `dense`: the warm-up stage (`forward`)."""
        r, s = self.compress_ratio, k_bksd.shape[2]
        n = s // r
        measure_recall = recall_measured()
        # the dense warm-up attends to everything: a handed-over selection has nothing to restrict
        reused = reused if not dense else None
        # a reusing depth runs no indexer, so it has no indexer loss either; a query needs a
        # complete block before the indexer has anything to learn
        want_loss = (self.indexer_loss_coef > 0 and self.training and torch.is_grad_enabled()
                     and n > 0 and reused is None)
        select = not dense or measure_recall
        docs, query_at_bs, rows_s = self._training_layout(q_bhsd, s, reused, documents, window)
        visible = self._visible_fn(docs, query_at_bs)
        k_bnd = None
        if (want_loss or select) and reused is None:
            with torch.set_grad_enabled(want_loss):
                k_bnd = self._training_block_keys(raw_bsd, positions_bs, docs)
        blocks_bsk, count_bs = self._training_selection(q_idx_bsid, k_bnd, reused, docs,
                                                        query_at_bs, select, visible)

        def selected(c0: int, c1: int) -> torch.Tensor:
            return token_mask(self.compress_ratio, blocks_bsk[:, c0:c1], count_bs[:, c0:c1],
                              query_at_bs[:, c0:c1], s, docs, c0)

        out_bsz = self._training_attention(q_bhsd, k_bksd, v_bksd, documents, docs, blocks_bsk,
                                           count_bs, query_at_bs, selected, rows_s, dense)
        loss = None
        if want_loss or measure_recall:
            loss = self._indexer_target(q_bhsd, k_bksd, q_idx_bsid, k_bnd, blocks_bsk, count_bs,
                                        query_at_bs, docs, selected if select else None, want_loss,
                                        visible, rows_s, window, dense, measure_recall, counted)
        used = (QSASelection(blocks_bsk, count_bs, None if docs is None else docs.rows_bn)
                if blocks_bsk is not None and not dense else None)
        return out_bsz, loss, used

    def _training_layout(self, q_bhsd, s: int, reused: Optional[QSASelection],
                         documents: Optional[Documents], window):
        """(the packed documents' block layout or None, [B, S_q] each query's position in its
        document, [S_q] each query's window row or None when the queries are the window's S
        rows)."""
        b, s_q = q_bhsd.shape[0], q_bhsd.shape[2]
        if reused is not None and (reused.block_rows_bn is None) != (documents is None):
            made, given = ("without", "with") if documents is not None else ("with", "without")
            raise RuntimeError(f"QSA: a selection made {made} packed documents was handed to a "
                               f"forward {given} them")
        rows_s = None if window is None else window[0].rows(s_q, q_bhsd.device)
        if documents is None:
            return None, (torch.arange(s, device=q_bhsd.device) if rows_s is None
                          else rows_s).expand(b, s_q), rows_s
        # a reused selection's indices name blocks of the layout it was chosen in: read them there
        r = self.compress_ratio
        starts_bs = documents.starts_bs if window is None else window[1]
        rows_bn = (
            reused.block_rows_bn if reused is not None else DocumentBlocks.block_rows(starts_bs, r)
        )
        docs = DocumentBlocks.build(starts_bs, rows_bn, r)
        if rows_s is not None:  # the queries are this rank's rows
            docs = docs._replace(first_bs=documents.starts_bs, at_bs=documents.positions(),
                                 query_rows_s=rows_s)
        return docs, docs.at_bs, rows_s

    def _visible_fn(self, docs: Optional[DocumentBlocks], query_at_bs):
        """visible(c0, c1, n0, n1) [B, C, n1 - n0]: which of blocks n0..n1 queries c0..c1 may
        select."""
        r = self.compress_ratio
        if docs is not None:
            return lambda c0, c1, n0, n1: docs.visible(r, c0, c1, n0, n1)
        complete_bs = (query_at_bs + 1) // r
        return lambda c0, c1, n0, n1: (torch.arange(n0, n1, device=complete_bs.device)
                                       < complete_bs[:, c0:c1, None])

    def _training_block_keys(self, raw_bsd, positions_bs,
                             docs: Optional[DocumentBlocks]) -> torch.Tensor:
        """[B, N, D_i] the window's block keys (N = S // r; padding blocks under packed
        documents)."""
        r = self.compress_ratio
        n = raw_bsd.shape[1] // r
        if n == 0:
            return raw_bsd.new_zeros(raw_bsd.shape[0], 0, raw_bsd.shape[-1])
        if docs is None:
            return self.indexer.block_keys(raw_bsd[:, : n * r], positions_bs[:, : n * r : r],
                                           self.rotary)
        raw_bmd = raw_bsd.gather(1, docs.tokens_bm[..., None].expand(-1, -1, raw_bsd.shape[-1]))
        return self.indexer.block_keys(raw_bmd, docs.positions_bn, self.rotary)

    def _training_selection(self, q_idx_bsid, k_bnd, reused: Optional[QSASelection], docs,
                            query_at_bs, select: bool, visible):
        """(selected blocks, their counts), or (None, None) when nothing selects: a reused selection
        as handed over, else the streamed top blocks of the indexer's scores."""
        b, s_q = query_at_bs.shape
        if reused is not None:
            if reused.blocks_bsk.shape[:2] != (b, s_q):
                raise RuntimeError("QSA: a reused selection covers "
                                   f"{tuple(reused.blocks_bsk.shape[:2])} queries, "
                                   f"this forward {(b, s_q)}")
            return reused.blocks_bsk, reused.counts_bs
        if not select:
            return None, None
        reach_bs = (query_at_bs
                    + 1) // self.compress_ratio if docs is None else docs.reach(self.compress_ratio)
        return stream_select(self, q_idx_bsid, k_bnd, query_at_bs, reach_bs, visible)

    def _training_attention(self, q_bhsd, k_bksd, v_bksd, documents, docs, blocks_bsk, count_bs,
                            query_at_bs, selected, rows_s=None, dense: bool = False
                            ) -> torch.Tensor:
        """[B, S_q, heads * head_dim]: dense (the warm-up), or over the selected tokens by gathering
        them or by a [B, S_q, S] mask (`selected(c0, c1)` gives query rows c0..c1 of it)."""
        b, h, s_q, d = q_bhsd.shape
        s = k_bksd.shape[2]
        groups = h // k_bksd.shape[1]
        if dense:
            if documents is not None:
                mask = documents.attention_mask(keys=s)
            elif rows_s is not None:
                mask = torch.arange(s, device=rows_s.device) <= rows_s[:, None]
            if documents is None and rows_s is None:
                out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, is_causal=True,
                                                     enable_gqa=groups > 1)
            else:
                out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, attn_mask=mask,
                                                     enable_gqa=groups > 1)
            return out.transpose(1, 2).reshape(b, s_q, -1)
        if self._use_gather(b, s_q, s):
            idx_bsl, ok_bsl = token_slots(self.compress_ratio, blocks_bsk, count_bs, query_at_bs,
                                          docs)
            per_query = b * idx_bsl.shape[-1] * (2 * k_bksd.shape[1] * d + h)
            return gather_attend(q_bhsd.transpose(1, 2), idx_bsl, ok_bsl, k_bksd.transpose(1, 2),
                                 v_bksd.transpose(1, 2), max(1, self.chunk_elems // per_query))
        mask_b1ss = selected(0, s_q)[:, None]
        out = F.scaled_dot_product_attention(q_bhsd, k_bksd, v_bksd, attn_mask=mask_b1ss,
                                             enable_gqa=groups > 1)
        return out.transpose(1, 2).reshape(b, s_q, -1)

    def _indexer_target(self, q_bhsd, k_bksd, q_idx_bsid, k_bnd, blocks_bsk, count_bs, query_at_bs,
                        docs, selected, want_loss: bool, visible, rows_s, window, dense: bool,
                        measure_recall: bool, counted: Optional[torch.Tensor] = None):
        """The main attention's block mass, streamed (qsa_stream.stream_target): the recall of the
        selection (measure_recall) and, when the indexer trains, its KL loss (None otherwise): the
        mean over the window's queries with a candidate block, of which this forward holds `q`'s
        rows (padding left out: `counted`)."""
        total, recall_bs = stream_target(self, q_bhsd, k_bksd, q_idx_bsid, k_bnd, blocks_bsk,
                                         count_bs, docs, selected, want_loss, visible, rows_s,
                                         dense, counted)
        if measure_recall:
            # (under cp a rank's mean: every rank holds as many queries, so theirs is the window's)
            self.last_recall = self.reduce_heads(recall_bs).mean() / self.num_heads
        if not want_loss:
            return None
        # a complete visible block to learn from
        has_bs = ((query_at_bs + 1) // self.compress_ratio > 0).long()
        if counted is not None:
            has_bs = has_bs * counted
        if window is not None:
            has_bs = window[0].gather(has_bs)
        loss = total / has_bs.sum().clamp_min(1)
        self.last_indexer_loss = loss.detach()
        count_loss(self.indexer_loss_sum, loss)
        return loss

    def _decode(self, q_bhsd, k_bksd, v_bksd, q_idx_bsid, raw_bsd, positions_bs, cache: LayerCache):
        r = self.compress_ratio
        k_all, v_all = cache.update(k_bksd, v_bksd, positions_bs)  # [B, kvh, span, d]
        span = k_all.shape[2]
        share = self.selection_share
        tail_at_bs = positions_bs  # the query whose tail [(t+1) // r * r, t] is attended
        if raw_bsd is None:  # a depth reusing depth 1's selection: no indexer ran (`forward`)
            # A reusing query attends the source query's whole selection row, its blocks AND its
            # tail, as vLLM 0.32 does: its reusing draft steps (`set_skip_topk(True)`) attend
            # verbatim the packed token-index row depth 1's query at m - 1 wrote
            # (`expand_qsa_block_indices`: the blocks' tokens, then that query's tail), kept by
            # `compact_topk_indices`. With read_offset k - 1 (the serving convention) depth k at
            # m + k - 2 therefore attends nothing at m or later (not even its own key) and no
            # block completed after m - 1: serving's gap, kept so the acceptance measured here
            # is what serving gets. With read_offset 0 (training, the tandem convention) the
            # source is the query itself.
            tail_at_bs = (positions_bs - share.read_offset).clamp(min=0)
            blocks_bsk, count_bs = self._reused(cache, tail_at_bs)
        else:
            # Block keys from the cached prefix every time: a block is used only by queries at or
            # after its last token, which this forward (or an earlier one) has just written, so
            # rollback is free. Only a selecting query writes them (depth 1 on a cache the depths
            # share, serving's convention, writes every position it later reads).
            d = raw_bsd.shape[-1]  # (kept in their own dtype, as the keys and values are)
            keys_bld = cache.buffer("qsa_index_keys", (d,), raw_bsd.dtype, length=cache.max_len)
            keys_bld.scatter_(1, positions_bs[..., None].expand(-1, -1, d),
                              raw_bsd.to(keys_bld.dtype))
            n = span // r
            starts_bn = (torch.arange(n, device=positions_bs.device)
                         * r).expand(positions_bs.shape[0], n)
            scores_bsn = self._block_scores(q_idx_bsid, keys_bld[:, : n * r].to(raw_bsd.dtype),
                                            starts_bn)
            blocks_bsk, count_bs = self.select_blocks(scores_bsn, positions_bs)
            if share is not None and share.mode == "record":
                self._record(cache, positions_bs, blocks_bsk, count_bs)
        mask_bts = token_mask(self.compress_ratio, blocks_bsk, count_bs, tail_at_bs, span)
        out = cached_attention(q_bhsd, k_all, v_all, mask_bts)
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
        """Depth 1's selection at positions `source_bs` (blocks complete there are complete here
        too); the caller attends them with the tail of `source_bs`, not of its own position (see
        `_decode`)."""
        store = cache.shared_buffer("qsa_reuse_blocks", (self.budget // self.compress_ratio,),
                                    torch.long)
        counts = cache.shared_buffer("qsa_reuse_counts", (), torch.long)
        src = source_bs.clamp(min=0)
        return store.gather(1, src[..., None].expand(-1, -1, store.shape[-1])), counts.gather(1,
                                                                                              src)
