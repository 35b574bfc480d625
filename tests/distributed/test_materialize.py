"""No rank ever holds the whole model: under each layout every rank builds its shards from the meta
device (seeded, or read from `model.init_from` slice by slice), its weights gathered equal the
one-process build's exactly, and no tensor it allocated while building exceeded its largest shard
(or one generated row block); see materialize_worker.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import worker  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = ["dp=4", "tp=2,dp=2", "ep=2,tp=2", "pp=2,tp=2", "tp=2,dp=2+init", "ep=2,pp=2+init"]


def test_layouts_materialise_only_their_shards_and_equal_one_process(tmp_path):
    import torch

    from tandem.models import TandemModel
    from tandem.trainer.hf.export import export_hf

    # a checkpoint whose trunk differs from the seeded init (and has no MTP weights: those come from the seed)
    cfg = worker.make_cfg("single", 2)
    torch.manual_seed(7)
    mtp = type(cfg.mtp)(num_steps=0)
    export_hf(TandemModel(cfg.model, mtp), str(tmp_path / "hf"), "glm4_moe", cfg=cfg.model, mtp=mtp)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           os.path.join(HERE, "materialize_worker.py"), str(tmp_path), str(tmp_path / "hf"), *LAYOUTS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for layout in LAYOUTS:
        for r in range(4):
            assert (tmp_path / f"{layout}.rank{r}.ok").exists(), layout
