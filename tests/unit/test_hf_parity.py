"""Parity with transformers on tiny random models (fp32, built locally from its config classes):
logits after import match within 1e-4, and import -> export -> transformers load gives identical
tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as T

from tandem.trainer.hf.export import export_hf
from tandem.trainer.hf.importer import load_hf_model

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


DEEPSEEK = dict({k: v for k, v in COMMON.items() if k != "head_dim"}, num_key_value_heads=4,
                moe_intermediate_size=16, num_experts_per_tok=2, n_routed_experts=8,
                n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6, num_nextn_predict_layers=0)


def family_configs():
    return {
        "llama": T.LlamaConfig(**COMMON),
        # Llama 3.1's RoPE: over the 30-token original context the pairs turn 4.8 times (kept), 1.5
        # (blended), 0.48 and 0.15 (divided by the factor); low_freq_factor off its usual 1.0, so
        # the blend's use of it shows
        "llama:llama3": T.LlamaConfig(**COMMON, rope_scaling=dict(
            rope_type="llama3", rope_theta=100.0, factor=8.0, original_max_position_embeddings=30,
            low_freq_factor=1.2, high_freq_factor=4.0)),
        "qwen3": T.Qwen3Config(**COMMON),
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, moe_intermediate_size=16, num_experts_per_tok=2,
                                      num_experts=4, norm_topk_prob=True, mlp_only_layers=[0]),
        "glm4_moe": T.Glm4MoeConfig(**COMMON, moe_intermediate_size=16, num_experts_per_tok=2,
                                    n_routed_experts=8,
                                    n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                    topk_group=1,
                                    routed_scaling_factor=2.5, attention_bias=True,
                                    use_qk_norm=True, num_nextn_predict_layers=0),
        # MLA with a compressed query, rotary channels interleaved in the checkpoint, YaRN with
        # mscales that scale cos/sin (0.707 / 1) and the softmax (mscale_all_dim)
        "deepseek_v3": T.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, rope_scaling=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=1.0)),
        # DeepSeek-V2-Lite's layout: one q_proj, default RoPE
        "deepseek_v3:lite": T.DeepseekV3Config(**DEEPSEEK, q_lora_rank=None),
        # Kimi-K2's config.json: model_type kimi_k2 (written over the saved one), YaRN with
        # beta_fast = beta_slow = 1
        "deepseek_v3:kimi_k2": T.DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, rope_scaling=dict(
            rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=8,
            beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    }


def make_hf(config, seed=0):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger than the default init so differences would show
        for _, p in model.named_parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def logit_error(hf, model) -> float:
    """The largest difference between transformers' logits and the imported model's, on two random
    rows of 12 tokens."""
    ids = torch.randint(0, COMMON["vocab_size"], (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(0, model.trunk(ids, torch.arange(12).expand(2, 12)))
    return (ref - ours).abs().max().item()


def hf_tensors(model) -> dict:
    sd = {k: v for k, v in model.state_dict().items()}
    return sd


@pytest.mark.parametrize("family", ["llama", "llama:llama3", "qwen3", "qwen3_moe", "glm4_moe",
                                    "deepseek_v3", "deepseek_v3:lite", "deepseek_v3:kimi_k2"])
def test_logits_match_transformers_and_round_trip(family, tmp_path):
    hf = make_hf(family_configs()[family])
    src = tmp_path / "src"
    hf.save_pretrained(src)
    if family.endswith(":kimi_k2"):
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(config, model_type="kimi_k2")))
    model, cfg = load_hf_model(str(src))
    err = logit_error(hf, model)
    assert err < 1e-4, f"{family}: max |logits diff| {err}"

    out = tmp_path / "export"
    # the default family follows the imported knobs
    assert export_hf(model, str(out)) == family.split(":")[0]
    back = T.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    a, b = hf_tensors(hf), hf_tensors(back)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # ... and its config.json computes what the source's did (RoPE scaling included)
    assert logit_error(back, model) < 1e-4, family


def test_sharded_checkpoint_import(tmp_path):
    hf = make_hf(family_configs()["glm4_moe"])
    hf.save_pretrained(tmp_path / "src")
    model, _ = load_hf_model(str(tmp_path / "src"))
    export_hf(model, str(tmp_path / "sharded"), max_shard_bytes=20_000)
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    assert len(json.load(open(tmp_path / "sharded"
                              / "model.safetensors.index.json"))["weight_map"]) > 0
    again, _ = load_hf_model(str(tmp_path / "sharded"))
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_export_refuses_to_clobber(tmp_path):
    hf = make_hf(family_configs()["qwen3"])
    hf.save_pretrained(tmp_path / "src")
    model, _ = load_hf_model(str(tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_hf(model, str(out))
    assert (out / "keep.txt").exists()
    # --overwrite replaces only an earlier export: a file no export writes would be lost
    with pytest.raises(FileExistsError, match="keep.txt"):
        export_hf(model, str(out), overwrite=True)
    assert (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    export_hf(model, str(out), overwrite=True)
    export_hf(model, str(out), overwrite=True)  # over the earlier export
    assert (out / "config.json").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_export")]


@pytest.mark.parametrize("family, dense_past_the_end", [
    ("qwen3_moe", dict(mlp_only_layers=[0, 1, 2])),
    ("glm4_moe", dict(first_k_dense_replace=3)),
])
def test_dense_layers_named_past_the_last_layer_import(family, dense_past_the_end, tmp_path):
    """A truncated config may name dense layers past its last one; transformers builds every layer
    dense, and so does the import (first_k_dense = num_layers), with the same logits."""
    config = family_configs()[family]
    for key, value in dense_past_the_end.items():
        setattr(config, key, value)
    hf = make_hf(config)
    hf.save_pretrained(tmp_path / "src")
    model, cfg = load_hf_model(str(tmp_path / "src"))
    assert cfg.model.first_k_dense == COMMON["num_hidden_layers"]
    assert logit_error(hf, model) < 1e-4


@pytest.mark.parametrize("family, edit", [
    # transformers' Llama and Qwen3 classes rotate the whole head whatever the config says
    ("llama", lambda c: c.update(partial_rotary_factor=0.5)),
    ("qwen3", lambda c: c.update(partial_rotary_factor=0.5)),
    # GLM's factor in a legacy rope_scaling, and no rms_norm_eps (Glm4MoeConfig's default: 1e-5)
    ("glm4_moe", lambda c: c.update(rope_theta=c.pop("rope_parameters")["rope_theta"],
                                    rope_scaling={"rope_type": "default",
                                                  "partial_rotary_factor": 0.25},
                                    rms_norm_eps=None)),
])
def test_config_fields_read_as_transformers_reads_them(family, edit, tmp_path):
    """Config fields each family's transformers class reads its own way: the import had partial
    rotary for Llama and Qwen3 (logits off by 4-6), read GLM's factor only from rope_parameters
    (0.5 for 0.25: off by 2.9) and took 1e-6 for GLM's missing eps."""
    src = tmp_path / "src"
    make_hf(family_configs()[family]).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    config = {k: v for k, v in config.items() if v is not None}
    (src / "config.json").write_text(json.dumps(config))
    hf = T.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    model, _ = load_hf_model(str(src))
    assert logit_error(hf, model) < 1e-4


