"""MFU's model FLOPs and HFU's hardware FLOPs per token (trainer/cost.py)
against a count by hand for a tiny GLM-style config, and the loop's `mfu` / `hfu` keys built from
them (test_eval_in_loop)."""

import pytest

from tandem.trainer import cost as F
from tandem.trainer.recipe import load_config

# V=320 (the smallest tokenizer), H=16, 2 heads x 8 (q=16), 1 kv head (kv=8); layer 0 dense (I=32),
# layer 1 MoE (4 experts, top 2, expert width 8, one shared expert of width 8); one looped
# concat_proj MTP depth with an MoE block; S=8.
TINY = ["model.vocab_size=320", "data.vocab_size=320", "model.hidden_size=16", "model.num_layers=2",
        "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=8", "model.intermediate_size=32",
        "model.num_experts=4",
        "model.top_k=2", "model.moe_intermediate_size=8", "model.num_shared_experts=1",
        "model.first_k_dense=1",
        "mtp.num_steps=1", "mtp.num_layers=1", "mtp.style=looped", "mtp.moe=true", "data.seq_len=8"]

# forward FLOPs per token, 2 per multiply-add
# q,k,v + o + causal QK^T and AV = 1792
ATTN = 2 * 16 * (16 + 2 * 8) + 2 * 16 * 16 + 4 * 16 * (8 / 2)
MLP = 6 * 16 * 32  # 3072
MOE = 2 * 16 * 4 + 2 * 6 * 16 * 8 + 6 * 16 * 8  # router + 2 routed experts + shared = 2432
MTP_COMBINE = 2 * (2 * 16) * 16  # eh_proj over cat(emb, h): 1024
HEAD = 2 * 16 * 320  # 10240
VALID = 1 + 7 / 8  # depth 0 has 8 targets per 8-token window, depth 1 has 7
FORWARD = (ATTN + MLP) + (ATTN + MOE) + (MTP_COMBINE + ATTN + MOE)  # 14336 without the head


def test_model_flops_count_every_head_at_three_times_its_forward():
    cfg = load_config(None, TINY)
    got = F.training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len)
    assert got == pytest.approx(3 * (FORWARD + HEAD * VALID), rel=1e-12)
    assert got == 3 * (14336 + 19200)


@pytest.mark.parametrize("head_backward,head_passes", [("recompute", 4), ("fused", 3)])
@pytest.mark.parametrize("checkpointing,recompute", [("none", 0), ("selective", 0),
                                                      ("full", 2 * ATTN + MLP + MOE + ATTN + MOE)])
def test_hardware_flops_add_the_heads_recompute_and_full_checkpointing(checkpointing, recompute,
                                                                       head_backward,
                                                                        head_passes):
    """The recomputing head's logits run again in backward (4x its forward; the fused head computes
    its gradients with the forward: 3x); full checkpointing runs every trunk and MTP block forward
    again (not the MTP combine or the head); selective keeps the matmul outputs."""
    cfg = load_config(None, TINY + [f"mtp.loss_head_backward={head_backward}"])
    got = F.hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len, checkpointing)
    assert got == pytest.approx(3 * FORWARD + head_passes * HEAD * VALID + recompute, rel=1e-12)


def test_flagship_mfu_no_longer_counts_the_head_recompute():
    """On the GPU flagship recipe the old count (heads at 4x) was 14.6% above model FLOPs."""
    cfg = load_config("recipes/moe_4b_mtp_gpu.yaml", [])
    m, mtp, s = cfg.model, cfg.mtp, cfg.data.seq_len
    model = F.training_flops_per_token(m, mtp, s)
    hardware = F.hardware_flops_per_token(m, mtp, s, "none")
    recomputed = load_config("recipes/moe_4b_mtp_gpu.yaml",
                             ["mtp.loss_head_backward=recompute"]).mtp
    recompute_hardware = F.hardware_flops_per_token(m, recomputed, s, "none")
    layers, head = F.forward_flops_per_token(m, mtp, s)
    assert model == pytest.approx(3 * layers + 3 * head * sum((s - d) / s
                                                              for d in range(1 + mtp.num_steps)))
    assert recompute_hardware / model == pytest.approx(1.146, abs=5e-4)
    # the fused head (default) executes model FLOPs
    assert hardware == pytest.approx(model, rel=1e-12)


