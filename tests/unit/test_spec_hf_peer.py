"""Peer check against transformers' own MTP speculative decoding (`generate(..., use_mtp=True)`).

A tiny GLM-4.5-MoE model is created by transformers itself (random init of `Glm4MoeForCausalLM`) and
given random MTP weights at `model.layers.{num_hidden_layers}.*`, then, in transformers' names, the
weights that make its drafts partly right (`_agreeing`: with random drafts greedy speculative
decoding accepts nothing and equals plain greedy whatever the drafter does). It is saved in HF
layout, imported with `tandem.trainer.hf.importer.load_hf_model`, and decoded greedily by this
project's speculative decoder: the tokens must equal transformers' plain greedy `generate` and its
`generate(use_mtp=True)`, and at K=1 (transformers drafts one token per MTP layer) as many drafts
must be accepted as transformers accepts.
"""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tandem.eval.spec_decode import generate
from tandem.models import ModelConfig, MTPConfig, TandemModel
from tandem.trainer.hf import export as hf_export
from tandem.trainer.hf import importer as hf_import
from tests.eval_helpers import transformers_mtp_decode

V = 96


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    from transformers.models.glm4_moe import modeling_glm4_moe as G

    # transformers finds MTP layers through this pattern (layers 46/92 of the released models).
    monkeypatch.setattr(G.Glm4MoePreTrainedModel, "_keys_to_ignore_on_load_unexpected",
                        [r"model\.layers\.2.*"])
    yield


def _mtp_names(tmp_path):
    """HF names and shapes of one GLM MTP layer (from an export of a same-shaped Tandem model)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48,
                      moe_intermediate_size=16, num_experts=4, top_k=2, num_shared_experts=1,
                      first_k_dense=1, partial_rotary_factor=0.5, max_seq_len=128)
    out = tmp_path / "shape"
    hf_export.export_hf(TandemModel(cfg, MTPConfig(num_steps=1, num_layers=1,
                                                   trunk_input="final_norm")), str(out))
    tensors = {}
    for f in out.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    return out, {k: v.shape for k, v in tensors.items() if k.startswith("model.layers.2.")}


def _agreeing(state, noise, g):
    """tests/eval_helpers.make_agreeing's construction, written in transformers' names: residual
    branches scaled by `noise` (the trunk's next token is nearly a function of the current one),
    spread embedding and head, and an MTP layer that passes its token's embedding on (GLM's eh_proj
    takes [enorm(embedding), hnorm(h)]), so its draft is nearly the trunk's next token."""
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            state[name] = state[name] * noise
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.randn(state[name].shape, generator=g)
    H = state["model.embed_tokens.weight"].shape[1]
    eh = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    state["model.layers.2.eh_proj.weight"] = eh + noise * torch.randn(eh.shape, generator=g)


@torch.no_grad()
def test_spec_decoder_matches_transformers_generate_use_mtp(tmp_path):
    shape_dir, mtp_shapes = _mtp_names(tmp_path)
    config = T.AutoConfig.from_pretrained(str(shape_dir))
    config.initializer_range = 0.2
    torch.manual_seed(0)
    hf = T.Glm4MoeForCausalLM(config).eval()  # transformers' own random init, not ours
    for m in hf.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.normal_(0, 0.05)
    out = tmp_path / "glm"
    hf.save_pretrained(str(out))
    g = torch.Generator().manual_seed(1)
    extra = {k: (torch.rand(s, generator=g) + 0.5) if len(s) == 1
             else 0.2 * torch.randn(s, generator=g)
             for k, s in mtp_shapes.items()}
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1
    state = load_file(str(files[0]))
    state.update({k: v.contiguous() for k, v in extra.items() if k not in state})
    _agreeing(state, 0.02, g)
    save_file(state, str(files[0]), metadata={"format": "pt"})
    cfg_json = json.loads((out / "config.json").read_text())
    cfg_json["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg_json))

    hf = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    model, _ = hf_import.load_hf_model(str(out))
    model.eval()
    assert model.mtp is not None
    # the import took the MTP weights written above (not a fresh init)
    torch.testing.assert_close(model.mtp.layers[0].eh_proj.weight,
                               state["model.layers.2.eh_proj.weight"])
    prompts = [torch.randint(0, V, (1, n), generator=g) for n in (8, 5)]
    for prompt in prompts:
        plain = hf.generate(prompt, max_new_tokens=20, do_sample=False)
        n = prompt.shape[1]
        theirs, accepted = transformers_mtp_decode(hf, prompt, 20)
        assert theirs == plain[0, n:].tolist()
        for K in (1, 2, 3):  # K > 1 loops the single MTP layer
            ours = generate(model, [prompt[0].tolist()], 20, K)
            assert ours.outputs[0] == plain[0, n:].tolist(), K
            # every depth's drafts are accepted somewhere (random MTP weights accept none)
            assert bool((ours.stats.accepted_at > 0).all()), (K, ours.stats.accepted_at)
            if K == 1:  # one draft per round, as transformers drafts with one MTP layer
                assert int(ours.stats.accepted_all[0]) == accepted
    # batched, ragged prompts together
    ours = generate(model, [p[0].tolist() for p in prompts], 20, 1)
    for p, o in zip(prompts, ours.outputs):
        assert o == hf.generate(p, max_new_tokens=20, do_sample=False)[0, p.shape[1]:].tolist()