@pytest.mark.parametrize("family, model, mtp, named", [
    ("llama", dict(zero_centered_norm=True), {}, "model.zero_centered_norm"),
    ("glm4_moe", dict(shared_expert_gate=True), {}, "model.shared_expert_gate"),
    ("glm4_moe", dict(shared_expert_intermediate_size=24), {},
     "model.shared_expert_intermediate_size"),
    ("qwen3_next_mtp", dict(qk_norm=True), dict(num_steps=1, style="parallel"), "mtp.style"),
])
def test_export_refuses_what_the_family_cannot_compute(family, model, mtp, named, tmp_path):
    """Knobs the family's transformers class cannot express are refused by name before anything is
    written; they were exported, and transformers computed another function (a zero-centred norm
    off by 5.8, a gated shared expert by 1.7), refused to load the file (a shared expert of another
    width), or Tandem could not import it back (a parallel-style MTP layer without its fc)."""
    from tandem.models import TandemModel
    from tandem.models.config import ModelConfig
    from tandem.models.mtp_config import MTPConfig
    from tandem.trainer.hf.names import UnsupportedCheckpoint

    moe = family == "glm4_moe"
    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=48, max_seq_len=64, moe_intermediate_size=16,
                      num_experts=4 if moe else 0, top_k=2, num_shared_experts=1 if moe else 0,
                      first_k_dense=1 if moe else 0, **model)
    with pytest.raises(UnsupportedCheckpoint, match=named.replace(".", r"\.")):
        export_hf(TandemModel(cfg, MTPConfig(**{"num_steps": 0, **mtp})), str(tmp_path / "out"),
                  family)
    assert not (tmp_path / "out").exists()


def test_a_tied_checkpoint_that_also_stores_its_head_imports(tmp_path):
    """tie_word_embeddings with a stored lm_head.weight as well: transformers ties the head to the
    embedding and loads the file; so does the import (it refused the head as unexpected)."""
    from safetensors.torch import load_file, save_file

    config = family_configs()["qwen3"]
    config.tie_word_embeddings = True
    make_hf(config).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = T.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model, cfg = load_hf_model(str(tmp_path))
    assert cfg.model.tie_embeddings
    assert logit_error(hf, model) < 1e-4


