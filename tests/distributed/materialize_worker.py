"""In the suite's shared 4-rank launch (test_materialize.py, shared_launch.py): build the model for
each layout the way the trainer does (meta -> parallelize -> materialise) and check, on every rank,
(1) its gathered weights equal the one-process build's and (2) no tensor it allocated while
building was larger than its own shards (so no rank ever held a whole sharded parameter). A layout
ending in `+init` builds from the checkpoint OUT/hf instead of the seed (its missing MTP module
from the seed), which rank 0 exports first. Raises with the offending names on a failure; writes
OUT/<layout>.rank<r>.ok otherwise."""

from __future__ import annotations

import os
from typing import List
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import worker


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


def export_init_checkpoint(path: str) -> None:
    """A glm4_moe export whose trunk differs from the seeded init (and has no MTP weights: those
    come from the seed)."""
    from tandem.models import TandemModel
    from tandem.trainer.hf.export import export_hf

    cfg = worker.make_cfg("single", 2)
    torch.manual_seed(7)
    mtp = type(cfg.mtp)(num_steps=0)
    export_hf(TandemModel(cfg.model, mtp), path, "glm4_moe", cfg=cfg.model, mtp=mtp)


def main(argv: List[str]) -> int:
    import torch.distributed as dist

    from tandem.trainer.parallel import sharded_params

    out_dir, layouts = argv[0], argv[1:]
    init_from = os.path.join(out_dir, "hf")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        export_init_checkpoint(init_from)
    dist.barrier()
    # blocks of one row, so a whole tensor is never one block; restored on leaving, as the launch's
    # later jobs build models as the trainer does
    with mock.patch.object(sharded_params, "INIT_BLOCK_ELEMS", 16):
        failures = check_layouts(out_dir, init_from, layouts)
    if failures:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(failures))
    return 0


def check_layouts(out_dir: str, init_from: str, layouts: List[str]) -> List[str]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tandem.trainer.parallel import ParallelState, init_parallel
    from tandem.trainer.parallel.device import resolve_device
    from tandem.trainer.run import build_model

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
        # every tensor is built on some rank (a pipeline rank holds its stage's only)
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, set(got))
        missing = set(ref) - set().union(*held)
        if missing:
            failures.append(f"{layout}: no rank built {sorted(missing)}")
        if not failures:
            open(os.path.join(out_dir, f"{layout}.rank{dist.get_rank()}.ok"), "w").close()
        dist.barrier()
    return failures
