"""Context parallelism in the cost model (trainer/context_cost.py, trainer/estimate.py): which rows
each cp rank holds, its FLOPs under zigzag and contiguous sharding (the choice docs/long_context.md
makes), what CP adds to a rank's memory, and the 256k recipes' `--check` (fit, node count, the cp
sweep)."""

from __future__ import annotations

import os
import re

import pytest

from tandem.trainer import context_cost as X
from tandem.trainer.cost import forward_flops_per_token
from tandem.trainer.estimate import count_params, estimate
from tandem.trainer.launch import launch_slurm_main
from tandem.trainer.recipe import load_config

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
GPU_256K = os.path.join(RECIPES, "qwen38_flash_gpu_256k.yaml")
ASCEND_256K = os.path.join(RECIPES, "qwen38_flash_ascend_256k.yaml")
CP_CONSIDERED = (2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def qwen38_256k():
    return load_config(GPU_256K)


@pytest.fixture(scope="module")
def moe_4b_32k():
    """The full-attention family at 32k tokens."""
    return load_config(os.path.join(RECIPES, "moe_4b_mtp_gpu.yaml"),
                       ["data.seq_len=32768", "model.max_seq_len=32832"])


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_rank_chunks_cover_the_window_once(sharding):
    spans = X.rank_chunks(64, 4, sharding)
    rows = sorted(t for mine in spans for a, b in mine for t in range(a, b))
    assert rows == list(range(64))
    assert all(sum(b - a for a, b in mine) == 16 for mine in spans)
    if sharding == "zigzag":  # rank r: chunks r and 2cp - 1 - r
        assert spans[1] == [(8, 16), (48, 56)]


def test_ranks_sum_to_the_cost_model_at_cp_1(qwen38_256k):
    """One rank's FLOPs are the window's: 3x the forward per token (every head over every row) x
    S."""
    cfg = qwen38_256k
    s = cfg.data.seq_len
    layers, head = forward_flops_per_token(cfg.model, cfg.mtp, s)
    (one,) = X.rank_training_flops(cfg.model, cfg.mtp, s, 1, "zigzag")
    assert one == pytest.approx(3 * s * (layers + (1 + cfg.mtp.num_steps) * head), rel=1e-4)
    # under cp the ranks share it, plus Gated DeltaNet's exchange work (augmented values, folds)
    ranks = X.rank_training_flops(cfg.model, cfg.mtp, s, 8, "zigzag")
    assert one < sum(ranks) < 1.05 * one


@pytest.mark.parametrize("family", ["qwen38_256k", "moe_4b_32k"])
def test_zigzag_keeps_every_cp_rank_within_1_15_of_the_mean(family, request):
    """The sharding choice: zigzag's most expensive rank is within 1.15x of the mean at every cp
    size considered, for the 256k recipe (QSA's S^2 / r scoring) and for full attention at 32k;
    contiguous gives the last rank more (for full attention beyond 1.15x from cp = 2 on)."""
    cfg = request.getfixturevalue(family)
    s = cfg.data.seq_len
    for cp in CP_CONSIDERED:
        zigzag = X.balance(cfg.model, cfg.mtp, s, cp, "zigzag")
        contiguous = X.balance(cfg.model, cfg.mtp, s, cp, "contiguous")
        assert zigzag <= 1.15 and contiguous > zigzag, (cp, zigzag, contiguous)
        if family == "moe_4b_32k":
            assert contiguous > 1.15, (cp, contiguous)


def test_contiguous_full_attention_stays_below_2cp_minus_1_over_cp():
    """Full attention's window work is 4 q u per query; with per-token work beside it the last
    contiguous rank does more than the mean and less than (2cp - 1) / cp of it (attention alone)."""
    cfg = load_config(None, ["data.seq_len=4096", "model.max_seq_len=4200"])
    m = cfg.model
    work = X.window_work(m, "attention", 4096.0)
    assert work == 4 * m.num_heads * m.resolved_head_dim * 4096
    ratio = X.balance(m, cfg.mtp, 4096, 4, "contiguous")
    assert 1.0 < ratio < 7 / 4


def test_memory_per_rank_falls_with_cp(qwen38_256k):
    counts = count_params(qwen38_256k)
    totals, acts = [], []
    for cp in (8, 16, 32):
        cfg = load_config(GPU_256K, [f"parallel.cp={cp}"])
        est = estimate(cfg, None, counts)
        totals.append(est.total_gib_per_rank)
        acts.append(est.activations_gib_per_rank)
        assert set(est.cp_balance) == {"zigzag", "contiguous"} and est.context_gib_per_rank > 0
    assert totals == sorted(totals, reverse=True) and acts[0] > 3.5 * acts[2]


def test_context_bytes_by_hand():
    """qwen4_exp_tiny (Gated DeltaNet and QSA layers, a QSA drafter) at cp=2, zigzag, fp32 on the
    CPU: the gathered K, V and indexer keys over the whole window, and 2 x cp chunk states per GDN
    layer; none at cp=1."""
    cfg = load_config(os.path.join(RECIPES, "qwen4_exp_tiny.yaml"),
                      ["parallel.cp=2", "data.seq_len=64"])
    m = cfg.model
    b, s = cfg.train.micro_batch_size, 64
    layers = list(range(m.num_layers))
    parts = X.context_bytes(cfg, layers, cfg.mtp.num_steps, 4)
    kinds = [m.layer_type(i) for i in layers]
    # the drafter's depths run QSA
    attn = sum(k != "linear_attention" for k in kinds) + cfg.mtp.num_steps
    gdn = kinds.count("linear_attention")
    kv = m.num_kv_heads * m.resolved_head_dim
    # depths 2..K reuse depth 1's selection (mtp.qsa_reuse_indices): no indexer keys to gather
    indexing = attn - (cfg.mtp.num_steps - 1)
    assert parts["gathered_kv"] == (attn * 2 * kv + indexing * m.indexer_head_dim) * b * s * 4
    dk, dv, nv = m.linear_key_head_dim, m.linear_value_head_dim, m.linear_num_value_heads
    # 2 chunks x 2 ranks, fp32: each chunk's (transition, final state) and the state entering it
    assert parts["gdn_states"] == gdn * b * 4 * nv * dk * (dk + 2 * dv) * 4
    # the augmented values: fp32 in the torch chunked form, the compute dtype's in fla's kernel
    # (CUDA, no packed documents), whatever the compute dtype
    width = gdn * 2 * b * (s // 2) * nv * dk
    assert X.context_bytes(cfg, layers, cfg.mtp.num_steps, 2)["gdn_width"] == width * 4
    cfg.device = "cuda"
    assert X.context_bytes(cfg, layers, cfg.mtp.num_steps, 2)["gdn_width"] == width * 2
    cfg.data.document_mask = True
    assert X.context_bytes(cfg, layers, cfg.mtp.num_steps, 2)["gdn_width"] == width * 4
    assert X.context_bytes(load_config(os.path.join(RECIPES, "qwen4_exp_tiny.yaml")), layers, 1,
                           4) == {}


def test_cp_1_estimates_have_no_context_part():
    est = estimate(load_config(os.path.join(RECIPES, "tiny.yaml")))
    assert est.context_gib_per_rank == 0 and not est.cp_balance and "context" not in est.summary()
    # a small model's figures in M and MiB (they read 0.003B and 0.0 GiB)
    assert est.summary().startswith("params total=2.726M active/token=1.546M")
    assert re.search(r"states=\d+\.\d\d MiB", est.summary()), est.summary()


@pytest.mark.parametrize("recipe, nodes, device, row",
                         [(GPU_256K, 16, "H200", "| GPU recipe: GiB per H200 |"),
                          (ASCEND_256K, 128, "Ascend 910B", "| Ascend recipe (full activation "
                                                            "checkpointing): GiB per 910B |")])
def test_256k_recipes_check_fits_and_prints_nodes_and_the_cp_sweep(recipe, nodes, device, row,
                                                                   capsys):
    assert launch_slurm_main([recipe, "--nodes", str(nodes), "--gpus-per-node", "8",
                              "--check"]) == 0
    out = capsys.readouterr().out
    assert "layout ok" in out and f"fits on {nodes} nodes of 8" in out and device in out, out
    assert "zigzag=1.00" in out
    sweep = [line.strip() for line in out.splitlines() if line.strip().startswith("cp=")]
    assert [line.split(":")[0] for line in sweep] == [f"cp={c}" for c in X.CP_SIZES], sweep
    assert any(f"= {nodes} nodes of 8" in line and line.endswith(": fits") for line in sweep), sweep
    assert sweep[0].endswith("DOES NOT FIT")  # cp=4 cannot hold 262k tokens on any of these devices
    # docs/long_context.md's table is what --check prints (its figures had drifted 2.4 GiB)
    page = open(os.path.join(os.path.dirname(RECIPES), "docs", "long_context.md")).read()
    line = next(line for line in page.splitlines() if line.startswith(row))
    documented = [float(re.match(r"[*\s]*([\d.]+)", cell).group(1))
                  for cell in line[len(row):].strip(" |").split("|")]
    assert documented == [float(re.search(r"total ([\d.]+)", s).group(1)) for s in sweep], line
