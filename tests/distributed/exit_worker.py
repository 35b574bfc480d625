"""A rank that ends as a finished run ends (`-m tests.distributed.exit_worker [--leave]` under
torchrun): a gloo all_gather over the group of a device mesh that stays alive, as torch's DTensor
caches keep a run's meshes alive, then either `tandem`'s exit (`--leave`:
leave_distributed_process) or destroy_process_group and the interpreter's own exit, which often
aborts a rank (docs/parallelism.md, "How a rank exits", has the rates). As a job of a shared
launch (`main`, test_rank_exit.py) it gathers and keeps the mesh, and the launch leaves through
`tandem`'s exit."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tandem.trainer.parallel.layout import leave_distributed_process


def gather_over_a_kept_mesh():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    gathered = [torch.empty(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]), group=mesh.get_group())
    assert [int(t) for t in gathered] == list(range(world)), gathered
    return mesh


KEPT = []
"""The kept mesh (alive until the rank leaves)."""


def main(argv) -> int:
    """Gather over a mesh and keep it (a shared launch's job; argv unused)."""
    KEPT.append(gather_over_a_kept_mesh())
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
    if "--leave" in sys.argv:
        leave_distributed_process(0)
    dist.destroy_process_group()
