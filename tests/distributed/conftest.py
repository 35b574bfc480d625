"""Shared fixtures of the distributed tests."""

from __future__ import annotations

import pytest

# test module -> the names of its {layout: world size} tables that worker.py trains
TRAINING_LAYOUT_TABLES = {
    "test_parallel_equivalence": ("LAYOUTS", "BF16_LAYOUTS", "ACCUMULATION"),
    "test_qwen4_layouts": ("LAYOUTS", "BF16_LAYOUTS"),
    "test_compile_layout": ("EAGER", "COMPILED"),
}


@pytest.fixture(scope="session")
def training_layout_runs(request, tmp_path_factory):
    """The layouts of every training-equivalence module collected in this session, trained by one
    torchrun launch per world size (tests/distributed/worker.py) into one directory: each launch starts
    its ranks, imports torch and forms the process group once, which on a 2-core machine costs as much
    as several layouts. Compiled layouts run last in their launch (they switch dynamo settings)."""
    import sys

    from test_parallel_equivalence import launch

    collected = {item.module.__name__.rsplit(".", 1)[-1] for item in request.session.items
                 if getattr(item, "module", None) is not None}
    by_world = {}
    for name, tables in TRAINING_LAYOUT_TABLES.items():
        if name not in collected:
            continue
        module = sys.modules[next(m for m in sys.modules if m.rsplit(".", 1)[-1] == name)]
        for table in tables:
            for layout, world in getattr(module, table).items():
                by_world.setdefault(world, []).append(layout)
    out = tmp_path_factory.mktemp("layouts")
    for world, layouts in sorted(by_world.items()):
        launch(out, world, sorted(layouts, key=lambda layout: "train.compile=true" in layout))
    return out
