"""Where a run's checkpoints live and which of them are complete: the directory layout alone, read
by the trainer's checkpointing (checkpoint.py) and by `model.init_from` (hf/init_from.py)."""

from __future__ import annotations

import os
import re
import sys
from typing import List, Optional, Tuple

import torch.distributed as dist

MARKER = "COMPLETE"
"""File whose presence marks a checkpoint directory as complete (written last)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str) -> Tuple[List[Tuple[int, str]], List[str]]:
    """(complete checkpoints sorted by step, incomplete directories)."""
    root = checkpoints_root(run_dir)
    complete, incomplete = [], []
    if not os.path.isdir(root):
        return complete, incomplete
    for name in os.listdir(root):
        path = os.path.join(root, name)
        match = _STEP_DIR.match(name)
        if match and os.path.exists(os.path.join(path, MARKER)):
            complete.append((int(match.group(1)), path))
        elif os.path.isdir(path):
            incomplete.append(path)
    complete.sort()
    return complete, sorted(incomplete)


def latest_checkpoint(run_dir: str, report: bool = True) -> Optional[Tuple[int, str]]:
    complete, incomplete = list_checkpoints(run_dir)
    if incomplete and report and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"checkpoint: ignoring incomplete checkpoint(s): {', '.join(incomplete)}",
              file=sys.stderr)
    return complete[-1] if complete else None


def resolve_checkpoint(path: str) -> str:
    """A step directory, or a run directory's newest complete checkpoint."""
    if os.path.exists(os.path.join(path, MARKER)):
        return path
    found = latest_checkpoint(path, report=False)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {path} (expected a step_<N>/ with "
                                f"{MARKER}, or a run "
                                "directory holding one)")
    return found[1]
