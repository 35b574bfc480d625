"""Pipeline placement of trunk layers and loss depths (trainer/parallel/pipeline_plan.py): what
crosses each boundary, which pieces each rank holds, and the balancer against an exhaustive
search."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from tandem.trainer.parallel.pipeline_plan import (
    PipelinePlan,
    _partition,
    balanced_placement,
    item_flops,
    stage_flops,
)
from tandem.trainer.recipe import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_RECIPE = os.path.join(ROOT, "recipes", "moe_4b_mtp_gpu.yaml")
SMALL = ["model.num_layers=4", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.vocab_size=4096", "data.seq_len=64", "mtp.num_steps=2", "train.grad_accum_steps=4"]


def plan(*overrides):
    return PipelinePlan(load_config(None, SMALL + list(overrides)))


def test_boundaries_of_a_spread_placement():
    # 4 stages on 2 ranks: layers [2,2,0,0]; depth 1 with the trunk's last layers, the head on stage
    # 2, depth 2 on stage 3
    p = plan("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
             "parallel.pp_layout=[2,2,0,0]", "parallel.pp_depth_stages=[2,1,3]")
    assert p.trunk_end == 1 and p.spread
    assert [s.depths for s in p.stages] == [[], [1], [0], [2]]
    assert [s.chain_in for s in p.stages] == [0, 0, 1, 1]
    # h_0 leaves stage 1 beside h_1 because stage 2 (the head) needs it; stage 3 needs only h_1
    assert [(s.recv_h0, s.send_h0) for s in p.stages] == [(False, False), (False, True),
                                                          (True, False), (False, False)]
    assert [p.stage_pieces(s) for s in range(4)] == [["embed_tokens"],
                                                     ["embed_tokens", "lm_head", "mtp"],
                                                      ["norm", "lm_head"],
                                                     ["embed_tokens", "lm_head", "mtp"]]
    assert p.holders() == {"embed_tokens": [0, 1], "norm": [0], "lm_head": [0, 1], "mtp": [1]}
    # rank 1 runs stages 1 and 3, both with the head, the MTP module and the embedding
    assert p.shared_within_rank() == ["embed_tokens", "lm_head", "mtp"]


def test_qsa_selection_crosses_from_depth_1_to_the_last_reusing_depth():
    """With QSA index reuse, depth 1's selection leaves depth 1's stage and crosses every boundary
    up to the last reusing depth's stage, through a stage holding only the head; without reuse,
    nowhere."""
    qsa = ["model.full_attention_interval=2", "model.indexer_budget=8",
           "model.indexer_compress_ratio=4",
           "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layout=[2,2,0,0]",
           "parallel.pp_depth_stages=[2,1,3]"]
    p = plan(*qsa)
    assert [(s.recv_selection, s.send_selection) for s in p.stages] == \
        [(False, False), (False, True), (True, True), (True, False)]
    p = plan(*qsa, "mtp.qsa_reuse_indices=false")
    assert not any(s.recv_selection or s.send_selection for s in p.stages)


def test_teacher_and_parallel_style_carry_h0_to_every_mtp_stage():
    for extra in (["mtp.loss.objective=acceptance"], ["mtp.style=parallel", "mtp.num_layers=2"]):
        p = plan("parallel.pp=3", "parallel.pp_layout=[4,0,0]", "parallel.pp_depth_stages=[0,1,2]",
                 *extra)
        assert [(s.recv_h0, s.send_h0) for s in p.stages] == [(False, False), (False, True),
                                                              (True, False)], extra
        assert all("norm" in p.stage_pieces(s)
                   for s in (1, 2)) == (extra[0].startswith("mtp.loss")), extra
    looped = plan("parallel.pp=3", "parallel.pp_layout=[4,0,0]", "parallel.pp_depth_stages=[0,1,2]")
    assert [(s.recv_h0, s.send_h0) for s in looped.stages] == [(False, False)] * 3


def test_default_placement_is_every_depth_on_the_last_stage():
    p = plan("parallel.pp=2")
    assert p.layout == [2, 2] and p.depth_stage == [1, 1, 1] and not p.spread
    assert p.holders() == {"embed_tokens": [0, 1], "norm": [1], "lm_head": [1], "mtp": [1]}
    assert p.shared_within_rank() == []


def test_partition_hand_case():
    assert _partition([1, 1, 1, 1, 4], 2) == [4, 1]
    assert _partition([3, 1, 1, 3], 3) in ([1, 2, 1], [1, 1, 2], [2, 1, 1])
    assert _partition([1], 2) is None


def _all_placements(n_layers: int, k: int, stages: int):
    """Every valid (layout, depth stages) by brute force: the independent reference of the
    balancer."""
    for layout in itertools.product(range(n_layers + 1), repeat=stages):
        if sum(layout) != n_layers or layout[0] < 1:
            continue
        end = max(s for s in range(stages) if layout[s])
        for ds in itertools.product(range(end, stages), repeat=k + 1):
            if max(ds) != stages - 1 or any(ds[d] > ds[d + 1] for d in range(1, k)):
                continue
            if any(not layout[s] and s not in ds for s in range(stages)):
                continue
            yield list(layout), list(ds)


@pytest.mark.parametrize("stages,extra", [(2, []), (3, []), (4, ["model.vocab_size=32768"]),
                                          (4, ["data.seq_len=512"])])
def test_balancer_finds_the_exhaustive_optimum(stages, extra):
    cfg = load_config(None, SMALL + extra)
    layers, depths = item_flops(cfg)
    best = min(max(stage_flops(layers, depths, lay, ds)) for lay,
               ds in _all_placements(4, 2, stages))
    layout, ds = balanced_placement(cfg, stages)
    assert max(stage_flops(layers, depths, layout, ds)) == pytest.approx(best, rel=1e-12)


def test_flagship_recipe_is_balanced_and_the_bench_says_so():
    cfg = load_config(GPU_RECIPE, [])
    p = PipelinePlan(cfg)
    p.check(cfg)
    layers, depths = item_flops(cfg)
    flops = stage_flops(layers, depths, p.layout, p.depth_stage)
    ratio = max(flops) / (sum(flops) / len(flops))
    assert ratio <= 1.2
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pipeline_balance.py")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[-1] == f"max_stage_over_mean={ratio:.3f}"
    # the placement before spreading (even layers, every depth on the last stage, 2 stages per rank)
    # first
    before = PipelinePlan(load_config(GPU_RECIPE, ["parallel.pp_balance=false",
                                                   "parallel.pp_virtual_stages=2"]))
    t = stage_flops(layers, depths, before.layout, before.depth_stage)
    first = next(line for line in lines if "max_stage_over_mean=" in line)
    assert (
        first.strip()
        == f"max_stage_over_mean={max(t) / (sum(t) / len(t)):.3f}"
        == "max_stage_over_mean=2.588"
    )
