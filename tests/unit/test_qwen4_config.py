"""Bad Qwen4-Exp shapes fail before any work with one line naming the key (the invariants
transformers' Qwen4ExpTextConfig validates, in Tandem's keys)."""

from __future__ import annotations

import pytest

from tandem.models import flavors
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig, validate_model


def qwen4(**over) -> ModelConfig:
    """The `debug_qwen4` flavor (models/flavors.py): 4 layers alternating Gated DeltaNet and QSA
    (head_dim 8, rotary 4), 4 hyper-connection streams, PLE on layer 0 with 2 x 2 n-gram heads of
    the width 32."""
    return flavors.model_config("debug_qwen4", **over)


def test_valid_qwen4_shape_passes():
    validate_model(qwen4(), MTPConfig())


@pytest.mark.parametrize("over,key", [
    # layer 1 is QSA: PLE only on linear_attention layers
    (dict(ple_layers=[1]), "model.ple_layers"),
    # each layer's table is numbered in this order, which transformers sorts
    (dict(ple_layers=[2, 0]), "model.ple_layers=[2, 0] must be increasing"),
    (dict(indexer_budget=10), "model.indexer_budget"),  # not divisible by the compress ratio
    (dict(indexer_head_dim=2), "model.indexer_head_dim"),  # rotary width 4 does not fit
    (dict(hc_count=1, ple_layers=[]), "mtp.combine"),  # the drafter needs hyper-connection streams
    (dict(hc_count=0), "model.hc_count"),
    (dict(eos_token_id=-1), "model.eos_token_id"),  # PLE's n-grams stop at end of document
    (dict(linear_num_value_heads=3), "model.linear_num_key_heads"),
    (dict(layer_types=["linear_attention", "sliding"] * 2), "model.layer_types"),
    (dict(layer_types=["linear_attention"]), "model.layer_types"),
    (dict(heads_per_ngram=3), "model.ple_embed_dim"),  # 32 not a multiple of 2 x 3 n-gram heads
    (dict(linear_gate_act="gelu"), "model.linear_gate_act"),
    (dict(qsa_form="dense"), "model.qsa_form"),
])
def test_bad_qwen4_shape_names_the_key(over, key):
    with pytest.raises(ValueError) as err:
        validate_model(qwen4(**over), MTPConfig(combine="qwen4_exp"))
    assert key in str(err.value) and "\n" not in str(err.value)


def test_concat_drafter_cannot_read_streams():
    with pytest.raises(ValueError, match="mtp.combine=concat_proj"):
        validate_model(qwen4(), MTPConfig(combine="concat_proj"))
