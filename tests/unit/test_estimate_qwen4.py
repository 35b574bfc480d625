"""The cost model (trainer/cost.py) for the Qwen4-Exp layers: Gated DeltaNet, QSA,
hyper-connections, PLE and the qwen4_exp drafter, by FLOPs and parameters, checked three ways:
against numbers worked out by hand for a tiny config, against the modules themselves (parameters on
the meta device, matmul FLOPs counted by torch's FlopCounterMode, QSA's attended tokens from its own
selection), and where they are used (MFU's FLOPs per token, pp_balance's items, --check's PLE
line)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tandem.models import TandemModel
from tandem.models.delta_rule import SOLVE_BLOCK
from tandem.models.qsa_tokens import token_mask
from tandem.trainer import cost as C
from tandem.trainer import cost as F
from tandem.trainer import estimate as E
from tandem.trainer.parallel.pipeline_plan import item_flops
from tandem.trainer.recipe import load_config

# Every Qwen4-Exp part at a size small enough to count by hand: layer 0 Gated DeltaNet with PLE,
# layer 1 QSA (budget 8 in blocks of 4), 2 hyper-connection streams of rank 4, 4 experts top-2 with
# a gated shared expert, the qwen4_exp drafter (K=2, one layer).
HAND = ["model.vocab_size=320", "model.hidden_size=16", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=8", "model.partial_rotary_factor=0.5",
        "model.full_attention_interval=2", "model.hc_count=2", "model.hc_lowrank=4",
        "model.zero_centered_norm=true",
        "model.num_experts=4", "model.top_k=2", "model.moe_intermediate_size=8",
        "model.num_shared_experts=1",
        "model.shared_expert_intermediate_size=8", "model.shared_expert_gate=true",
        "model.first_k_dense=0",
        "model.router_score=softmax", "model.linear_num_key_heads=1",
        "model.linear_num_value_heads=2",
        "model.linear_key_head_dim=4", "model.linear_value_head_dim=4", "model.indexer_heads=2",
        "model.indexer_head_dim=8", "model.indexer_budget=8", "model.indexer_compress_ratio=4",
        "model.ple_layers=[0]", "model.ple_embed_dim=8", "model.heads_per_ngram=2",
        "model.ngram_vocab_base=97",
        "model.eos_token_id=1", "model.max_seq_len=128", "mtp.num_steps=2", "data.seq_len=16",
        "data.vocab_size=320"]


def hand_cfg(*extra):
    return load_config(None, HAND + list(extra))


def test_hand_computed_parameters_and_flops():
    m = hand_cfg().model
    # Gated DeltaNet: in_proj_qkv 16x16, z 16x8, b and a 16x2 each, conv 16x4, dt_bias and A_log 2
    # each, gated norm 4, out_proj 8x16
    assert C.mixer(m, "linear_attention", 16).params == 256 + 128 + 64 + 64 + 4 + 4 + 128 == 648
    # projections 2*(256 + 128 + 64 + 128) = 1152, conv 2*16*4 = 128, the rule per value head at C =
    # 64: 6*64*4 + 4*64*4 + 6*4*4 + 2*64^2/3, times 2 heads
    assert C.gated_deltanet(m).flops == pytest.approx(1152 + 128 + 2
                                                      * (1536 + 1024 + 96 + 8192 / 3))
    # QSA: q_proj (query + gate) 16x32, k and v 16x8 each, o 16x16, q/k norms 8 each, the indexer
    # 16x24 + 2x8
    assert C.mixer(m, "indexed_attention", 16).params == 512 + 256 + 256 + 16 + 384 + 16 == 1440
    # S = 16: complete blocks visible to u = t+1 = 1..16 sum floor(u/4) = 28; tokens attended: every
    # visible one for u <= 11 (66), then 8 + (u mod 4) for u = 12..16 (8+9+10+11+8 = 46): mean
    # 112/16 = 7
    assert C.qsa_mean_blocks(m, 16) == 28 / 16 and C.qsa_mean_keys(m, 16) == 7.0
    assert C.qsa(m,
                 16).flops == 2 * (512 + 256 + 256 + 384) + 2 * 2 * 8 * 28 / 16 + 4 * 16 * 7 == 3320
    # a hyper-connection over 2 x 16 channels: grouped norm 32, down 32x4, up 4x32, inject 32x2
    assert C.block_norms(m).params == 2 * (32 + 128 + 128 + 64)
    assert C.hyper_connection(m).flops == 2 * (128 + 128
                                               + 64) and F.final_norm_forward_flops(m) == 2 * 256
    assert C.final_norm(m).params == 32 + 256
    # PLE: key 8x32, value 8x16, three norms of 32, conv 32x4; the table: primes 97, 101, 103, 107
    # (408 rows) padded to 512 rows of 8 / 4 heads = 2
    assert (C.ple(m).params, C.ple_table(m, 0)) == (256 + 128 + 96 + 128, 512 * 2)
    assert C.ple(m).flops == 2 * (256 + 128 + 128) == 1024
    # MoE: router 4x16, routed 4 x 3 x 16x8, shared 3 x 16x8 and its gate 16
    assert (C.mlp(m, True).params, C.mlp(m, True).experts) == (64 + 384 + 16, 1536)
    assert C.mlp(m, True).flops == 2 * 64 + 2 * 2 * 384 + 2 * 384 + 2 * 16 == 2464
    assert sum(C.layer_params(m, 0).values()) == 648 + 704 + 608 + 1024 + 464 + 1536
    # the drafter: two norms (16, 32), fc_embedding and fc_hidden 16x16, a QSA + MoE block with its
    # two hyper-connections and its own stream mixer
    mtp = hand_cfg().mtp
    assert C.mtp_layer_params(m, mtp) == 16 + 32 + 512 + 1440 + 464 + 1536 + 704 + 288
    assert F.mtp_layer_forward_flops(m, mtp, 16) == 2 * 256 + 2 * 2 * 256 + 3320 + 2464 + 1280 + 512


@pytest.mark.parametrize("extra",
                         [[], ["model.hc_count=4", "model.ple_layers=[0,2]", "model.num_layers=4",
                                        "mtp.num_layers=2"]])
def test_parameter_counts_match_the_modules_on_the_meta_device(extra):
    cfg = hand_cfg(*extra)
    m = cfg.model
    with torch.device("meta"):
        model = TandemModel(m, cfg.mtp)
    count = lambda mod: sum(p.numel() for p in mod.parameters()) if mod is not None else 0  # noqa: E731
    for i, block in model.layers.items():
        got = C.layer_params(m, int(i))
        table = block.ple.ple_embedding if block.ple is not None else None
        hcs = count(block.attn_hyper_connection) + count(block.mlp_hyper_connection)
        assert got == {"mixer": count(block.mixer),
                       "mlp": count(block.mlp) - count(block.mlp.experts),
                       "experts": count(block.mlp.experts), "norms": hcs,
                       "ple": count(block.ple) - count(table), "ple_table": count(table)}, i
    assert C.final_norm(m).params == count(model.norm)
    assert all(C.mtp_layer_params(m, cfg.mtp) == count(layer) for layer in model.mtp.layers)
    est = E.estimate(cfg)
    assert est.total_params == count(model)
    assert est.ple_table_params == sum(C.ple_table(m, k) for k in range(len(m.ple_layers)))
    # a token reads top 2 of the 4 experts and a few rows of the PLE tables
    assert (
        est.active_params_per_token == count(model) - est.ple_table_params - est.expert_params // 2
    )


def _per_token(fn, tokens: int) -> dict:
    with FlopCounterMode(display=False) as fc:
        fn()
    return {str(k): v / tokens for k, v in fc.get_flop_counts()["Global"].items()}


def test_flops_match_the_matmuls_torch_counts():
    # the model's forward FLOPs: the indexer KL's dense target is a cost of the training step
    # (flops.qsa_indexer_target_flops), so this forward runs without it
    cfg = hand_cfg("model.expert_matmul=loop", "model.indexer_loss_coef=0")
    m, b, s = cfg.model, 2, 64
    torch.manual_seed(0)
    model = TandemModel(m, cfg.mtp)
    x, xs = torch.randn(b, s, m.hidden_size), torch.randn(b, s, m.hc_count * m.hidden_size)
    pos, ids = torch.arange(s).expand(b, s), torch.randint(0, m.vocab_size, (b, s))
    gdn_block, qsa_block = model.layers["0"], model.layers["1"]
    # hyper-connections and PLE are matmuls and a conv only
    assert sum(_per_token(lambda: gdn_block.attn_hyper_connection(xs),
                          b * s).values()) == C.hyper_connection(m).flops
    assert sum(_per_token(lambda: model.norm(xs), b * s).values()) == F.final_norm_forward_flops(m)
    assert sum(_per_token(lambda: gdn_block.ple(xs, ids, pos), b * s).values()) == C.ple(m).flops
    # Gated DeltaNet: the model counts fla's triangular inverse (2C^2/3 per token and value head);
    # the pure-PyTorch path substitutes row by row inside B x B diagonal blocks (a 1 x B by B x B
    # product per row: 2B(B-1) per token) and merges blocks of size h = B, 2B, .., C/2 by two h x h
    # products (2h^2 per token): every other matmul is the same
    c, nv, blk = C.GDN_CHUNK, m.linear_num_value_heads, SOLVE_BLOCK
    merges = sum(2 * h * h for h in (blk * 2 ** i for i in range(int(math.log2(c // blk)))))
    torch_path = C.gated_deltanet(m).flops + nv * (2 * blk * (blk - 1) + merges - 2 * c * c / 3)
    assert sum(_per_token(lambda: gdn_block.linear_attn(x, pos), b * s).values()) == pytest.approx(
        torch_path, rel=1e-12
    )
    # QSA (mask form): the projections, and the block scores (here over all S/r blocks, visible or
    # not)
    got = _per_token(lambda: qsa_block.self_attn(x, pos), b * s)
    proj = C.qsa(m, s).flops - 2 * 2 * m.num_heads * m.resolved_head_dim * C.qsa_mean_keys(m, s) \
        - 2 * m.indexer_heads * m.indexer_head_dim * C.qsa_mean_blocks(m, s)
    assert got["aten.mm"] == proj
    assert (
        got["aten.bmm"] == 2 * m.indexer_heads * m.indexer_head_dim * s / m.indexer_compress_ratio
    )
    # the MoE: each token through the router, top_k experts, the shared expert and its gate
    assert sum(_per_token(lambda: gdn_block.mlp(x), b * s).values()) == C.mlp(m, True).flops


@pytest.mark.parametrize("s,budget,ratio",
                         [(16, 8, 4), (64, 8, 4), (67, 16, 4), (50, 12, 3), (10, 64, 4)])
def test_qsa_attended_tokens_are_its_selection(s, budget, ratio):
    """Mean tokens a query attends (and blocks it scores) equal what IndexedAttention selects."""
    m = hand_cfg(f"model.indexer_budget={budget}", f"model.indexer_compress_ratio={ratio}").model
    attn = TandemModel(m, hand_cfg().mtp).layers["1"].self_attn
    attn.budget, attn.compress_ratio = budget, ratio
    at = torch.arange(s).expand(2, s)
    scores = torch.rand(2, s, s // ratio)
    blocks, count = attn.select_blocks(scores, at)
    mask = token_mask(attn.compress_ratio, blocks, count, at, s)
    assert float(mask.sum(-1).double().mean()) == pytest.approx(C.qsa_mean_keys(m, s), rel=1e-12)
    assert float(((at + 1) // ratio).double().mean()) == pytest.approx(C.qsa_mean_blocks(m, s),
                                                                       rel=1e-12)


def test_mfu_and_pipeline_balance_count_the_new_layers():
    cfg = hand_cfg("mtp.num_steps=2")
    m, mtp, s = cfg.model, cfg.mtp, 16
    layer = [F.trunk_layer_forward_flops(m, i, s) for i in range(m.num_layers)]
    assert layer[0] == C.gated_deltanet(m).flops + C.ple(m).flops + C.block_norms(m).flops + 2464
    assert layer[1] == C.qsa(m, s).flops + C.block_norms(m).flops + 2464
    head, valid = 2 * 16 * 320, (16 + 15 + 14) / 16
    # depth 2 reuses depth 1's QSA selection (mtp.qsa_reuse_indices): it runs no indexer, neither
    # its 16x24 projection nor its scores of 28/16 blocks (2 * 384 + 2 * 2 * 8 * 28 / 16 = 824)
    depth1 = F.mtp_layer_forward_flops(m, mtp, s)
    assert F.mtp_layer_forward_flops(m, mtp, s, 2) == depth1 - 824
    model = 3 * (sum(layer) + F.final_norm_forward_flops(m) + 2 * depth1 - 824 + head * valid)
    # MFU's: 3x, no recomputation
    assert F.training_flops_per_token(m, mtp, s) == pytest.approx(model, rel=1e-12)
    # without reuse depth 2 selects for itself, as depth 1
    own = hand_cfg("mtp.num_steps=2", "mtp.qsa_reuse_indices=false").mtp
    assert F.training_flops_per_token(m, own, s) == pytest.approx(model + 3 * 824, rel=1e-12)
    assert F.hardware_flops_per_token(m, own, s) == pytest.approx(model + 3 * 824 + 3 * 512,
                                                                  rel=1e-12)
    # HFU's: the indexer KL's target (2 heads x 8 x S = 512) in the QSA layer and depth 1 (depth
    # 2 has no indexer loss), and under the recomputing head each head's logits again in backward
    # (4x)
    indexer_target = 2 * 2 * 16 * 16
    assert F.hardware_flops_per_token(m, mtp, s) == pytest.approx(model + indexer_target, rel=1e-12)
    recomputed = hand_cfg("mtp.num_steps=2", "mtp.loss_head_backward=recompute").mtp
    assert F.hardware_flops_per_token(m, recomputed,
                                      s) == pytest.approx(model + head * valid + indexer_target,
                                                                         rel=1e-12)
    # pp_balance's items: the QSA layer also pays the indexer KL's dense no-grad target (2 heads x 8
    # x S), a head 3x its forward (the fused backward, the default: the balancer priced it at the 4x
    # of the recomputing one)
    layers, depths = item_flops(cfg)
    assert layers == [3 * layer[0], 3 * layer[1] + 2 * 16 * 16]
    assert depths[0] == pytest.approx(3 * head + 3 * F.final_norm_forward_flops(m))
    assert depths[1] == pytest.approx(3 * head * 15 / 16 + 3 * depth1 + 2 * 16 * 16)
    assert depths[2] == pytest.approx(3 * head * 14 / 16 + 3 * (depth1 - 824))
    recomputing = item_flops(hand_cfg("mtp.loss_head_backward=recompute"))[1]
    assert recomputing[0] == pytest.approx(4 * head + 3 * F.final_norm_forward_flops(m))
    no_kl = item_flops(hand_cfg("model.indexer_loss_coef=0"))[0]
    assert no_kl == [3 * layer[0], 3 * layer[1]]
    # a plain model keeps its costs: no hyper-connection, PLE or final-mixer term
    plain = load_config(None,
                        ["model.hidden_size=64", "model.num_heads=4", "data.seq_len=64"]).model
    assert F.final_norm_forward_flops(plain) == 0 and C.block_norms(plain).flops == 0
    assert (
        F.trunk_layer_forward_flops(plain, 0, 64)
        == C.attention(plain, 64).flops + C.mlp(plain, False).flops
    )


def test_check_shows_the_ple_tables_share_per_rank(capsys, tmp_path):
    from tandem.trainer.launch import launch_slurm_main

    overrides = HAND + ["parallel.ep=2", "parallel.pp=2", "train.grad_accum_steps=2",
                        "train.dtype=bf16", f"run.dir={tmp_path}"]
    recipe = tmp_path / "q4.yaml"
    recipe.write_text("# Hardware: CPU\n")
    assert launch_slurm_main([str(recipe), *overrides, "--nodes", "2", "--procs-per-node", "4",
                              "--check"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(str(recipe), overrides)
    est = E.estimate(cfg, 8)  # dp 2 x ep 2 x pp 2: the table is in 1/4 shards on pp rank 0
    table = C.ple_table(cfg.model, 0)
    assert est.ple_shard == "1/4 = dp 2 x ep 2"
    assert est.ple_states_gib_per_rank == pytest.approx(16 * table / 4 / 2**30)
    # never gathered: the lookup's buffers instead (ids, exchanged rows; bf16 rows, tp 1), and
    # FSDP's gathered copies hold no table row
    m = cfg.model
    heads, tokens = (m.ngram_size
                     - 1) * m.heads_per_ngram, cfg.data.seq_len * cfg.train.micro_batch_size
    asked = tokens * heads
    need = tokens * heads * 32 + asked * 40 + asked * (m.resolved_ple_embed_dim // heads) * (4
                                                                                             + 4) \
        + tokens * m.resolved_ple_embed_dim * 2
    assert est.ple_lookup_gib_per_rank == pytest.approx(need / 2**30)
    assert est.ple_exchange_bytes == pytest.approx(2 * asked * (m.resolved_ple_embed_dim // heads)
                                                   * 2 + asked * 4)
    no_table = E.estimate(load_config(str(recipe), overrides + ["model.ngram_vocab_base=2"]), 8)
    assert est.gathered_gib_per_rank == pytest.approx(no_table.gathered_gib_per_rank)
    assert "PLE n-gram table: 0.001M params, sharded 1/4 = dp 2 x ep 2" in out, out
    assert "never gathered" in out and "lookup=" in out, out
    assert (
        "dense AdamW over the shards" in out and "FLOPs/token: train=" in out and "gdn=" in out
    ), out
