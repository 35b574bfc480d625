"""A shared-launch job (shared_launch.py) whose rank 0 dies of SIGSEGV, as a native crash inside
torch would, while rank 1 waits in an all-reduce: `main([dir, mode])`, mode `crash` or `steady`
(the all-reduce only)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist


def rank_zero_dies() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # faulthandler prints the stack, then the signal kills


def main(argv: List[str]) -> int:
    out, mode = Path(argv[0]), argv[1]
    rank = dist.get_rank()
    (out / f"ran.rank{rank}").touch()
    if rank == 0 and mode == "crash":
        rank_zero_dies()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size() * (dist.get_world_size() + 1) / 2, total
    return 0
