"""QSA's selection expanded to tokens: the tokens a query attends (its selected blocks plus its
visible tail) as the mask form's mask (`token_mask`) or the gather form's slots (`token_slots`), and
the gather form's attention over those slots (`gather_attend`). `r` is the compress ratio (block
length). Kept apart from models/qsa.py's layer, whose docstring states the semantics.
"""

from __future__ import annotations

from typing import Optional

import torch

from .qsa_index import DocumentBlocks


def token_mask(r: int, blocks_bsk, count_bs, query_at_bs, num_keys: int,
               docs: Optional[DocumentBlocks] = None, c0: int = 0) -> torch.Tensor:
    """[B, S, num_keys]: tokens of the selected blocks plus the visible tail. `docs`: packed
    documents' blocks; the queries are then rows c0 .. c0 + S - 1 of its window."""
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
        # unused slots land in column n
        chosen.scatter_(-1, torch.where(real, blocks_bsk, n), True)
        if docs is None:
            mask[..., : n * r] |= chosen[..., :n].repeat_interleave(r, dim=-1)
        else:
            chosen.select(-1, n).fill_(False)  # the column of the tokens in no block
            mask |= chosen.gather(-1, docs.key_block_bs[:, None].expand(-1, mask.shape[1], -1))
    return mask


def token_slots(r: int, blocks_bsk, count_bs, query_at_bs,
                docs: Optional[DocumentBlocks] = None):
    """The gather form's candidates: token indices [B, S, L] (L <= budget + r - 1) and validity.
    `docs`: packed documents' blocks (the indices are rows; the queries, the window's S
    rows)."""
    k = blocks_bsk.shape[-1]
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


def gather_attend(q_bshd, idx_bsl, ok_bsl, k_bskd, v_bskd):
    """Each query attends over its own gathered key/value rows (the gather form)."""
    b, c, h, d = q_bshd.shape
    s, kvh, L = k_bskd.shape[1], k_bskd.shape[2], idx_bsl.shape[-1]
    rows = (idx_bsl + torch.arange(b, device=idx_bsl.device)[:, None, None] * s).reshape(-1)
    k_g = k_bskd.reshape(b * s, kvh * d).index_select(0, rows).view(b, c, L, kvh, d)
    v_g = v_bskd.reshape(b * s, kvh * d).index_select(0, rows).view(b, c, L, kvh, d)
    q5 = q_bshd.reshape(b, c, kvh, h // kvh, d)
    # Logits, softmax and the weighted sum in fp32 from the (bf16) rows, as the mask form's SDPA
    # accumulates: a bf16 einsum rounded every logit to bf16 first, so `auto`'s switch of form
    # at qsa.MASK_ELEMS_LIMIT changed the numerics. The fp32 copies live for one checkpointed query
    # chunk; autocast is off around them (einsum's bmm would cast them back).
    acc = torch.promote_types(q_bshd.dtype, torch.float32)
    with torch.autocast(q_bshd.device.type, enabled=False):
        att = torch.einsum("bckgd,bclkd->bckgl", q5.to(acc), k_g.to(acc)) * d ** -0.5
        att = att.masked_fill(~ok_bsl[:, :, None, None, :], float("-inf")).softmax(-1)
        out = torch.einsum("bckgl,bclkd->bckgd", att, v_g.to(acc))
    return out.reshape(b, c, h * d).to(q_bshd.dtype)