def test_an_export_keeps_how_its_source_is_served(tmp_path):
    """A model fine-tuned from a Hugging Face checkpoint (model.init_from) exports with its source's
    context length (32768, not the 64 trained at: vLLM serves up to max_position_embeddings), its
    special token ids and its generation_config.json (transformers' generate reads EOS there)."""
    config = family_configs()["llama"]
    config.max_position_embeddings, config.bos_token_id, config.eos_token_id = 32768, 1, 2
    hf = make_hf(config)
    hf.generation_config.eos_token_id = 2
    hf.save_pretrained(tmp_path / "src")
    model, tcfg = load_hf_model(str(tmp_path / "src"), max_seq_len=64)
    tcfg.model.init_from = str(tmp_path / "src")
    export_hf(model, str(tmp_path / "out"), cfg=tcfg.model)
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.config.max_position_embeddings == 32768
    assert (back.config.bos_token_id, back.config.eos_token_id) == (1, 2)
    assert back.generation_config.eos_token_id == 2


def test_a_fine_tune_of_a_qwen3_moe_checkpoint_takes_its_balancing(tmp_path):
    """model.init_from of a Qwen3-MoE directory (softmax router, aux loss, no router bias): the run
    kept the recipe's aux-free balancing, so its MTP layer's router learnt a bias that `tandem
    export` refused as qwen3_moe after the whole fine-tune."""
    from tandem.trainer.hf.init_from import adopt_checkpoint_config
    from tandem.trainer.recipe import load_config

    config = family_configs()["qwen3_moe"]
    config.router_aux_loss_coef, config.vocab_size = 0.02, 300
    make_hf(config).save_pretrained(tmp_path / "src")
    cfg = load_config("recipes/finetune_mtp.yaml", [f"model.init_from={tmp_path / 'src'}",
                                                    f"data.vocab_size={config.vocab_size}"])
    assert cfg.model.balance == "aux_free"
    changed = adopt_checkpoint_config(cfg)
    assert (cfg.model.balance, cfg.model.aux_loss_coef) == ("aux_loss", 0.02)
    assert "model.balance: 'aux_free' -> 'aux_loss'" in changed


def test_an_fp8_checkpoint_imports_dequantized(tmp_path):
    """Qwen3's and DeepSeek-V3's FP8 releases store each linear weight in float8 with one
    `weight_scale_inv` factor per block (config.json: quantization_config, weight_block_size): the
    import multiplies them back, block by block (and slice by slice, as tensor parallelism reads),
    to the weights of the checkpoint written out dequantized, the reference. Other quantizations are
    refused by name."""
    from safetensors.torch import load_file, save_file

    from tandem.trainer.hf.reader import CheckpointError, CheckpointReader

    src, fp8, ref = tmp_path / "src", tmp_path / "fp8", tmp_path / "ref"
    make_hf(family_configs()["qwen3_moe"]).save_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    block = (8, 16)  # blocks that cut the tiny weights, which 128 x 128 would not
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if w.ndim != 2 or "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight"):
            quantized[name] = dequantized[name] = w
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.view(rows, block[0], cols, block[1]).abs().amax((1, 3))
        scale = amax.clamp_min(1e-12) / 448.0
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        q = (w / full[:w.shape[0], :w.shape[1]]).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        dequantized[name] = (q.float() * full[:w.shape[0], :w.shape[1]]).to(torch.bfloat16).float()
    config = json.loads((src / "config.json").read_text())
    for out, state, quant in ((fp8, quantized, {"quant_method": "fp8", "fmt": "e4m3",
                                                "weight_block_size": list(block)}),
                              (ref, dequantized, None)):
        out.mkdir()
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}
                                                    if quant else config))
    model, _ = load_hf_model(str(fp8))
    want, _ = load_hf_model(str(ref))
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), want.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    reader = CheckpointReader(str(fp8))
    name = "model.layers.1.self_attn.o_proj.weight"
    assert name + "_scale_inv" not in reader.keys() and reader.dtype(name) == torch.bfloat16
    for rows, cols in ((slice(3, 21), slice(5, 30)), (slice(8, 16), slice(0, 16)),
                       (slice(30, 32), slice(17, 18))):
        assert torch.equal(reader.read(name, (rows, cols)).float(), dequantized[name][rows, cols])
    # a weight without its scale would load as raw FP8 codes; a grid of another shape scales the
    # wrong blocks: both are refused, naming the tensor
    scale = name + "_scale_inv"
    for edit, message in (({scale: None}, f"{name} is stored in float8 without its {scale}$"),
                          ({scale: quantized[scale][:-1]}, f"{scale} has shape")):
        state = {k: v for k, v in {**quantized, **edit}.items() if v is not None}
        save_file(state, str(fp8 / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_hf_model(str(fp8))
        torch.save(state, str(fp8 / "model.pt"))  # a trusted pickle is checked alike
        (fp8 / "model.safetensors").unlink()
        with pytest.raises(CheckpointError, match=message):
            CheckpointReader(str(fp8), trust_pickle=True)
        (fp8 / "model.pt").unlink()
    # float8 weights with neither scales nor a quantization_config (a stripped release)
    save_file({k: v for k, v in quantized.items() if not k.endswith("_scale_inv")},
              str(fp8 / "model.safetensors"))
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="without its .* and config.json's quantization"):
        load_hf_model(str(fp8))
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "gptq", "bits": 4}}))
    with pytest.raises(CheckpointError, match="quant_method fp8"):
        load_hf_model(str(fp8))


