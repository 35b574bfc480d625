"""Impossible layouts fail with one clear line before any process-group work (no torch.distributed)."""

from __future__ import annotations

import pytest

from tandem.trainer.config import ConfigError, load_config
from tandem.trainer.parallel.validate import stage_layer_split, validate_layout

BASE = ["model.num_heads=4", "model.num_kv_heads=2", "model.num_experts=4", "model.num_layers=4",
        "model.vocab_size=4096", "data.seq_len=64", "train.grad_accum_steps=2"]


def cfg(*overrides):
    return load_config(None, BASE + list(overrides))


@pytest.mark.parametrize("overrides,world,needle", [
    (["parallel.tp=2"], 3, "not divisible by parallel.tp*pp*ep"),
    (["parallel.tp=2", "parallel.dp=2"], 2, "does not equal the world size 2"),
    (["parallel.tp=4", "model.num_kv_heads=2"], 4, "model.num_kv_heads=2 is not divisible by parallel.tp=4"),
    (["parallel.tp=8"], 8, "model.num_heads=4 is not divisible by parallel.tp=8"),
    (["parallel.ep=3", "model.num_experts=4"], 3, "model.num_experts=4 is not divisible by parallel.ep=3"),
    (["parallel.pp=3"], 3, "model.num_layers=4 is not divisible by the 3 pipeline stages"),
    (["parallel.pp=2", "parallel.pp_layout=[1,2]"], 2, "must be positive and sum to model.num_layers=4"),
    (["parallel.pp=2", "parallel.pp_layout=[4]"], 2, "has 1 entries but the pipeline has 2 stages"),
    (["parallel.pp=4", "train.grad_accum_steps=2"], 4, "train.grad_accum_steps=2 pipeline micro-batches is below the pipeline depth"),
    (["parallel.pp=2", "parallel.pp_microbatches=1"], 2, "parallel.pp_microbatches=1 pipeline micro-batches is below"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=63", "model.max_seq_len=128"], 2,
     "needs data.seq_len=63 divisible by parallel.tp=2"),
    (["parallel.tp=2", "train.distill=argmax"], 2, "train.distill='argmax' is not supported with parallel.tp=2"),
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
    assert validate_layout(cfg("parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"), 4) == 1


def test_stage_split_even_and_explicit():
    assert stage_layer_split(4, 2, []) == [[0, 1], [2, 3]]
    assert stage_layer_split(5, 2, []) == [[0, 1, 2], [3, 4]]
    assert stage_layer_split(4, 2, [1, 3]) == [[0], [1, 2, 3]]
