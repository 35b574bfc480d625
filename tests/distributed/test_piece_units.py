"""Pieces two pipeline stages of one rank share (the interleaved schedule's embedding on the first
stage and an MTP stage, the head and MTP module on two depth stages) are FSDP units of their own:
sharded over dp x ep like every other dense parameter (they were whole on every data-parallel rank),
gathered through the step and reduce-scattered once after the rank's last stage using them
(trainer/parallel/data.py PieceUnits), and the step still trains like one process, in fp32 (those
layouts are test_parallel_equivalence.py's) and bf16, the flagship layout's shape (tp x ep x pp +
SP) included. The layouts train in the shared launch of tests/conftest.py."""

from __future__ import annotations

import math

import pytest

from tests.distributed import test_parallel_equivalence as eq
from tests.distributed import worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 4 stages on 2 pp ranks, layers on stages 0 and 1; MTP depth 1 on stage 1 and depth 2 on stage 3
# (pp rank 1: embedding, head and MTP module used by both its stages), the trunk's head on stage 2
SHARED = "pp_schedule=interleaved_1f1b,pp_layout=[2:2:0:0],pp_depth_stages=[2:1:3]"
# equivalence: test_parallel_equivalence.py
LAYOUTS = {f"pp=2,dp=2,{SHARED}": 4, f"ep=2,pp=2,{SHARED}": 4}
BF16_LAYOUTS = {
    f"ep=2,pp=2,{SHARED},{eq.BF16}": 4,  # equivalence: test_parallel_equivalence.py
    # a step's bf16 gradients summed in fp32 over its micro-batches and stages, sent once in bf16
    f"pp=2,dp=2,{SHARED},{eq.BF16},train.grad_reduce_dtype=bf16": 4,
    # the flagship layout's shape: the vocab-parallel embedding and head, SP, experts over ep
    f"tp=2,ep=2,pp=2,sequence_parallel=true,{SHARED},{eq.BF16}": 8,
}
NEW_BF16 = [layout for layout in BF16_LAYOUTS if layout not in eq.BF16_LAYOUTS]


@pytest.fixture(scope="module")
def runs(training_layout_runs):
    """LAYOUTS and BF16_LAYOUTS trained (tests/conftest.py: one launch per world size with the other
    modules')."""
    return training_layout_runs


references = eq.references


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(BF16_LAYOUTS))
def test_shared_pieces_are_sharded_over_dp_ep(layout, runs):
    """Every rank holds 1/(dp x ep) of each parameter of the shared pieces (rows, FSDP's padding
    aside), 1/(tp x dp x ep) of the vocab-parallel embedding and head: not the whole piece (tp
    shard) as before."""
    from tandem.trainer.parallel.pipeline_plan import PipelinePlan

    kv = dict(item.split("=", 1) for item in layout.split(","))
    world = {**LAYOUTS, **BF16_LAYOUTS}[layout]
    tp, batch = int(kv.get("tp", 1)), eq.batch_ranks(layout)
    shared = PipelinePlan(worker.make_cfg(layout, worker.GRAD_ACCUM)).shared_within_rank()
    assert set(shared) == {"embed_tokens", "lm_head", "mtp"}
    ranks = eq.load_ranks(runs, layout, world)
    _, full = eq.load(runs, layout, world)
    checked = set()
    for r in ranks:
        for name, numel in r["local_numel"].items():
            if name.split(".", 1)[0] not in shared:
                continue
            whole = full[name]
            # kept whole in fp32 (data.fp32_parameters)
            if "dtype=bf16" in layout and eq.kept_fp32(name):
                assert numel == whole.numel(), (layout, name, numel, tuple(whole.shape))
            elif name in ("embed_tokens.weight", "lm_head.weight"):
                assert numel * tp * batch == whole.numel(), (layout, name, numel,
                                                             tuple(whole.shape))
            else:
                rows = math.ceil(whole.shape[0] / batch) if whole.dim() else 1
                assert numel <= rows * whole[0].numel() < whole.numel(), (layout, name, numel,
                                                                          tuple(whole.shape))
            checked.add(name.split(".", 1)[0])
    assert checked == set(shared), checked


@pytest.mark.parametrize("layout", NEW_BF16)
def test_bf16_layout_matches_single_process(layout, runs, references, monkeypatch):
    monkeypatch.setattr(eq, "BF16_LAYOUTS", BF16_LAYOUTS)
    eq.test_bf16_layout_matches_single_process(layout, runs, references)


@pytest.mark.parametrize("layout", NEW_BF16)
def test_collectives_carry_no_float64_and_show_each_mechanism(layout, runs, monkeypatch):
    monkeypatch.setattr(eq, "BF16_LAYOUTS", BF16_LAYOUTS)
    eq.test_collectives_carry_no_float64_and_show_each_mechanism(layout, runs)
