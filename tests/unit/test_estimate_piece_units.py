"""--check's memory for pieces two pipeline stages of one rank share (the embedding, head and MTP
module of an interleaved layout with spread loss depths): FSDP units of their own, sharded over dp x
ep like every other dense parameter, each holding an unsharded fp32 gradient accumulator through the
step for its one reduce-scatter (trainer/parallel/data.py PieceUnits). Worked out by hand from the
parameter counts of the model itself (on the meta device). Before, these pieces counted whole on
every dp rank."""

from __future__ import annotations

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.estimate import GIB, estimate
from tandem.trainer.parallel.pipeline_plan import PipelinePlan
from tandem.trainer.recipe import load_config

# a dense trunk of 6 layers; interleaved pp=2 (4 stages), layers on stages 0 and 1, MTP depth 1 on
# stage 1 and depth 2 on stage 3 (both pp rank 1: embedding, head and MTP module shared), the
# trunk's head on 2
BASE = ["model.vocab_size=320", "data.vocab_size=320", "model.hidden_size=64", "model.num_layers=6",
        "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=256",
        "model.num_experts=0",
        "model.max_seq_len=64", "mtp.num_steps=2", "data.seq_len=8", "train.micro_batch_size=1",
        "train.grad_accum_steps=4", "train.dtype=bf16", "device=cpu", "parallel.pp=2",
        "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_layout=[3,3,0,0]",
        "parallel.pp_depth_stages=[2,1,3]"]


def counts():
    cfg = load_config(None, BASE)
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp)
    n = {}
    for name, p in model.named_parameters():
        key = (
            name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2])
        )
        n[key] = n.get(key, 0) + p.numel()
    return cfg, n


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_pieces_shared_within_a_rank_count_sharded_with_their_step_accumulator(reduce):
    cfg, n = counts()
    plan = PipelinePlan(cfg)
    units = plan.shared_within_rank()
    # the case exercises every kind of piece
    assert set(units) == {"embed_tokens", "lm_head", "mtp"}
    est = estimate(load_config(None, BASE + [f"train.grad_reduce_dtype={reduce}"]), 4)  # dp = 2
    act = est.activations_gib_per_rank * GIB
    states, buffers = [], []
    for r in range(2):
        stages = plan.stages_of(r)
        layers = [f"layers.{i}" for s in stages for i in plan.split[s]]
        pieces = {x for s in stages for x in plan.stage_pieces(s)}
        # fp32 master + gradient + two AdamW moments: every parameter in halves over dp = 2, units
        # too
        states.append(16 * sum(n[k] for k in layers + sorted(pieces)) / 2)
        root = sum(n[x] for x in pieces if x not in units)
        # the root group: bf16 gradients through backward, its fp32 reduce-scatter input past the
        # activations; a unit: its whole fp32 accumulator and one backward's bf16 gradient through
        # the step (and the bf16 copy a bf16 reduce-scatter sends)
        per_unit = 4 + 2 + (2 if reduce == "bf16" else 0)
        buffers.append(2 * root + max(0.0, 4 * root - act) + per_unit * sum(n[x] for x in pieces
                                                                            if x in units))
    assert est.states_gib_per_rank == pytest.approx(max(states) / GIB, rel=1e-9)
    assert est.grad_buffers_gib_per_rank == pytest.approx(max(buffers) / GIB, rel=1e-9)


def test_the_all_reduce_mode_holds_no_accumulator():
    """dp_mode=allreduce keeps the shared pieces whole (replicate): no unit, no step accumulator."""
    est = estimate(load_config(None, BASE + ["parallel.dp_mode=allreduce"]), 4)
    assert est.grad_buffers_gib_per_rank == 0
