"""The in-loop evaluator on a parallel layout: speculative decoding of fixed prompts with weights that
make the MTP drafts mostly right (eval.testing.make_agreeing on the plain model, before it is
sharded), so acceptance is exercised. Run under torchrun (`eval_worker.py OUT LAYOUT...`, layouts as
in worker.py), or `evaluate("single")` in one process for the reference. Rank 0 writes
`OUT/<layout>.pt`: the eval/* figures and the speculative greedy tokens of every prompt.
"""

from __future__ import annotations

import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker  # noqa: E402

# 5 prompts in batches of 2: three batches, so two replicas split them unevenly (one pads a slot)
EVAL = ["eval.num_prompts=5", "eval.batch_size=2", "eval.max_new_tokens=14", "eval.loss_batches=1", "eval.interval=1"]


def prompts() -> List[List[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, worker.VOCAB, (4 + i,), generator=g).tolist() for i in range(5)]


@torch.no_grad()
def load_full_weights(model, full_state: dict):
    """Copy one-process weights into this rank's shards (TP/EP DTensors, FSDP shards, pipeline stages)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        src = full_state[name].to(p.dtype)
        if isinstance(p, DTensor):
            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(src)
    return model


def evaluate(layout: str) -> dict:
    from tandem.eval.in_loop import InLoopEvaluator
    from tandem.eval.testing import make_agreeing
    from tandem.trainer.loop import build_model
    from tandem.trainer.parallel import ParallelState, init_parallel
    from tandem.trainer.parallel.device import resolve_device

    cfg = worker.make_cfg(",".join([layout] + EVAL), worker.GRAD_ACCUM)
    device = resolve_device("cpu")
    single = ParallelState(device=device)
    pstate = single if layout == "single" else init_parallel(cfg, device)
    full = make_agreeing(build_model(cfg, single), 0.05, seed=1)  # the one-process weights
    model = full if pstate is single else load_full_weights(build_model(cfg, pstate), full.state_dict())
    model.train()
    ev = InLoopEvaluator(cfg, model, None, None, pstate)
    ev.prompts = prompts()
    ev.loss_batches = worker.rank_micro_batches(0, 0, 1, 1)
    out = ev.run(1)
    return {"metrics": out, "outputs": ev.last_outputs, "samples": ev.last_samples}


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    out_dir, layouts = argv[0], argv[1:]
    torch.set_num_threads(1)
    for layout in layouts:
        result = evaluate(layout)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, f"{layout}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
