"""model.init_from (HF dir / Tandem checkpoint, MTP from the last trunk layer) and self-distillation
targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp import shifted_tokens
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.config import TandemConfig
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.hf.export import export_hf
from tandem.trainer.hf.init_from import adopt_checkpoint_config, load_initial_weights
from tandem.trainer.recipe import load_config, to_yaml

CFG = dict(vocab_size=264, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
           intermediate_size=48,
           moe_intermediate_size=16, num_experts=4, top_k=2, num_shared_experts=1, first_k_dense=1,
           max_seq_len=512)


def model(num_steps=2, seed=0, distill="none", **kw):
    torch.manual_seed(seed)
    return TandemModel(ModelConfig(**CFG), MTPConfig(num_steps=num_steps, num_layers=1, **kw),
                       distill=distill)


def test_init_from_hf_export_trunk_and_last_layer_mtp(tmp_path):
    src = model(num_steps=0, seed=1)
    export_hf(src, str(tmp_path / "hf"))
    dst = model(num_steps=2, seed=2)
    load_initial_weights(dst, str(tmp_path / "hf"), mtp_init_from_last_layer=True)
    for name, p in src.state_dict().items():
        if not name.endswith("tokens_per_expert"):
            assert torch.equal(p, dst.state_dict()[name]), name
    blk = dst.mtp.layers[0].block
    assert torch.equal(blk.mlp.experts.gate_proj, src.layers["1"].mlp.experts.gate_proj)
    assert torch.equal(blk.self_attn.q_proj.weight, src.layers["1"].self_attn.q_proj.weight)


def test_init_from_tandem_checkpoint(tmp_path):
    from tandem.trainer.checkpoint import save_checkpoint

    cfg = TandemConfig()
    cfg.model, cfg.mtp = ModelConfig(**CFG), MTPConfig(num_steps=1, num_layers=1)
    cfg.data.vocab_size = 260
    src = model(num_steps=1, seed=3)
    step = save_checkpoint(str(tmp_path / "run"), 5, src, None, to_yaml(cfg), {})
    dst = model(num_steps=1, seed=4)
    load_initial_weights(dst, str(tmp_path / "run"))  # a run directory: its newest checkpoint
    for name, p in src.state_dict().items():
        assert torch.equal(p, dst.state_dict()[name]), name
    # a run config of another shape adopts the checkpoint's trunk
    run = load_config(None,
                      [f"model.init_from={step}", "model.hidden_size=64", "data.vocab_size=260",
                             "model.vocab_size=264", "model.max_seq_len=512"])
    changed = adopt_checkpoint_config(run)
    assert run.model.hidden_size == 32 and any(c.startswith("model.hidden_size") for c in changed)
    # and its MTP module's wiring, which its weights load into (a recipe's other concat order or
    # layer count loaded them into another module without a word)
    run = load_config(None, [f"model.init_from={step}", "data.vocab_size=260",
                             "mtp.concat_order=hidden_emb", "mtp.num_layers=2", "mtp.num_steps=3"])
    changed = adopt_checkpoint_config(run)
    assert (run.mtp.concat_order, run.mtp.num_layers, run.mtp.num_steps) == ("emb_hidden", 1, 3)
    assert {c.split(":")[0] for c in changed} >= {"mtp.concat_order", "mtp.num_layers"}


def test_init_from_a_qsa_trunk_runs_no_second_dense_warm_up(tmp_path):
    """A checkpoint's QSA indexers come trained: model.init_from runs no dense warm-up unless the
    run asks for one itself or its drafter starts fresh. The flavor's (qwen4_exp_tiny's 30 steps)
    ran again, attending densely and, under `auto` (indexer_only), holding every other weight
    still."""
    from tandem.trainer.checkpoint import save_checkpoint
    from tandem.trainer.recipe import explicit_keys

    recipe = "recipes/qwen4_exp_tiny.yaml"
    cfg = load_config(recipe, [])
    assert cfg.model.indexer_warmup_steps == 30
    src = TandemModel(cfg.model, cfg.mtp)
    step = save_checkpoint(str(tmp_path / "run"), 5, src, None, to_yaml(cfg), {})
    # a trunk without MTP weights: a fresh drafter, whose indexer the warm-up is for
    bare = load_config(recipe, ["mtp.num_steps=0"])
    trunk = save_checkpoint(str(tmp_path / "trunk"), 5, TandemModel(bare.model, bare.mtp), None,
                            to_yaml(bare), {})
    for source, overrides, steps in ((step, [], 0), (step, ["model.indexer_warmup_steps=5"], 5),
                                     (trunk, [], 30),
                                     (trunk, ["mtp.init_from_last_layer=true"], 0)):
        overrides = [f"model.init_from={source}", *overrides]
        run = load_config(recipe, overrides)
        changed = adopt_checkpoint_config(run, explicit_keys(recipe, overrides))
        assert run.model.indexer_warmup_steps == steps, overrides
        assert any(c.startswith("model.indexer_warmup_steps") for c in changed) == (steps == 0)
        assert run.model.resolved_indexer_warmup == "indexer_only"


def test_distill_validated():
    with pytest.raises(ConfigError, match="train.distill"):
        load_config(None, ["train.distill=kl"])


@pytest.mark.parametrize("mode", ["argmax", "soft"])
def test_distill_targets_are_trunk_predictions(mode):
    m = model(num_steps=2, seed=5, distill=mode)
    m.mtp_cfg.loss_chunk_tokens = 7  # several chunks
    tokens = torch.randint(0, 264, (2, 13))
    out = m(tokens)
    s = 12
    pos = torch.arange(s).expand(2, s)
    with torch.no_grad():
        h0 = m.trunk(tokens[:, :s], pos)
        teacher = m.logits(0, h0)  # position p predicts token p+1
        h = h0
        for k in (1, 2):
            h = m.mtp_step(k, h, shifted_tokens(tokens, k, s), pos)
            student = m.logits(k, h)[:, : s - k]
            t = teacher[:, k:]
            if mode == "argmax":
                ref = F.cross_entropy(student.reshape(-1, 264), t.argmax(-1).reshape(-1),
                                      reduction="sum")
            else:
                ref = -(t.softmax(-1) * student.log_softmax(-1)).sum()
            assert torch.allclose(out.loss_sums[k], ref, rtol=1e-4), (k, out.loss_sums[k], ref)
    out.loss_sums.sum().backward()  # gradients flow through the chunked, recomputed soft loss
    assert m.mtp.layers[0].eh_proj.weight.grad is not None


def test_frozen_trunk_has_no_graph():
    m = model(num_steps=1, seed=6)
    for name, p in m.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    out = m(torch.randint(0, 264, (2, 9)))
    assert out.loss_sums[1].requires_grad
    out.loss_sums.sum().backward()
    assert all(p.grad is None for n, p in m.named_parameters() if not n.startswith("mtp."))


@pytest.mark.parametrize("layout, depths, pp, schedule", [
    ([1, 1, 2, 0], [2, 3], 2, "interleaved_1f1b"),  # the MTP stage holds layer 1, not layer 3
    ([2, 2, 0], [1, 2], 3, "1f1b"),  # the MTP stage holds no trunk layer
])
def test_init_from_last_layer_needs_the_last_layer_on_the_mtp_stage(layout, depths, pp,
                                                                    schedule):
    """mtp.init_from_last_layer on a pipeline stage that holds an MTP depth but not the trunk's
    last layer is refused by name (it copied the last layer that stage held, or failed in max());
    a placement with both on one stage copies layer 3."""
    import copy

    from tandem.trainer.hf.init_from import init_mtp_from_last_layer
    from tandem.trainer.parallel.pipeline import prune_model

    def stages(layout, depths, pp, schedule):
        cfg = load_config(None, ["model.num_layers=4", "model.num_experts=0", "mtp.num_steps=1",
                                 "mtp.moe=false", f"parallel.pp={pp}",
                                 f"parallel.pp_schedule={schedule}",
                                 "parallel.pp_virtual_stages=2", f"parallel.pp_layout={layout}",
                                 f"parallel.pp_depth_stages={depths}"])
        full = TandemModel(cfg.model, cfg.mtp)
        for rank in range(pp):
            model = copy.deepcopy(full)
            prune_model(model, cfg, rank)
            if model.mtp is not None:
                return full, model

    _, model = stages(layout, depths, pp, schedule)
    with pytest.raises(ValueError, match=r"mtp\.init_from_last_layer: .*layers\.3"):
        init_mtp_from_last_layer(model)
    full, model = stages([2, 2], [1, 1], 2, "1f1b")
    init_mtp_from_last_layer(model)
    assert torch.equal(model.mtp.layers[0].block.self_attn.q_proj.weight,
                       full.layers["3"].self_attn.q_proj.weight)


def test_stop_ids_read_a_source_directory(tmp_path):
    """`tandem generate` / `tandem eval` stop a row at the tokenizer's EOS and at every
    eos_token_id of the model's Hugging Face directory: generation_config.json's list first (GLM-4.5
    ends turns with <|user|> and <|observation|> too), else config.json's; a Tandem checkpoint or
    nothing adds none."""
    import json

    from tandem.trainer.hf.reader import stop_ids

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_ids(0, [str(hf)]) == [0, 7]
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 151336, 151338]}))
    assert stop_ids(0, ["", str(hf)]) == [0, 151336, 151338]
    assert stop_ids(5, [str(tmp_path)]) == [5] and stop_ids(None, []) is None
