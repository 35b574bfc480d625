"""A shared-launch job (shared_launch.py) that counts its runs and can kill rank 0 with SIGSEGV, as
a native crash inside torch would: `main([dir, mode])`, mode `steady` (never), `crash_once` (on
its first run only) or `crash` (on every run)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import List

import torch
import torch.distributed as dist


def main(argv: List[str]) -> int:
    out, mode = Path(argv[0]), argv[1]
    rank = dist.get_rank()
    runs = out / f"runs.rank{rank}"
    with open(runs, "a") as f:
        f.write("run\n")
    first = len(runs.read_text().splitlines()) == 1
    if rank == 0 and (mode == "crash" or (mode == "crash_once" and first)):
        os.kill(os.getpid(), signal.SIGSEGV)  # faulthandler prints the stack, then the signal kills
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size() * (dist.get_world_size() + 1) / 2, total
    return 0