def test_a_frozen_trunk_and_a_teacher_are_counted_as_they_run():
    """By hand on the same config: a frozen trunk runs its layers, final norm and head forward only
    (1x), and the MTP depth's head, sharing the frozen weight, without its weight gradient (2x):
    MFU and HFU read 1.8x too high on the fine-tuning recipes. A teacher adds head forwards on
    every row: one for argmax distillation, three per MTP depth for soft targets (its logits beside
    the student's, both again in backward) or the acceptance objective."""
    cfg = load_config(None, TINY)
    trunk = (ATTN + MLP) + (ATTN + MOE)
    mtp_block = MTP_COMBINE + ATTN + MOE
    frozen = trunk + HEAD + 3 * mtp_block + 2 * HEAD * 7 / 8
    got = F.training_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len, freeze_trunk=True)
    assert got == pytest.approx(frozen, rel=1e-12)
    assert F.hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                      freeze_trunk=True) == pytest.approx(frozen, rel=1e-12)
    plain = 3 * FORWARD + 3 * HEAD * VALID
    for distill, objective, passes in (("argmax", "ce", 1), ("soft", "ce", 3),
                                       ("none", "acceptance", 3), ("none", "ce", 0)):
        teacher = F.teacher_head_passes(distill, objective, cfg.mtp)
        assert teacher == passes
        got = F.hardware_flops_per_token(cfg.model, cfg.mtp, cfg.data.seq_len,
                                         teacher_passes=teacher)
        assert got == pytest.approx(plain + passes * HEAD, rel=1e-12)


def test_mla_counts_its_own_projections():
    """MLA (model.kv_lora_rank > 0, the `debug_mla` flavor: width 32, 2 heads of 8 + 4 query/key
    channels and 8 value channels, latents of 12 (query) and 16 (key/value)): its parameters are
    the layer's own, its FLOPs a count by hand."""
    from tandem.models import flavors
    from tandem.models.latent_attention import LatentAttention

    cfg = flavors.model_config("debug_mla")
    # q_a, q_b, kv_a (latent + shared rotary key), kv_b (each head's key and value), o
    weights = 32 * 12 + 12 * (2 * 12) + 32 * (16 + 4) + 16 * (2 * (8 + 8)) + (2 * 8) * 32
    assert weights == 2336
    got = F.attention(cfg, 8)
    assert got.params == weights + 12 + 16 == sum(p.numel()
                                                  for p in LatentAttention(cfg).parameters())
    # QK^T over 12 channels and AV over 8, per head, across 8 / 2 keys on average
    assert got.flops == 2 * weights + 2 * 2 * (12 + 8) * (8 / 2)


def test_deepseek_v3_counts_its_published_671b():
    """DeepSeek-V3's release config.json (MLA, 61 layers, 256 experts) imported as the importer
    reads it: 671B parameters in the trunk, as DeepSeek reports. Its MTP module, which it gives as
    14B (with its own copies of the embedding and head, shared here), counts 11.6B + 1.9B =
    13.5B."""
    from tandem.models.mtp_config import MTPConfig
    from tandem.trainer.hf.families import detect_family, model_config_from_hf

    hf = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
          "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
          "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
          "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
          "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
          "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
          "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
          "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
          "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                           "type": "yarn"},
          "tie_word_embeddings": False}
    cfg = model_config_from_hf(hf, detect_family(hf))
    cfg.validate()
    trunk = sum(sum(F.layer_params(cfg, i).values()) for i in range(cfg.num_layers))
    table = cfg.vocab_size * cfg.hidden_size  # the embedding, and the head as large
    assert round((trunk + 2 * table + cfg.hidden_size) / 1e9, 1) == 671.0
    mtp = F.mtp_layer_params(cfg, MTPConfig(num_steps=1, num_layers=1, moe=True))
    assert 13.4e9 < mtp + 2 * table < 14.5e9


def test_mla_latents_are_counted_whole_on_every_tp_rank():
    """MLA's latent projections and norms are replicated over tp (tensor_hybrid.py): the memory
    estimate keeps them whole per tp rank, sharded only by FSDP, where it split every dense weight
    over tp (0.9 GiB per GPU short at DeepSeek-V3's shape under tp=8 x ep=2)."""
    from tandem.trainer import estimate as E

    base = ["flavor=debug_mla", "data.vocab_size=512", "mtp.num_steps=1", "data.seq_len=32"]
    counts = E.count_params(load_config(None, base))
    # q_a_proj 32 x 12 + its norm 12, kv_a_proj_with_mqa 32 x (16 + 4) + its norm 16, per layer
    assert counts.per_layer[0]["replicated"] == 32 * 12 + 12 + 32 * 20 + 16 == 1052
    one, two = (E.estimate(load_config(None, base + [f"parallel.tp={tp}"]), tp, counts)
                for tp in (1, 2))
    latents = 3 * 1052  # two trunk layers and the MTP layer, fp32 master + grad + AdamW: 16 bytes
    assert (one.states_gib_per_rank - two.states_gib_per_rank) * E.GIB == pytest.approx(
        16 * (counts.total - latents) / 2, rel=1e-9)