def test_a_yarn_export_also_carries_the_keys_transformers_4_reads(tmp_path):
    """transformers 4.x, and DeepSeek's and Kimi's remote code, read `rope_theta` at the top level
    and YaRN from `rope_scaling`; an export writing only transformers 5's `rope_parameters` ran
    there with plain RoPE and the default softmax scale (logits 3.5 off). Both spellings say the
    same, and transformers 5 still reads the export as the imported model computes (the round
    trip's logits)."""
    hf = make_hf(family_configs()["deepseek_v3"])
    hf.save_pretrained(tmp_path / "src")
    model, _ = load_hf_model(str(tmp_path / "src"))
    export_hf(model, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    parameters, legacy = config["rope_parameters"], config["rope_scaling"]
    assert legacy["type"] == legacy["rope_type"] == parameters["rope_type"] == "yarn"
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim"):
        assert legacy[key] == parameters[key] == hf.config.rope_parameters[key], key
    assert config["rope_theta"] == parameters["rope_theta"] == 10000.0
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert logit_error(back, model) < 1e-4


@pytest.mark.parametrize("mscale, mscale_all_dim", [(0.0, 0.0), (0.0, 1.0), (0.707, 0.0),
                                                     (0.707, 1.0)])
def test_a_yarn_export_means_one_scale_to_every_reader(tmp_path, mscale, mscale_all_dim):
    """Tandem and transformers scale cos/sin by m(f) when either mscale is 0; vLLM's, SGLang's and
    DeepSeek's own DeepSeek rotary always by m(f, mscale) / m(f, mscale_all_dim), m(f, 0) = 1. An
    export of a pair holding a 0 was served at another scale (logits up to 4 off); the exported
    pair now gives the model's own scales under both readings."""
    import math

    from tandem.models.layers import Yarn
    from tandem.trainer.hf.rope import rope_parameters

    m = lambda f, x: 0.1 * x * math.log(f) + 1.0  # noqa: E731
    config = family_configs()["deepseek_v3"]
    config.rope_parameters.update(factor=40.0, mscale=mscale, mscale_all_dim=mscale_all_dim)
    make_hf(config).save_pretrained(tmp_path / "src")
    model, cfg = load_hf_model(str(tmp_path / "src"))
    own = Yarn(40.0, 16, mscale=mscale, mscale_all_dim=mscale_all_dim)
    out = rope_parameters(cfg.model)
    a, b = out["mscale"], out["mscale_all_dim"]
    assert m(40.0, a) / m(40.0, b) == pytest.approx(own.attention_factor)  # the engines' reading
    assert (m(40.0, b) ** 2 if b else 1.0) == pytest.approx(own.softmax_factor)
    export_hf(model, str(tmp_path / "out"))
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert logit_error(back, model) < 1e-4  # and transformers' reading


def test_an_mla_model_loads_its_export_whatever_its_unused_head_dim(tmp_path):
    """MLA does not use model.head_dim (its widths are the qk_*/v_head_dim keys), so a model that
    sets it loads its own export: the loader compared it ("resolved_head_dim: checkpoint 16 vs
    model 8")."""
    from tandem.models import TandemModel, flavors
    from tandem.models.mtp_config import MTPConfig
    from tandem.trainer.hf.importer import load_hf_weights

    torch.manual_seed(0)
    model = TandemModel(flavors.model_config("debug_mla", head_dim=8), MTPConfig(num_steps=1))
    export_hf(model, str(tmp_path / "out"))
    again = TandemModel(flavors.model_config("debug_mla", head_dim=8), MTPConfig(num_steps=1))
    load_hf_weights(again, str(tmp_path / "out"))
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b) or name.endswith("tokens_per_expert"), name
