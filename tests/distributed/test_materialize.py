"""No rank ever holds the whole model: under each layout every rank builds its shards from the meta
device (seeded, or read from `model.init_from` slice by slice), its weights gathered equal the
one-process build's exactly, and no tensor it allocated while building exceeded its largest shard
(or one generated row block); see materialize_worker.py."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = ["dp=4", "tp=2,dp=2", "ep=2,tp=2", "pp=2,tp=2", "tp=2,dp=2+init", "ep=2,pp=2+init"]
SHARED_JOBS = [(4, "tests.distributed.materialize_worker", LAYOUTS)]  # the shared 4-rank launch


def test_layouts_materialise_only_their_shards_and_equal_one_process(shared_jobs):
    for layout in LAYOUTS:
        for r in range(4):
            assert (shared_jobs / f"{layout}.rank{r}.ok").exists(), layout
