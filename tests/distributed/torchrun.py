"""Starting a worker of this package under torchrun: the one place that builds the command line.

A worker runs as a module (`python -m torch.distributed.run ... -m tests.distributed.worker ...`) from
the repository root, so it imports its helpers by the same dotted names as the test modules do
(`from tests.distributed import worker`, `from tests.eval_helpers import ...`), with no sys.path edits."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""What every launch adds to the environment: one intra-op thread per rank (2 shared cores), and no
warnings repeated by every rank."""


def command(world: int, module: str, *args) -> List[str]:
    """torchrun on `world` gloo ranks, each running `python -m module args...`; run it with cwd=ROOT."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", module, *map(str, args)]


def run(world: int, module: str, *args, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`command(world, module, *args)` from the repository root, its output captured; the caller checks
    the return code (and what it reports on failure)."""
    return subprocess.run(command(world, module, *args), cwd=ROOT, env=dict(env or os.environ, **ENV),
                          capture_output=True, text=True, timeout=timeout)
