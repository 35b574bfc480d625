"""`gradients.launch_gradient_sums`: gradients summed in flat buckets of at most `bucket_bytes`, one
all-reduce each, per process group and dtype, written back where they came from."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tandem.trainer.parallel import gradients


def test_buckets_split_by_size_group_and_dtype(monkeypatch):
    calls = []
    real = dist.all_reduce

    def counting(tensor, group=None, async_op=False):
        calls.append((tensor.numel(), tensor.dtype))
        return real(tensor, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", counting)
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        sizes = (10, 10, 30, 5)
        params = [nn.Parameter(torch.zeros(n)) for n in sizes]
        for i, p in enumerate(params[:3]):
            p.grad = torch.full((p.numel(),), 1.0 + 2.0**-12 * (i + 1))
        half = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        half.grad = torch.ones(3, dtype=torch.bfloat16)
        entries = [(p, group) for p in params] + [(half, group)]
        # 80 bytes: [10, 10] fill the first fp32 bucket, 30 is a bucket of its own, 5 the next; bf16
        # apart
        gradients.finish_gradient_sums(gradients.launch_gradient_sums(entries, bucket_bytes=80))
        assert calls == [(20, torch.float32), (30, torch.float32), (5, torch.float32),
                         (3, torch.bfloat16)]
        assert torch.equal(params[3].grad, torch.zeros(5))  # never reached by backward: zeros
        assert torch.equal(params[2].grad, torch.full((30,), 1.0 + 3 * 2.0**-12))
        calls.clear()
        # a reduce dtype: every bucket sent in it, the sums written back in the gradients' dtype
        gradients.finish_gradient_sums(gradients.launch_gradient_sums(entries[:3], torch.bfloat16,
                                                                      bucket_bytes=40))
        assert calls == [(20, torch.bfloat16), (30, torch.bfloat16)]
        assert params[0].grad.dtype == torch.float32 and torch.equal(params[0].grad, torch.ones(10))
    finally:
        if fresh:
            dist.destroy_process_group()
