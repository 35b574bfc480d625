"""Autograd-aware collectives for the model-parallel regions (Megatron's f / g operators).

Tensor-parallel ranks compute the *same* loss, so the backward of an all-reduce that merges partial
results is the identity (`reduce_from_group`), and a replicated input feeding sharded weights gets
its partial input-gradients summed in backward (`copy_to_group`). `all_to_all` moves variable-size
blocks of rows with the reverse exchange as its backward (expert dispatch and combine).
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits: List[int], recv_splits: List[int], group):
        ctx.group, ctx.send, ctx.recv = group, send_splits, recv_splits
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient in backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (every rank holds the same downstream loss)."""
    return _ReduceFromGroup.apply(x, group)


def all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int], group) -> torch.Tensor:
    """Variable-size all-to-all of rows (dim 0); backward is the reverse exchange."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)
