"""What the speculative decoder (eval/spec_decode.py) and its drafter (eval/drafting.py) share for
one batch of sequences: the committed tokens, the trunk's hidden states and the host-side lengths
that size every forward.

Per row b: committed tokens x_0..x_m live in `seq[b, :m+1]` (x_m the newest, the bonus of the last
verify) and the trunk's pre-norm hidden state `hidden[b, t]` is valid for t <= m-1. The decoder
writes both (prefill, verify, commit) and a round's drafts (`seq[b, m+k]`); drafters read them.

Host syncs: the lengths that size a forward (how many positions a draft range covers, how far a
cache's key prefix reaches: `DecodeCache.span`) are host integers, upper bounds kept from what was
launched (`m_hi`, `advance_hi`), so drafting and verifying never read the device back.
`read_lengths` makes them exact with the decode loop's one host read per round; a looser bound only
pads a range or a key prefix with positions whose outputs are ignored or masked.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn


class DecodeBatch:
    """Committed tokens, trunk hidden states and host length bounds of `batch` rows decoded by
    `model` with K=num_steps drafts a round, in caches of `cap` positions."""

    def __init__(self, model: nn.Module, num_steps: int, batch: int, cap: int):
        self.model, self.K, self.B, self.cap = model, num_steps, batch, cap
        p0 = model.embed_tokens.weight
        self.device, self.dtype = p0.device, p0.dtype
        cfg = model.cfg
        self.H = cfg.hidden_size * cfg.hc_count  # the hidden state handed on: every residual stream
        # Recurrent layers (Gated DeltaNet, PLE) keep their state in rings indexed by position: a
        # ring must outlast a verify forward (K+1 tokens), a batched range's padding (~2K) and the
        # widest convolution window (PLE's dilated one), so any accepted prefix can be resumed from.
        self.ring = 4 * num_steps + 32
        self.hidden = torch.zeros(batch, cap, self.H, dtype=self.dtype, device=self.device)
        """[B, cap, H] the trunk's pre-norm hidden state per position."""
        self.seq = torch.zeros(batch, cap + num_steps + 2, dtype=torch.long, device=self.device)
        self.m = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.arange = torch.arange(cap, device=self.device)
        self.m_hi = 0
        """Host-side upper bound of max(m) over the rows (exact after prefill and
        `read_lengths`)."""
        self.advance_hi = 0
        """Host-side upper bound of how far any row's m moved since the last draft (exact after
        `read_lengths`)."""
        self.drafted = False
        """Whether a draft ran since prefill (before it every depth starts at position 0)."""
        self.m_drafted = self.m
        """[B] m at the last draft."""

    # --- the decoder's updates --------------------------------------------------------------------
    def prefilled(self, lens: torch.Tensor, longest: int) -> None:
        """After a prefill of prompts of `lens` [B] tokens, the longest `longest` (host int)."""
        self.m = lens.clone()
        self.m_hi, self.advance_hi, self.drafted, self.m_drafted = longest, 0, False, self.m

    def committed(self, new_m: torch.Tensor) -> None:
        """After a verify round committed up to `new_m`: bounds until the next `read_lengths`."""
        self.m = new_m
        self.m_hi = min(self.m_hi + self.K + 1, self.cap)
        self.advance_hi += self.K + 1

    def mark_drafted(self) -> None:
        """After a draft: every depth has caught up to the rows' m."""
        self.drafted, self.advance_hi, self.m_drafted = True, 0, self.m

    def read_lengths(self, *flags: torch.Tensor) -> List[int]:
        """The decode loop's one host read per round: exact `m_hi` and `advance_hi` for the next
        forwards, with the caller's scalar `flags` (returned as ints) in the same transfer."""
        vals = torch.stack([self.m.max(), (self.m - self.m_drafted).max(),
                            *(f.long() for f in flags)]).tolist()
        self.m_hi, self.advance_hi = vals[0], vals[1]
        return vals[2:]

    # --- host lengths for a drafter's forwards ----------------------------------------------------
    def span_to(self, last: int) -> int:
        """`DecodeCache.span` for a forward whose largest position is at most `last` (host int)."""
        return min(last + 1, self.cap)

    def range_length(self, behind: int) -> int:
        """Positions a draft forward over a row's range [valid+1, m-1] covers (host int) for a
        drafter whose valid prefix trails m-1 by `behind` positions after a draft (the `tandem`
        convention's depth k: k-1); every range starts at position 0 before the first draft."""
        if not self.drafted:
            return self.m_hi
        return max(min(self.advance_hi + behind, self.m_hi), 1)

    def range_span(self, length: int) -> int:
        """The span of a draft range of `length` positions starting at min(valid+1, m-1) (0 before
        the first draft)."""
        return self.span_to((self.m_hi - 1 if self.drafted else 0) + length - 1)
