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


def _gathered(q_bshd, idx_bsl, k_rows, v_rows):
    """(queries [B, C, KVH, G, D], gathered keys and values [B, C, L, KVH, D], all in fp32 or
    wider, and the gathered rows' indices) from k and v flattened to rows [B * S, KVH * D]."""
    b, c, h, d = q_bshd.shape
    s, kvh, L = k_rows.shape[0] // b, k_rows.shape[1] // d, idx_bsl.shape[-1]
    rows = (idx_bsl + torch.arange(b, device=idx_bsl.device)[:, None, None] * s).reshape(-1)
    acc = torch.promote_types(q_bshd.dtype, torch.float32)
    k_g = k_rows.index_select(0, rows).view(b, c, L, kvh, d).to(acc)
    v_g = v_rows.index_select(0, rows).view(b, c, L, kvh, d).to(acc)
    return q_bshd.reshape(b, c, kvh, h // kvh, d).to(acc), k_g, v_g, rows


def _probabilities(q5, k_g, ok_bsl) -> torch.Tensor:
    att = torch.einsum("bckgd,bclkd->bckgl", q5, k_g) * q5.shape[-1] ** -0.5
    return att.masked_fill(~ok_bsl[:, :, None, None, :], float("-inf")).softmax(-1)


def _attend(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows) -> torch.Tensor:
    # Logits, softmax and the weighted sum in fp32 from the (bf16) rows, as the mask form's SDPA
    # accumulates: a bf16 einsum rounded every logit to bf16 first, so `auto`'s switch of form
    # at qsa.MASK_ELEMS_LIMIT changed the numerics. The fp32 copies live for one query chunk;
    # autocast is off around them (einsum's bmm would cast them back).
    with torch.autocast(q_bshd.device.type, enabled=False):
        q5, k_g, v_g, _ = _gathered(q_bshd, idx_bsl, k_rows, v_rows)
        out = torch.einsum("bckgl,bclkd->bckgd", _probabilities(q5, k_g, ok_bsl), v_g)
    return out.reshape(*q_bshd.shape[:2], -1).to(q_bshd.dtype)


def _chunked(chunk: int, *tensors):
    return zip(*(t.split(chunk, 1) for t in tensors))


def _attend_chunks(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows, chunk: int) -> torch.Tensor:
    return torch.cat([_attend(*part, k_rows, v_rows)
                      for part in _chunked(chunk, q_bshd, idx_bsl, ok_bsl)], 1)


class GatheredAttention(torch.autograd.Function):
    """The gather form over query chunks of `chunk`, recomputed chunk by chunk in backward, whose
    key and value gradients accumulate in one fp32 buffer each. Autograd through a checkpoint per
    chunk instead gave each chunk's gathered rows a gradient the size of the whole K and V
    (zero-filled, then added): at the 256k stage, where K and V span the window and the queries
    are ~130 chunks, most of the layer's backward."""

    @staticmethod
    def forward(ctx, q_bshd, idx_bsl, ok_bsl, k_rows, v_rows, chunk: int):
        ctx.save_for_backward(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows)
        ctx.chunk = chunk
        return _attend_chunks(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows, chunk)

    @staticmethod
    def backward(ctx, grad_bsz):
        q_bshd, idx_bsl, ok_bsl, k_rows, v_rows = ctx.saved_tensors
        acc = torch.promote_types(q_bshd.dtype, torch.float32)
        grad_k = torch.zeros(k_rows.shape, dtype=acc, device=k_rows.device)
        grad_v = torch.zeros_like(grad_k)
        grad_q = []
        with torch.autocast(q_bshd.device.type, enabled=False):
            for q_part, idx_part, ok_part, grad_part in _chunked(ctx.chunk, q_bshd, idx_bsl,
                                                                 ok_bsl, grad_bsz):
                q5, k_g, v_g, rows = _gathered(q_part, idx_part, k_rows, v_rows)
                att = _probabilities(q5, k_g, ok_part)
                g5 = grad_part.reshape(q5.shape).to(acc)
                grad_v.index_add_(0, rows, torch.einsum("bckgl,bckgd->bclkd", att, g5)
                                  .reshape(-1, k_rows.shape[1]))
                grad_att = torch.einsum("bckgd,bclkd->bckgl", g5, v_g)
                # softmax's backward (masked slots have att == 0 and get nothing), and the scale
                grad_logit = (att * (grad_att - (att * grad_att).sum(-1, keepdim=True))
                              * q5.shape[-1] ** -0.5)
                grad_k.index_add_(0, rows, torch.einsum("bckgl,bckgd->bclkd", grad_logit, q5)
                                  .reshape(-1, k_rows.shape[1]))
                grad_q.append(torch.einsum("bckgl,bclkd->bckgd", grad_logit, k_g)
                              .reshape(q_part.shape))
        return (torch.cat(grad_q, 1).to(q_bshd.dtype), None, None, grad_k.to(k_rows.dtype),
                grad_v.to(v_rows.dtype), None)


def gather_attend(q_bshd, idx_bsl, ok_bsl, k_bskd, v_bskd, chunk: Optional[int] = None
                  ) -> torch.Tensor:
    """[B, S_q, H * D]: each query attends over its own gathered key/value rows (the gather form),
    `chunk` queries at a time (all at once by default): one chunk's gathered rows are alive at a
    time, in forward and in backward."""
    b, s_q = q_bshd.shape[:2]
    chunk = s_q if chunk is None else chunk
    # k and v as rows, copied once (they arrive transposed): each chunk gathers from them
    k_rows = k_bskd.reshape(b * k_bskd.shape[1], -1)
    v_rows = v_bskd.reshape(b * v_bskd.shape[1], -1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_bshd, k_rows, v_rows)):
        return GatheredAttention.apply(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows, chunk)
    return _attend_chunks(q_bshd, idx_bsl, ok_bsl, k_rows, v_rows, chunk)
