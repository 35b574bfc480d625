"""Starting a worker of this package under torchrun: the one place that builds the command line.

A worker runs as a module (`python -m torch.distributed.run ... -m tests.distributed.worker ...`)
from the repository root, so it imports its helpers by the same dotted names as the test modules do
(`from tests.distributed import worker`, `from tests.eval_helpers import ...`), with no sys.path
edits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import Callable, List, NoReturn

from tandem.trainer.parallel.layout import leave_distributed_process, run_as_process

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""What every launch adds to the environment: one intra-op thread per rank (2 shared cores), and no
warnings repeated by every rank."""


def command(world: int, module: str, *args) -> List[str]:
    """torchrun on `world` gloo ranks, each running `python -m module args...`; run it with
    cwd=ROOT."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", "-m", module, *map(str, args)]


def run(world: int, module: str, *args, timeout: float = 600,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """`command(world, module, *args)` from the repository root; the caller checks the return code
    (and what it reports on failure). Output and errors come back together in `stdout`, through a
    file, not a pipe, so ranks stuck in a collective cannot block the reader. Past `timeout` (a
    deadlock) torchrun is sent SIGTERM, which stops its ranks before it exits, and the return code
    is -1."""
    cmd = command(world, module, *args)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env or os.environ, **ENV), stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            code = -1
            log.write(f"\nstopped: no exit within {timeout} s\n")
        log.seek(0)
        return subprocess.CompletedProcess(cmd, code, log.read(), "")


def finish(main: Callable[[], int | None]) -> NoReturn:
    """A worker's entry point: `main` run the way a rank of `tandem` runs its command
    (`run_as_process`: no interpreter finalisation, where gloo's threads can abort a rank whose
    results are already written); at world size 1 it leaves the same way with main's code."""
    leave_distributed_process(run_as_process(main))
