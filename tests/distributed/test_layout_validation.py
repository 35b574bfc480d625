"""Impossible layouts fail with one clear line before any process-group work (no
torch.distributed)."""

from __future__ import annotations

import pytest

from tandem.trainer.config_checks import ConfigError
from tandem.trainer.parallel.pipeline_plan import stage_layer_split
from tandem.trainer.parallel.validate import pipeline_microbatches, validate_layout
from tandem.trainer.recipe import load_config

BASE = ["model.num_heads=4", "model.num_kv_heads=2", "model.num_experts=4", "model.num_layers=4",
        "model.vocab_size=4096", "data.seq_len=64", "train.grad_accum_steps=2"]


def cfg(*overrides):
    return load_config(None, BASE + list(overrides))


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.tp=2"], 3, "not divisible by parallel.tp*pp*cp*ep"),
    (["parallel.tp=2", "parallel.dp=2"], 2, "does not equal the world size 2"),
    (["parallel.tp=4", "model.num_kv_heads=2"], 4,
     "model.num_kv_heads=2 is not divisible by parallel.tp=4"),
    (["parallel.tp=8"], 8, "model.num_heads=4 is not divisible by parallel.tp=8"),
    (["parallel.ep=3", "model.num_experts=4"], 3,
     "model.num_experts=4 is not divisible by parallel.ep=3"),
    (["parallel.pp=3", "parallel.pp_layout=[2,0,2]"], 3,
     "pipeline stage(s) [1] hold no trunk layer and no loss depth"),
    (["parallel.pp=2", "parallel.pp_layout=[1,2]"], 2, "must sum to model.num_layers=4"),
    (["parallel.pp=2", "parallel.pp_layout=[0,4]"], 2,
     "with at least one layer on the first stage"),
    (["parallel.pp=2", "parallel.pp_depth_stages=[1,1]"], 2,
     "has 2 entries but there are 4 loss depths"),
    (["parallel.pp=2", "parallel.pp_depth_stages=[0,1,1,1]"], 2,
     "at or after stage 1 (the trunk's last layer)"),
    (["parallel.pp=2", "parallel.pp_layout=[2,2]", "parallel.pp_depth_stages=[1,1,1,0]"], 2,
     "at or after stage 1"),
    (["parallel.pp=3", "parallel.pp_layout=[3,1,0]", "parallel.pp_depth_stages=[1,2,1,2]"], 3,
     "MTP depths must be in pipeline order"),
    # it named only the rule ("and one on the last stage 1")
    (["parallel.pp=2", "parallel.pp_depth_stages=[1,5,1,1]"], 2,
     "parallel.pp_depth_stages=[1, 5, 1, 1] names stage 5, but the pipeline has stages 0..1"),
    (["parallel.pp=2", "parallel.pp_balance=true", "parallel.pp_layout=[2,2]"], 2,
     "leave them empty"),
    (["parallel.pp=2", "parallel.pp_depth_stages=[0,1,1,1]", "parallel.pp_layout=[4,0]",
      "model.tie_embeddings=true"],
     2,
     "model.tie_embeddings=true is not supported with loss depths spread"),
    (["parallel.pp=2", "parallel.pp_layout=[4]"], 2, "has 1 entries but the pipeline has 2 stages"),
    (["parallel.pp=4", "train.micro_batch_size=1"], 4,
     "train.micro_batch_size*train.grad_accum_steps = 1*2 = 2 sequences per step per data-parallel "
     "rank cannot be "
     "split "
     "into parallel.pp=4 pipeline micro-batches; make it at least 4"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "train.micro_batch_size=3",
      "train.grad_accum_steps=1"],
     2, "cannot be split into parallel.pp=2 pipeline micro-batches; make it a multiple of 2"),
    (["parallel.pp=2", "parallel.pp_microbatches=1"], 2,
     "parallel.pp_microbatches=1 pipeline micro-batches is below"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=63",
      "model.max_seq_len=128"], 2,
     "needs data.seq_len=63 divisible by parallel.tp*cp=2"),
    (["parallel.cp=2", "data.seq_len=30"], 2,
     "parallel.cp_sharding=zigzag cuts data.seq_len=30 into 4"),
    (["parallel.tp=2", "train.distill=argmax"], 2,
     "train.distill='argmax' is not supported with parallel.tp=2"),
])
def test_impossible_layouts_are_one_line_config_errors(overrides, world, needle):
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg(*overrides), world)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_valid_layouts_return_dp():
    assert validate_layout(cfg("parallel.tp=2", "parallel.pp=2"), 8) == 2
    assert validate_layout(cfg("parallel.ep=2"), 2) == 1
    assert validate_layout(cfg(), 1) == 1
    assert validate_layout(cfg("parallel.tp=2", "parallel.sequence_parallel=true"), 2) == 1
    assert validate_layout(cfg("parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"),
                           4) == 1


def test_stage_split_even_and_explicit():
    assert stage_layer_split(4, 2, []) == [[0, 1], [2, 3]]
    assert stage_layer_split(5, 2, []) == [[0, 1, 2], [3, 4]]
    assert stage_layer_split(4, 2, [1, 3]) == [[0], [1, 2, 3]]
    assert stage_layer_split(4, 3, []) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("overrides,expected", [
    # docs/parallelism.md's pp=2 line
    (["parallel.pp=2", "train.grad_accum_steps=1", "train.micro_batch_size=8"], 2),
    (["parallel.pp=2", "train.grad_accum_steps=4"], 4),  # accumulation already fills the pipeline
    # 4 and 5 do not divide 6
    (["parallel.pp=4", "train.grad_accum_steps=1", "train.micro_batch_size=6"], 6),
    (["parallel.pp=4", "train.grad_accum_steps=1", "train.micro_batch_size=6",
      "parallel.pp_schedule=gpipe"], 6),
    # 3 is no multiple of pp: 6 micro-batches of 1, not 2 of 3 (over train.micro_batch_size)
    (["parallel.pp=2", "train.grad_accum_steps=3", "train.micro_batch_size=2",
      "parallel.pp_schedule=interleaved_1f1b"], 6),
    (["parallel.pp=4", "train.grad_accum_steps=6", "train.micro_batch_size=4",
      "parallel.pp_schedule=interleaved_1f1b"], 8),  # 8 of 3, not 4 of 6
    (["parallel.pp=2", "parallel.pp_microbatches=4"], 4),
    (["parallel.pp=1", "train.grad_accum_steps=3"], 3),
])
def test_pipeline_microbatches_fill_the_pipeline(overrides, expected):
    c = cfg(*overrides)
    n = pipeline_microbatches(c)
    assert n == expected
    total = c.train.micro_batch_size * c.train.grad_accum_steps
    assert total % n == 0 and (n >= c.parallel.pp)
    assert total // n <= c.train.micro_batch_size
