"""The benchmarks run (tiny sizes, a couple of steps), so they cannot rot between the runs that
produce the README's figures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mtp_objectives_bench(tiny_base, tmp_path):
    cmd = [sys.executable, "bench/mtp_objectives.py", "--steps", "2", "--objectives", "ce,acceptance,soft",
           "--num-prompts", "2", "--prompt-len", "8", "--max-new-tokens", "6", "--out", str(tmp_path), *tiny_base]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.split()[0] in ("ce", "acceptance", "soft")}
    assert set(rows) == {"ce", "acceptance", "soft"}
    for row in rows.values():
        greedy, sampled = float(row[1]), float(row[2])
        assert 1.0 <= greedy <= 3.0 and 1.0 <= sampled <= 3.0  # K=2: at most 3 tokens per verify
    assert lines[-1].startswith("best_greedy=") and " best_t1=" in lines[-1]
    for objective in ("ce", "acceptance", "soft"):
        assert os.path.isdir(tmp_path / objective / "checkpoints")
