"""Packed documents in a training window (`data.document_mask`).

A window of S positions may hold several documents back to back. With the mask on, every layer kind
restarts at each document, so a document inside a window computes exactly what it computes alone at
position 0: attention is block-diagonal causal, positions (RoPE, QSA's blocks) count from the
document's first token, Gated DeltaNet's state and every causal convolution (Gated DeltaNet's,
PLE's) start from zero, and the MTP layers, built from the same blocks, do the same.

Everything follows from one tensor, the row index where each position's document starts. A module
given `Documents` derives what it needs from it (a causal convolution's tap j reaches back into the
same document iff the position within the document is >= j; Gated DeltaNet resets where that
position is 0). Without it (None) a module runs its plain causal form, which is the same computation
for a window holding one document, only cheaper.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch


class Documents(NamedTuple):
    starts_bs: torch.Tensor
    """[B, S] long: the row index of the first position of each position's document."""
    rows_s: Optional[torch.Tensor] = None
    """[S] long: the window row of each of the S rows (context parallelism: a rank's rows, `local`);
    None: rows 0 .. S-1 of the window."""

    @classmethod
    def from_doc_ids(cls, doc_ids_bs: torch.Tensor) -> "Documents":
        """From the data's `doc_ids` [B, S] (non-decreasing along a row, equal within a
        document)."""
        s = doc_ids_bs.shape[1]
        index = torch.arange(s, device=doc_ids_bs.device).expand_as(doc_ids_bs)
        first = torch.ones_like(doc_ids_bs, dtype=torch.bool)
        first[:, 1:] = doc_ids_bs[:, 1:] != doc_ids_bs[:, :-1]
        return cls(torch.where(first, index, 0).cummax(dim=1).values)

    @classmethod
    def from_positions(cls, positions_bs: torch.Tensor) -> "Documents":
        """From positions counted from each document's start (what a pipeline stage receives)."""
        s = positions_bs.shape[1]
        return cls(torch.arange(s, device=positions_bs.device) - positions_bs)

    def local(self, window) -> "Documents":
        """This rank's rows of the whole window's documents (`window`: models/context.py
        `WholeWindow`)."""
        if not window.sharded:
            return self
        return Documents(window.local(self.starts_bs),
                         window.rows(window.local(self.starts_bs).shape[1],
                                                                   self.starts_bs.device))

    def rows(self) -> torch.Tensor:
        """[S] the window row of each row."""
        if self.rows_s is not None:
            return self.rows_s
        return torch.arange(self.starts_bs.shape[1], device=self.starts_bs.device)

    def positions(self) -> torch.Tensor:
        """[B, S] position of each token within its document."""
        return self.rows() - self.starts_bs

    def attention_mask(self, keys: Optional[int] = None) -> torch.Tensor:
        """[B, 1, S, keys] bool: query t sees key u (a window row, `keys` of them: default S) iff u
        is in t's document and u <= t."""
        query_t = self.rows()[:, None]
        key_u = torch.arange(self.starts_bs.shape[1] if keys is None else keys,
                             device=self.starts_bs.device)
        return ((key_u[None, None, :] <= query_t[None])
                & (key_u[None, None, :] >= self.starts_bs[:, :, None]))[:, None]


def causal_conv_taps(x_bsc: torch.Tensor, weight_ck: torch.Tensor, positions_bs: torch.Tensor,
                     dilation: int = 1) -> torch.Tensor:
    """A causal depthwise convolution that does not reach across a document start: out[t] =
    sum_j weight[:, K-1-j] * x[t - j*dilation] over the taps with j*dilation <= positions[t] (the
    position within the document). [B, S, C] in, [B, S, C] out, in the dtype `F.conv1d` gives
    (autocast's under autocast, else x's): inputs rounded to it, taps summed in fp32 (fp64 in an
    fp64 run).

    A bf16 activation times an fp32 weight came out fp32 under autocast, where the unpacked path's
    conv1d gives bf16: a packed document computed other values than alone, and Gated DeltaNet's
    fla kernel, which takes bf16, was passed over for the torch rule."""
    device = x_bsc.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
             else x_bsc.dtype)
    exact = torch.promote_types(dtype, torch.float32)  # fp32, fp64 in an fp64 run
    x_bsc = x_bsc.to(dtype).to(exact)
    weight_ck = weight_ck.to(dtype).to(exact)
    kernel = weight_ck.shape[-1]
    out = x_bsc * weight_ck[:, kernel - 1]
    for j in range(1, kernel):
        back = j * dilation
        if back >= x_bsc.shape[1]:
            break
        shifted = torch.nn.functional.pad(x_bsc[:, :-back], (0, 0, back, 0))
        reach = (positions_bs >= back)[..., None]
        out = out + torch.where(reach, shifted, 0) * weight_ck[:, kernel - 1 - j]
    return out.to(dtype)


_CU_SEQLENS: dict = {}
"""id(starts_bs) -> (a weak reference to it, its cu_seqlens), the entry gone with the tensor."""


def flat_cu_seqlens(documents: Documents) -> torch.Tensor:
    """int32 [n + 1]: where each of the n documents starts in the window's rows laid end to end
    (each row starts one too), then the total: fla's variable-length `cu_seqlens`. Found once per
    window (a host sync, `nonzero`), not once per Gated DeltaNet layer: every layer of a forward,
    and its recompute, is handed the same `Documents`."""
    starts_bs, key = documents.starts_bs, id(documents.starts_bs)
    held = _CU_SEQLENS.get(key)
    if held is not None and held[0]() is starts_bs:
        return held[1]
    b, s = starts_bs.shape
    first = (documents.positions() == 0).flatten()
    first[0] = True  # every row starts a document; rows are cut apart as well
    starts = first.nonzero().flatten()
    found = torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)
    _CU_SEQLENS[key] = (weakref.ref(starts_bs, lambda _, key=key: _CU_SEQLENS.pop(key, None)),
                        found)
    return found
