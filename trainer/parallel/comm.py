"""Autograd-aware collectives for the model-parallel regions (Megatron's f / g operators).

Tensor-parallel ranks compute the *same* loss, so the backward of an all-reduce that merges partial
results is the identity (`reduce_from_group`), and a replicated input feeding sharded weights gets
its partial input-gradients summed in backward (`copy_to_group`). `all_to_all` moves variable-size
blocks of rows with the reverse exchange as its backward (expert dispatch and combine).

Sequence parallelism adds the conjugate pair along one dimension: `gather_along` (all-gather of
the sequence shards forward, reduce-scatter of the -- partial -- gradients backward) before a
column-parallel region, and `scatter_reduce_along` (reduce-scatter of partial sums forward,
all-gather backward) after a row-parallel one.
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


def all_gather_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((world * x0.shape[0],) + tuple(x0.shape[1:]))
    dist.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // world,) + tuple(x0.shape[1:]))
    dist.reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim)


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.group, ctx.dim), None, None


class _ScatterReduceAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_dim(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, ctx.dim), None, None


def gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather the rank-ordered shards along `dim`; backward reduce-scatters (sums) the
    gradient."""
    if not x.requires_grad:
        return all_gather_dim(x, group, dim)
    return _GatherAlong.apply(x, group, dim)


def scatter_reduce_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum partial results over the group and keep this rank's shard along `dim`; backward
    all-gathers."""
    return _ScatterReduceAlong.apply(x, group, dim)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient in backward."""
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (every rank holds the same downstream loss)."""
    return _ReduceFromGroup.apply(x, group)


def all_to_all(x: torch.Tensor, send_splits: List[int], recv_splits: List[int],
               group) -> torch.Tensor:
    """Variable-size all-to-all of rows (dim 0); backward is the reverse exchange."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)
