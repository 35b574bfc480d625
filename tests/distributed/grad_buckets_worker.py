"""Under torchrun (2 ranks, gloo): GradientBuckets against one all-reduce per parameter."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from tandem.trainer.parallel.data import GradientBuckets


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    unused = nn.Parameter(torch.ones(3))  # never reached by backward: summed as zeros
    params = [unused] + list(model.parameters())  # registered first: bucketed last
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))  # different data per rank
    group = dist.new_group([0, 1])
    # ~2 parameters per bucket; the last layer's weight is "late" (summed only in finish)
    entries = [(p, group, p is model[4].weight) for p in params]
    buckets = GradientBuckets(entries, torch.float32, bucket_bytes=600 * 4)
    assert len(buckets.buckets) >= 4, len(buckets.buckets)

    model(x).square().sum().backward()  # first micro-batch: accumulate only
    reference = {}
    model(x * 2).square().sum().backward()
    for i, p in enumerate(params):
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        reference[i] = g
    for p in params:
        p.grad = None

    model(x).square().sum().backward()
    buckets.arm()  # armed for the last micro-batch's backward
    model(x * 2).square().sum().backward()
    launched_in_backward = len(buckets.launched)
    buckets.finish()
    # every non-late bucket whose parameters all got gradients went out during backward
    early = [b for b in buckets.buckets if not b["late"]]
    complete = 0
    for b in early:
        if any(p is unused for p in b["params"]):
            break
        complete += 1
    assert launched_in_backward == complete and complete >= 2, (launched_in_backward, complete)
    assert not buckets.handles and not buckets.launched
    for i, p in enumerate(params):
        assert torch.equal(p.grad, reference[i]), i
    print(f"rank{rank} ok launched_in_backward={launched_in_backward}/{len(buckets.buckets)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
