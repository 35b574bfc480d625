"""`parallel.dp_mode=allreduce` runs on torch's own replicate (FSDP2's machinery with replicated
parameters): gradients are all-reduced per module *during* the last micro-batch's backward, as soon
as each block's gradients are final, and not at all during the earlier micro-batches (their gradients
accumulate locally). That the sums are right is test_parallel_equivalence.py's job (every all-reduce
layout matches one process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed]
HERE = os.path.dirname(os.path.abspath(__file__))


def test_allreduce_mode_overlaps_the_last_backward_only():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(HERE, "allreduce_overlap_worker.py")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = re.findall(r"rank\d micro_batches=(\d+) blocks=(\d+) all_reduces_in_backward=([\d,]+)", proc.stdout)
    assert len(found) == 2, proc.stdout
    for micro, blocks, per_backward in found:
        per_backward = [int(n) for n in per_backward.split(",")]
        assert len(per_backward) == int(micro) >= 2, per_backward
        assert all(n == 0 for n in per_backward[:-1]), per_backward  # accumulation: no communication
        # one all-reduce per block at least (its own parameters, its experts), plus the root's
        assert per_backward[-1] >= int(blocks) + 1, per_backward
