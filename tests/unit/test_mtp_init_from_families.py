"""`mtp.init_from` reads a released model's own MTP weights in every family that carries them
(recipes/mtp_refresh.yaml: the trunk from `model.init_from`, the drafter from the stale
checkpoint): an old model exported in the family's Hugging Face layout gives a new one of the same
shape exactly its MTP parameters and nothing of its trunk, the Qwen4-Exp drafter (its stream mixer
and QSA layer) included. Families without MTP weights are refused by name
(tests/e2e/test_mtp_refresh.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.models import ModelConfig, MTPConfig, TandemModel, flavors
from tandem.trainer.hf.export import export_hf
from tandem.trainer.materialize import load_mtp_weights

# family -> (trunk, MTP module) of a tiny model it exports with its MTP layer
SHAPES = {
    "glm4_moe": (flavors.model_config("debug"), MTPConfig(num_steps=2, num_layers=1)),
    "qwen3_next_mtp": (
        ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=48, num_experts=0, qk_norm=True, max_seq_len=64),
        MTPConfig(num_steps=2, num_layers=1, moe=False, trunk_input="final_norm")),
    "qwen4_exp": (flavors.model_config("debug_qwen4"), flavors.mtp_config("debug_qwen4")),
}


def _model(cfg: ModelConfig, mtp: MTPConfig, seed: int) -> TandemModel:
    torch.manual_seed(seed)
    model = TandemModel(cfg, mtp)
    with torch.no_grad():  # every tensor moved off its initial value, so each one tells
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("family", list(SHAPES))
def test_released_mtp_weights_replace_exactly_the_mtp_module(family, tmp_path):
    cfg, mtp = SHAPES[family]
    old, new = _model(cfg, mtp, 0), _model(cfg, mtp, 1)
    assert export_hf(old, str(tmp_path / "hf"), family, cfg=cfg, mtp=mtp) == family
    before = {k: v.detach().clone() for k, v in new.named_parameters()}
    loaded = load_mtp_weights(new, str(tmp_path / "hf"))
    mtp_names = {k for k in before if k.startswith("mtp.")}
    assert mtp_names and mtp_names <= set(loaded) and all(k.startswith("mtp.") for k in loaded)
    want = dict(old.named_parameters())
    for name, got in new.named_parameters():
        expected = want[name] if name.startswith("mtp.") else before[name]
        assert torch.equal(got, expected), name
        assert not torch.equal(want[name], before[name]), name  # the two models differ here
