"""Under torchrun (2 ranks, gloo): `dp_mode=allreduce` is torch's replicate (FSDP2's machinery with
replicated parameters). Prints, per micro-batch of one step, how many gradient all-reduces torch
issued while autograd was running that micro-batch's backward, for each
`parallel.reshard_after_microbatch`."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from tests import processes
from tests.distributed import worker


def main(argv) -> int:
    """argv: the output directory (unused: the counts are printed)."""
    torch.set_num_threads(1)
    from tandem.models.experts import _grouped_mm_works

    # its one-time probe runs a backward of its own
    _grouped_mm_works(torch.device("cpu"), torch.float32)
    for every in ("false", "true"):
        count(f"dp=2,dp_mode=allreduce,reshard_after_microbatch={every}")
    dist.destroy_process_group()
    return 0


def count(layout: str) -> None:
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    cfg = worker.make_cfg(layout, worker.GRAD_ACCUM)
    pstate = init_parallel(cfg, resolve_device("cpu"))
    model = build_model(cfg, pstate)
    tr = TrainStep(cfg, model, pstate)
    model.train()
    in_backward = []
    original = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        if torch._C._current_graph_task_id() != -1:  # called from inside autograd's backward
            in_backward[-1] += 1
        return original(tensor, *args, **kwargs)

    batches = worker.rank_micro_batches(0, pstate.dp_rank, pstate.dp_size, worker.GRAD_ACCUM)
    counts = tr.global_target_counts(batches)
    real_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        in_backward.append(0)
        return real_backward(self, *args, **kwargs)

    dist.all_reduce, torch.Tensor.backward = recording, backward
    try:
        tr.forward_backward(batches, counts, depth_coefficients(cfg.mtp, 0))
    finally:
        dist.all_reduce, torch.Tensor.backward = original, real_backward
    tr.clip_gradients()  # completes the step's gradient sync (nothing left in flight at teardown)
    dist.barrier()
    blocks = len(model.layers)
    print(f"rank{dist.get_rank()} every={cfg.parallel.reshard_after_microbatch} "
          f"micro_batches={len(batches)} "
          f"blocks={blocks} all_reduces_in_backward={','.join(map(str, in_backward))}", flush=True)


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
