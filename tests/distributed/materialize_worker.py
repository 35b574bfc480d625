"""Under torchrun: build the model for each layout the way the trainer does (meta -> parallelize ->
materialise) and check, on every rank, (1) its gathered weights equal the one-process build's and
(2) no tensor it allocated while building was larger than its own shards (so no rank ever held a
whole sharded parameter). A layout ending in `+init` builds from the checkpoint INIT_DIR instead of
the seed (its missing MTP module from the seed).
Exits non-zero (with the offending names) on a failure; writes OUT/<layout>.rank<r>.ok otherwise.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import torchrun, worker


class LargestAllocation(TorchDispatchMode):
    """Records the largest non-meta plain tensor any op produced."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.overloadpacket in (torch.ops.aten.set_,)
            or torch.Tag.view_copy in func.tags
            or func.is_view
        ):
            # binds or views existing memory (set_: safetensors' mmap of the file), allocates
            # nothing
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            # a DTensor's size is global; its local tensor is produced by an op of its own
            if type(t) is torch.Tensor and not t.is_meta and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)
        return out


def full_params(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float()
            for n, p in list(model.named_parameters()) + list(model.named_buffers())}


def main(out_dir: str, init_from: str, layouts) -> int:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tandem.trainer import seeded_init
    from tandem.trainer.parallel import ParallelState, init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model

    torch.set_num_threads(1)
    seeded_init.INIT_BLOCK_ELEMS = 16  # blocks of one row: a whole tensor is never one block
    device = resolve_device("cpu")
    failures = []
    for layout in layouts:
        cfg = worker.make_cfg(layout.removesuffix("+init"), 2)
        cfg.model.init_from = init_from if layout.endswith("+init") else ""
        ref = full_params(build_model(cfg, ParallelState(device=device)))
        pstate = init_parallel(cfg, device)
        probe = LargestAllocation()
        with probe:
            model = build_model(cfg, pstate)
        # the bound: this rank's largest shard, or one generated row block
        bound = 0
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            row = max(1, p[0].numel()) if p.dim() > 1 else 1
            bound = max(bound, local.numel(), row)
        if probe.largest > bound:
            failures.append(f"{layout}: allocated a tensor of {probe.largest} elements "
                            f"({probe.op}); "
                            f"its largest shard has {bound}")
        got = full_params(model)
        for name, value in got.items():
            if "tokens_per_expert" in name:
                continue
            if name not in ref or not torch.equal(ref[name], value):
                failures.append(f"{layout}: {name} differs from the one-process build")
        if not failures:
            open(os.path.join(out_dir, f"{layout}.rank{dist.get_rank()}.ok"), "w").close()
        dist.barrier()
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {int(os.environ['RANK'])}: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    init_from = sys.argv[2] if sys.argv[2] != "-" else ""
    torchrun.finish(lambda: main(sys.argv[1], init_from, sys.argv[3:]))
