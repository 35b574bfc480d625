"""The context-parallel benchmarks run at tiny sizes, so they cannot rot between the runs that
produce docs/long_context.md's measured figures: bench/context_scaling.py (cp = 1 and 2, 128 and 256
tokens) and bench/comm_volume.py's cp=2 layout (every collective of a step against the analytic
count, and the cp exchanges against trainer/context_cost.py's bytes sent)."""

from __future__ import annotations

import os
import sys

import pytest

from tests import processes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args):
    proc = processes.command([sys.executable, *args], timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_context_scaling_bench():
    lines = _run(["bench/context_scaling.py", "--seqs", "128,256", "--cps", "1,2"])
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[0] in ("128",
                                                                                       "256")}
    assert set(rows) == {"128", "256"}
    for cells in rows.values():  # MiB and seconds per cp
        assert len(cells) == 4 and all(float(x) > 0 for x in cells)
    assert any(line.startswith("S and cp together: S=128 cp=1") for line in lines)
    assert (
        lines[-1].startswith("diagonal_max_over_min=")
        and float(lines[-1].split()[0].split("=")[1]) >= 1.0
    )


def test_comm_volume_cp_layout():
    """Every collective of a cp=2 step, for the MoE model and for Qwen4-Exp (its MTP depth 2
    reusing depth 1's QSA selection gathers no indexer keys), against the analytic counts."""
    lines = _run(["bench/comm_volume.py", "cp=2", "qwen4:cp=2"])
    ratios = [float(line.split()[-1]) for line in lines
              if line.startswith(("cp=2 ", "qwen4:cp=2 ")) and "cp sent" not in line]
    assert len(ratios) >= 8 and all(r == pytest.approx(1.0, abs=1e-3) for r in ratios), lines
    sent = [line for line in lines if "cp sent/microb." in line]
    assert len(sent) == 2 and all(float(line.split()[5]) == pytest.approx(1.0, abs=1e-3)
                                  for line in sent), sent
    assert lines[-2] == "max_measured_over_analytic=1.0000"
    assert lines[-1] == "context_cost_sent_max_deviation=0.0000"
