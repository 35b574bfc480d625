"""bench/finetune_memory.py keeps running: its --quick mode (a small MoE checkpoint, 2 FSDP ranks)
fine-tunes MTP and prints the contract's last line; the step checkpoint holds no trunk (well under
the fp32 model's size)."""

import os
import re
import sys

import pytest

from tests import processes

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_finetune_memory_bench_quick(tmp_path, corpus_cache):
    proc = processes.command([sys.executable, os.path.join(ROOT, "bench", "finetune_memory.py"),
                              "--quick", "--workdir", str(tmp_path), "--cache-dir", corpus_cache],
                             timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"peak_rss_over_fp32_model=(-?[\d.]+) checkpoint_over_fp32_model=([\d.]+)",
                     last)
    assert m, last
    assert 0 < float(m.group(2)) < 0.5  # MTP module + its optimizer state only
