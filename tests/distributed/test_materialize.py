"""No rank ever holds the whole model: under each layout every rank builds its shards from the meta
device (seeded, or read from `model.init_from` slice by slice), its weights gathered equal the
one-process build's exactly, and no tensor it allocated while building exceeded its largest shard
(or one generated row block); see materialize_worker.py."""

from __future__ import annotations

import pytest

from tests.distributed import torchrun, worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = ["dp=4", "tp=2,dp=2", "ep=2,tp=2", "pp=2,tp=2", "tp=2,dp=2+init", "ep=2,pp=2+init"]


def test_layouts_materialise_only_their_shards_and_equal_one_process(tmp_path):
    import torch

    from tandem.models import TandemModel
    from tandem.trainer.hf.export import export_hf

    # a checkpoint whose trunk differs from the seeded init (and has no MTP weights: those come from
    # the seed)
    cfg = worker.make_cfg("single", 2)
    torch.manual_seed(7)
    mtp = type(cfg.mtp)(num_steps=0)
    export_hf(TandemModel(cfg.model, mtp), str(tmp_path / "hf"), "glm4_moe", cfg=cfg.model, mtp=mtp)
    proc = torchrun.run(4, "tests.distributed.materialize_worker", tmp_path, tmp_path / "hf",
                        *LAYOUTS)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for layout in LAYOUTS:
        for r in range(4):
            assert (tmp_path / f"{layout}.rank{r}.ok").exists(), layout
