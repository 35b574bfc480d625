"""GLM-4.5 layout MTP (GLM-4.5 and DeepSeek-V3, whose attention is MLA): draft logits equal
transformers' MtpModel; a model built here, exported, gives the same greedy tokens under
transformers' generate(use_mtp=True), plain greedy generate and this project's speculative decoder;
GLM/DeepSeek-style native MTP weights import (extra shared copies ignored)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.hf.export import export_hf
from tandem.trainer.hf.importer import load_hf_model
from tests.eval_helpers import make_agreeing, transformers_mtp_decode

V = 96


MLA = dict(num_kv_heads=4, partial_rotary_factor=1.0, kv_lora_rank=16, q_lora_rank=12,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_scaling="yarn",
           rope_factor=4.0, rope_original_max_len=16, rope_mscale=1.0, rope_mscale_all_dim=1.0)
"""DeepSeek-V3's attention on the same trunk: exported as deepseek_v3."""
FAMILIES = {"glm4_moe": {}, "deepseek_v3": MLA}


def glm_like(trunk_input: str, num_layers: int = 1, num_steps: int = 1,
             seed: int = 0, family: str = "glm4_moe") -> TandemModel:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                                num_kv_heads=2, intermediate_size=48, moe_intermediate_size=16,
                                num_experts=4, top_k=2, num_shared_experts=1, first_k_dense=1,
                                partial_rotary_factor=0.5, routed_scaling_factor=1.5,
                                max_seq_len=128, init_std=0.2), **FAMILIES[family]})
    model = TandemModel(cfg, MTPConfig(num_steps=num_steps, num_layers=num_layers,
                                       trunk_input=trunk_input)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
        for m in model.moe_layers():
            m.router.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.fixture
def glm_mtp_index(monkeypatch):
    """Glm4Moe and DeepseekV3 find their MTP layers through `_keys_to_ignore_on_load_unexpected`
    (model.layers.46/92, 61 for the released sizes); point them at the tiny model's layer index."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as D
    from transformers.models.glm4_moe import modeling_glm4_moe as G

    for cls in (G.Glm4MoePreTrainedModel, D.DeepseekV3PreTrainedModel):
        monkeypatch.setattr(cls, "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.2.*"])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("trunk_input", ["final_norm", "pre_norm"])
def test_mtp_draft_logits_match_transformers(trunk_input, family, tmp_path, glm_mtp_index):
    from transformers.modeling_layers import MtpModel

    model = glm_like(trunk_input, family=family)
    out = tmp_path / "glm"
    assert export_hf(model, str(out)) == family
    hf = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    mtp = MtpModel.from_pretrained(hf).eval()
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(3))
    s = ids.shape[1] - 1
    with torch.no_grad():
        res = hf(ids, output_hidden_states=True)
        h_hf = res.hidden_states[-1]  # what MTPCandidateGenerator feeds the MTP layer
        # MTP layer 0 at positions t = 0..s-1 combines h_t with the embedding of token t+1.
        hf_h = mtp.forward_layer(0, h_hf[:, :s], torch.arange(1, s + 1)[None], None,
                                 input_ids=ids[:, 1:])
        hf_logits = mtp._project_to_logits(hf_h)
        pos = torch.arange(s + 1)[None]
        h0 = model.trunk(ids, pos)
        ours = model.logits(1, model.mtp_step(1, h0[:, :s], ids[:, 1:], pos[:, :s]))
        assert (res.logits - model.logits(0, h0)).abs().max() < 1e-4
    err = (hf_logits - ours).abs().max().item()
    assert err < 1e-4, err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_use_mtp_matches_greedy_and_spec_decoder(family, tmp_path, glm_mtp_index):
    """Drafts that are partly right (make_agreeing), so the count of accepted drafts, not only the
    tokens (greedy speculative decoding gives the greedy tokens whatever it drafts), is compared
    with transformers' own MTP decoding of the exported checkpoint."""
    # pre_norm: this project's default convention
    model = make_agreeing(glm_like("pre_norm", family=family), 0.02, seed=1)
    out = tmp_path / "glm"
    export_hf(model, str(out))
    hf = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(5))
    plain = hf.generate(prompt, max_new_tokens=24, do_sample=False)
    theirs, accepted = transformers_mtp_decode(hf, prompt, 24)
    assert theirs == plain[0, 8:].tolist()
    from tandem.eval import spec_decode as spec
    with torch.no_grad():
        ours = spec.generate(model, [prompt[0].tolist()], max_new_tokens=24, num_steps=1)
    assert ours.outputs[0] == theirs
    assert int(ours.stats.accepted_all[0]) == accepted > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_glm_mtp_weights_import(family, tmp_path):
    model = glm_like("final_norm", num_layers=1, family=family)
    out = tmp_path / "glm"
    export_hf(model, str(out))
    # Released GLM-4.5 / DeepSeek-V3 checkpoints also store copies of the embedding and head in the
    # MTP layer.
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.2.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    again, cfg = load_hf_model(str(out))
    assert (
        cfg.mtp.num_layers == 1 and cfg.mtp.num_steps == 1 and cfg.mtp.trunk_input == "final_norm"
    )
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if not k.endswith("tokens_per_expert"):
            assert torch.equal(a[k], b[k]), k
    # K > L: one physical layer looped over 3 draft steps
    looped, cfg = load_hf_model(str(out), mtp_overrides={"num_steps": 3})
    assert cfg.mtp.num_steps == 3 and torch.equal(looped.mtp.layers[0].eh_proj.weight,
                                                  model.mtp.layers[0].eh_proj.weight)
    # more physical MTP layers than it holds: named, not 27 missing tensors of a model "of this
    # shape"
    from tandem.trainer.hf.reader import CheckpointError

    with pytest.raises(CheckpointError, match=rf"^{out} holds 1 MTP layer\(s\), and "
                                              r"mtp.num_layers=2 asks for more: set "
                                              r"mtp.num_layers=1"):
        load_hf_model(str(out), mtp_overrides={"num_steps": 2, "num_layers": 2})


def test_hidden_first_concat_is_permuted_on_export(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, top_k=2, num_shared_experts=1,
                      max_seq_len=64)
    model = TandemModel(cfg, MTPConfig(num_steps=1, num_layers=1, concat_order="hidden_emb")).eval()
    export_hf(model, str(tmp_path / "x"))
    again, tcfg = load_hf_model(str(tmp_path / "x"))
    assert tcfg.mtp.concat_order == "emb_hidden"
    ids = torch.randint(0, V, (2, 9))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        a = model.logits(1, model.mtp_step(1, model.trunk(ids[:, :8], pos), ids[:, 1:], pos))
        b = again.logits(1, again.mtp_step(1, again.trunk(ids[:, :8], pos), ids[:, 1:], pos))
    assert (a - b).abs().max() < 1e-5
