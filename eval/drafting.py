"""The drafter protocol of the speculative decoder and the `tandem` drafting convention.

A `Drafter` computes, for one round, the draft logits of MTP depths 1..K after a `DecodeBatch`'s
committed tokens; the decoder (eval/spec_decode.py SpecDecoder.draft) chooses each draft from them,
writes it into the batch's sequence, where the next depth reads it, and counts the round drafted.
Token choice, the sequence and the host length bounds belong to the decoder and its batch; the
caches and hidden stores of the MTP depths belong to the drafter. Two conventions implement it
(`draft_convention`, `eval.draft_convention`):

* `serving` (the default, eval/draft_serving.py ServingDrafter): depths 2..K draft as vLLM's MTP
  proposer does -- one MTP cache shared by the depths, depth k one token at position m + k - 2 -- so
  the acceptance is the served figure;
* `tandem` (`TrunkDrafter` below): each depth drafts exactly as it was trained. Depth k has its own
  one-layer KV cache (physical layer weights are shared when L < K, caches are not) and its own
  hidden store, valid (computed from committed inputs only) up to `valid[k]`. A round runs, for
  k = 1..K, `mtp_step(k)` over the contiguous positions [valid[k]+1, m-1] with inputs h_{k-1} (the
  trunk's h_0 for the parallel style) and tokens seq[t + k] (committed tokens, then this round's
  drafts), drafts d_k from the last of them, then sets valid[k] = m - k.

Both are exact (the trunk verifies): only the drafts, and so the acceptance, differ. Rolling back is
only lowering m: cache rows beyond it are rewritten before any query reads them (models/state.py).
Rows of a batched range are padded to the longest row with positions continuing past the row's end;
their outputs are ignored and rewritten later.
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol

import torch
from torch import nn

from tandem.models.attention import KVCache

from .decode_batch import DecodeBatch
from .draft_serving import ServingDrafter

DRAFT_CONVENTIONS = ("serving", "tandem")
"""`serving`: vLLM's proposer (eval/draft_serving.py); `tandem`: one cache and hidden store per
depth, as trained."""


class Drafter(Protocol):
    """How MTP depths 1..K draft a round for one DecodeBatch."""

    def depth_logits(self) -> Iterator[torch.Tensor]:
        """One round after the batch's committed tokens: yields depth k's draft logits [B, V] at
        each row's newest position, for k = 1..K in order. Before asking for depth k + 1 the caller
        writes draft d_k to `batch.seq[:, m + k]`, which depth k + 1 reads. When the iteration ends,
        the drafter's state is valid up to what the committed tokens determine (rollback: lowering
        m)."""
        ...


class TrunkDrafter:
    """The `tandem` convention: one KV cache and one hidden store per depth, each depth drafting
    over the positions it has not seen, as it was trained (module docstring)."""

    def __init__(self, batch: DecodeBatch):
        self.batch = batch
        B, K, cap = batch.B, batch.K, batch.cap
        self.chained = batch.model.mtp.chained
        extra = K - 1 if self.chained else 0
        self.hidden = [batch.hidden] + [torch.zeros(B, cap, batch.H, dtype=batch.dtype,
                                                    device=batch.device)
                                        for _ in range(extra)]
        """hidden[k]: depth k's output per position (hidden[0] the trunk's), the input of depth k +
        1."""
        self.shared = {}
        """The depths' caches share the store of QSA index reuse (depth 1's selection, read by
        depths 2..K)."""
        self.caches = [KVCache(1, B, cap, batch.dtype, batch.device, shared=self.shared).layer(0)
                       # one cache per depth: depths share layer weights, not states
                       for _ in range(K)]
        self.valid = torch.full((K, B), -1, dtype=torch.long, device=batch.device)
        """[K, B] valid[k-1]: the last position whose depth-k cache entry came from committed
        inputs."""

    def depth_logits(self) -> Iterator[torch.Tensor]:
        b = self.batch
        model, B, H, m = b.model, b.B, b.H, b.m
        for k in range(1, b.K + 1):
            start = torch.minimum(self.valid[k - 1] + 1, m - 1)
            r = m - start
            R = b.range_length(behind=k - 1)  # a host bound: int(r.max()) would stall every depth
            pos = (start.unsqueeze(1) + b.arange[:R]).clamp_(max=b.cap - 1)
            idx = pos.unsqueeze(-1).expand(B, R, H)
            src = self.hidden[k - 1] if self.chained else self.hidden[0]
            self.caches[k - 1].cache.span = b.range_span(R)
            out = model.mtp_step(k, src.gather(1, idx), b.seq.gather(1, pos + k), pos,
                                 self.caches[k - 1])
            if self.chained and k < b.K:
                self.hidden[k].scatter_(1, idx, out.to(self.hidden[k].dtype))  # bf16 under autocast
            last = out.gather(1, (r - 1).view(B, 1, 1).expand(B, 1, H))
            yield model.logits(k, last)[:, 0]
        self.valid = (m.unsqueeze(0) - b.arange[1 : b.K + 1].unsqueeze(1)).clamp_(min=-1)


def resolve_convention(model: nn.Module, convention: str, num_steps: int) -> str:
    """The convention a decode of `model` with K=num_steps really uses: `serving` needs a looped MTP
    with one physical layer (else it drafts as trained: `tandem`). ValueError for an unknown
    name."""
    if convention not in DRAFT_CONVENTIONS:
        raise ValueError(f"draft_convention={convention!r}: must be one of "
                         f"{', '.join(DRAFT_CONVENTIONS)}")
    mtp = getattr(model, "mtp", None)
    if convention == "tandem" or num_steps <= 0 or mtp is None:
        return convention
    if not mtp.chained or len(mtp.layers) != 1:
        return "tandem"
    return "serving"


def make_drafter(batch: DecodeBatch, convention: str) -> Optional[Drafter]:
    """The drafter of a resolved `convention` for `batch` (None without drafts: K = 0)."""
    if batch.K <= 0:
        return None
    if convention == "serving":
        return ServingDrafter(batch)
    return TrunkDrafter(batch)
