"""The all-reduce mode's gradient buckets: sums equal one all-reduce per parameter, bit for bit, and
buckets go out during backward when armed (2 ranks, a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed]
HERE = os.path.dirname(os.path.abspath(__file__))


def test_buckets_overlap_backward_and_sum_exactly():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(HERE, "grad_buckets_worker.py")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count(" ok launched_in_backward=") == 2
