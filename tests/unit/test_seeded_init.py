"""Meta-device construction and the layout-independent seeded init
(trainer/parallel/sharded_params.py, trainer/materialize.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.trainer.parallel import ParallelState, sharded_params
from tandem.trainer.parallel.device import resolve_device
from tandem.trainer.recipe import load_config
from tandem.trainer.run import build_model
from tests.conftest import DEBUG_MODEL

SHAPE = DEBUG_MODEL + ["model.num_heads=4", "model.num_kv_heads=2",
                       "model.moe_intermediate_size=16", "mtp.num_steps=2",
                       "data.vocab_size=512", "data.seq_len=32", "device=cpu"]


@pytest.mark.parametrize("index", [(slice(0, 10), slice(0, 7)), (slice(3, 9), slice(2, 7)),
                                   (slice(7, 10), slice(0, 7)), (slice(0, 0), slice(0, 7))])
def test_any_slice_equals_that_slice_of_the_whole(monkeypatch, index):
    # blocks of 2 rows: slices cross block edges
    monkeypatch.setattr(sharded_params, "INIT_BLOCK_ELEMS", 14)
    rule = ("normal", 0.5)
    whole = sharded_params.seeded_slice("w", (10, 7), (slice(0, 10), slice(0, 7)), rule, seed=3)
    part = sharded_params.seeded_slice("w", (10, 7), index, rule, seed=3)
    assert torch.equal(part, whole[index])
    assert abs(float(whole.std()) - 0.5) < 0.15
    other = sharded_params.seeded_slice("w", (10, 7), (slice(0, 10), slice(0, 7)), rule, seed=4)
    assert not torch.equal(whole, other)


def test_one_process_build_is_seeded_tied_and_initialised_by_rule():
    cfg = load_config(None, SHAPE + ["model.tie_embeddings=true"])
    state = ParallelState(device=resolve_device("cpu"))
    a, b = build_model(cfg, state), build_model(cfg, state)
    assert a.lm_head.weight is a.embed_tokens.weight
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        kind, std = a.init_rule(name)
        if kind == "ones":
            assert torch.equal(p, torch.ones_like(p)), name
        elif kind == "normal" and p.numel() > 500:
            assert abs(float(p.std()) / std - 1) < 0.2, name
    rot = a.layers["0"].self_attn.rotary  # a non-persistent buffer: recomputed after to_empty
    r = rot.rotary_dim
    inv = 1.0 / (cfg.model.rope_theta ** (torch.arange(0, r, 2).float() / r))
    assert torch.allclose(rot.cos[5], torch.cat([5 * inv, 5 * inv]).cos())


def test_frozen_trunk_is_kept_in_the_compute_dtype(capsys):
    cfg = load_config(None, SHAPE + ["train.freeze_trunk=true", "train.dtype=bf16"])
    model = build_model(cfg, ParallelState(device=resolve_device("cpu")))
    # no model.init_from (the fine-tuning recipes' default): a random trunk, said, not silent
    assert "train.freeze_trunk=true without model.init_from" in capsys.readouterr().err
    for name, p in model.named_parameters():
        trains = name.startswith("mtp.")
        assert p.requires_grad == trains and p.dtype == (torch.float32 if trains
                                                         else torch.bfloat16), name
    cfg = load_config(None, SHAPE + ["train.freeze_trunk=true", "train.dtype=fp32"])
    assert all(
        p.dtype == torch.float32
        for p in build_model(cfg, ParallelState(device=resolve_device("cpu"))).parameters()
    )


def test_each_module_declares_how_its_parameters_start():
    """The rule of a parameter comes from the closest module holding it (`param_init`), hand-checked
    on Qwen4-Exp's debug flavor: 4 trunk layers + 1 MTP layer, so residual projections start at 0.02
    / sqrt(2 * 5)."""
    import math

    from tandem.models import flavors
    from tandem.models.model import TandemModel

    with torch.device("meta"):
        model = TandemModel(flavors.model_config("debug_qwen4"), flavors.mtp_config("debug_qwen4"))
        plain = TandemModel(flavors.model_config("debug", attention_bias=True),
                            flavors.mtp_config("debug"))
    # a bias no module names
    assert plain.init_rule("layers.0.self_attn.q_proj.bias") == ("zeros", 0.0)
    cfg = model.cfg
    assert (cfg.num_layers, model.mtp_cfg.num_layers, cfg.init_std) == (4, 1, 0.02)
    residual = ("normal", 0.02 / math.sqrt(10))
    names = dict(model.named_parameters())
    gdn = next(n.split(".")[1] for n in names if n.endswith("linear_attn.A_log"))
    qsa = next(n.split(".")[1] for n in names if n.startswith("layers.")
               and n.endswith("self_attn.o_proj.weight"))
    expected = {
        f"layers.{gdn}.linear_attn.A_log": ("a_log", 0.0),          # GatedDeltaNet
        f"layers.{gdn}.linear_attn.dt_bias": ("ones", 0.0),         # GatedDeltaNet, not "a bias"
        f"layers.{gdn}.linear_attn.out_proj.weight": residual,      # GatedDeltaNet
        # GatedRMSNorm (not zero-centred)
        f"layers.{gdn}.linear_attn.norm.weight": ("ones", 0.0),
        f"layers.{gdn}.linear_attn.in_proj_qkv.weight": ("normal", 0.02),
        f"layers.{qsa}.self_attn.o_proj.weight": residual,          # IndexedAttention
        # RMSNorm, zero-centred
        f"layers.{gdn}.attn_hyper_connection.hc_norm.weight": ("zeros", 0.0),
        f"layers.{gdn}.mlp.experts.down_proj": residual,            # GroupedExperts
        f"layers.{gdn}.mlp.shared_experts.down_proj.weight": residual,  # SwiGLU
        "mtp.layers.0.block.self_attn.o_proj.weight": residual,
        "embed_tokens.weight": ("normal", 0.02),
    }
    ple = [n for n, _ in model.named_parameters() if n.endswith("ple.conv1d.weight")]
    assert ple and all(model.init_rule(n) == ("zeros", 0.0) for n in ple)  # PLELayer
    for name, rule in expected.items():
        assert name in names, name
        assert model.init_rule(name) == rule, name
