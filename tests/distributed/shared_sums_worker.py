"""torchrun worker for test_shared_piece_sums.py: trains `worker.STEPS` steps of each layout and
records, on every rank, what the gradient finisher's sums of the shared pipeline pieces did: the
all-reduce calls inside `GradientFinisher.start` / `sync`, and when each started relative to the
pipeline's stages finishing their backward."""

from __future__ import annotations

import os
import sys
from typing import List

import torch
import torch.distributed as dist

from tests import processes
from tests.distributed import worker
from tests.distributed.collectives import CollectiveRecorder


def all_reduces(recorder: CollectiveRecorder) -> int:
    return sum(n for (op, _, _), n in recorder.calls.items() if op == "distributed.all_reduce")


def second_backward(layout: str) -> str:
    """A second forward_backward before the gradient finisher ran: the error it raises (or "")."""
    from tandem.trainer.loss import depth_coefficients
    from tandem.trainer.parallel import init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model
    from tandem.trainer.step import TrainStep

    cfg = worker.make_cfg(layout, worker.GRAD_ACCUM)
    pstate = init_parallel(cfg, resolve_device("cpu"))
    tr = TrainStep(cfg, build_model(cfg, pstate), pstate)
    batches = worker.rank_micro_batches(0, pstate.dp_rank, pstate.dp_size, worker.GRAD_ACCUM)
    counts = tr.global_target_counts(batches)
    try:
        for _ in range(2):
            tr.forward_backward(batches, counts, depth_coefficients(cfg.mtp, 0))
    except RuntimeError as e:
        return str(e)
    return ""


def main(argv: List[str]) -> int:
    from tandem.trainer.parallel.gradients import GradientFinisher
    from tandem.trainer.parallel.pipeline import Pipeline

    out_dir, layouts = argv[0], argv[1:]
    torch.set_num_threads(1)
    recorder = CollectiveRecorder().install()
    events = []

    def recorded(kind, fn):
        def wrapper(self, *args):
            recorder.active = True
            before = all_reduces(recorder)
            try:
                return fn(self, *args)
            finally:
                recorder.active = False
                events.append((kind, sorted(args[0]) if args else None,
                               all_reduces(recorder) - before))
        return wrapper

    GradientFinisher.start = recorded("start", GradientFinisher.start)
    GradientFinisher.sync = recorded("sync", GradientFinisher.sync)
    stage_done = Pipeline._stage_done

    def noted_stage_done(self, stage):
        events.append(("stage_done", stage, 0))
        return stage_done(self, stage)

    Pipeline._stage_done = noted_stage_done
    for layout in layouts:
        events.clear()
        result = worker.run_layout(layout)
        torch.save({"events": list(events), "losses": result["losses"],
                    "second_backward": second_backward(layout)},
                   os.path.join(out_dir, f"{layout}.rank{dist.get_rank()}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
