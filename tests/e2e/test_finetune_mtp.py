"""MTP fine-tuning end to end: pretrain a tiny trunk here without MTP, export it to Hugging Face
layout, fine-tune with recipes/finetune_mtp.yaml model.init_from=<export>. Only MTP parameters train
(trunk tensors bit-identical, optimizer state only for mtp.*), and the acceptance length (this
project's speculative decoder, tandem.eval.spec_decode; teacher-forced MTP top-1 accuracy if it is
absent) rises above the freshly initialised head's."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The recipe's in-loop evaluator at the last step, on a budget that keeps the test quick.
EVAL_BUDGET = ["eval.num_prompts=4", "eval.max_new_tokens=16", "eval.temperatures=[]",
               "eval.loss_batches=1"]


def shape_overrides(tmp, cache=None):
    return ["data.stdlib_max_bytes=200000", "data.vocab_size=512", "data.seq_len=64",
            f"data.cache_dir={cache or tmp + '/cache'}",
            "train.dtype=fp32", "logging.wandb=false", "logging.progress=false",
            "train.micro_batch_size=8"]


def acceptance(model, prompts, K):
    """Mean acceptance length with the speculative decoder (tandem.eval.spec_decode)."""
    from tandem.eval.acceptance import acceptance_metrics
    from tandem.eval.spec_decode import generate

    model.eval()
    with torch.no_grad():
        res = generate(model, [p[:32].tolist() for p in prompts], max_new_tokens=32, num_steps=K)
    return acceptance_metrics(res.stats)["acceptance_length"]


def test_finetune_mtp_from_hf_export(tmp_path, corpus_cache):
    from tandem.trainer.cli import main as cli
    from tandem.trainer.loop import run_training
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_run

    tmp = str(tmp_path)
    pre = ["mtp.num_steps=0", "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
           "model.num_heads=4",
           "model.num_kv_heads=2", "model.intermediate_size=128", "model.moe_intermediate_size=32",
           "model.num_experts=4",
           "model.max_seq_len=128", "train.max_steps=30", "train.warmup_steps=5", "eval.interval=0",
           f"run.dir={tmp}/pre"] + shape_overrides(tmp, corpus_cache)
    assert cli(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), *pre]) == 0
    assert cli(["export", "--checkpoint", f"{tmp}/pre", "--out", f"{tmp}/hf"]) == 0
    assert os.path.isfile(f"{tmp}/hf/config.json") and os.path.isfile(f"{tmp}/hf/model.safetensors")

    ft = [f"model.init_from={tmp}/hf", f"run.dir={tmp}/ft", "train.max_steps=40", "train.lr=3e-3",
          "train.warmup_steps=5", "checkpoint.interval=0",
          *EVAL_BUDGET] + shape_overrides(tmp, corpus_cache)
    cfg = load_config(os.path.join(ROOT, "recipes", "finetune_mtp.yaml"), ft)
    trainer = build_run(cfg)
    # shape from the export
    assert trainer.cfg.model.hidden_size == 64 and trainer.cfg.model.num_experts == 4
    model = trainer.model
    trunk_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    fresh = copy.deepcopy(model)
    K = cfg.mtp.num_steps
    from tandem.data_pipeline.batches import get_batch

    prompts = get_batch(trainer.valid_ds, list(range(4)))["tokens"]
    record = run_training(trainer)
    assert record is not None and record["step"] == 40

    trunk_after = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    for k, v in trunk_before.items():
        assert torch.equal(v, trunk_after[k]), f"trunk tensor {k} changed"
    names = {id(p): n for n, p in model.named_parameters()}
    state_params = [names[id(p)] for p in trainer.optimizer.state]
    assert state_params and all(n.startswith("mtp.") for n in state_params)
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("mtp."))

    before, after = acceptance(fresh, prompts, K), acceptance(model, prompts, K)
    print(f"acceptance length: fresh head {before:.3f} -> fine-tuned {after:.3f}")
    assert after > before, (before, after)
    # the recipe's evaluator ran at the last step on the frozen trunk with the trained drafter
    logged = [json.loads(line) for line in open(f"{tmp}/ft/metrics.jsonl")]
    final = next(r for r in logged if "eval/acceptance_length" in r)
    assert final["step"] == 40 and final["eval/identical_to_autoregressive"] == 1.0


QWEN4 = ["model.full_attention_interval=2", "model.hc_count=4", "model.hc_lowrank=8",
         "model.zero_centered_norm=true",
         "model.shared_expert_gate=true", "model.router_score=softmax", "model.balance=aux_loss",
         "model.first_k_dense=0",
         "model.head_dim=16",
         "model.partial_rotary_factor=0.5", "model.linear_num_key_heads=2",
         "model.linear_num_value_heads=4",
         "model.linear_key_head_dim=16", "model.linear_value_head_dim=16", "model.indexer_heads=2",
         "model.indexer_head_dim=16", "model.indexer_budget=16", "model.indexer_compress_ratio=4",
         "model.ple_layers=[0]", "model.heads_per_ngram=2", "model.ngram_vocab_base=509",
         "model.eos_token_id=0"]


def test_finetune_qwen4_exp_drafter_from_hf_export(tmp_path, corpus_cache):
    """A Qwen4-Exp trunk exported in transformers' layout (PLE table in shards, no mtp.* weights)
    gets a fresh qwen4_exp drafter: only it trains, the trunk (PLE table included) stays
    bit-identical, and the export afterwards carries the drafter in vLLM's mtp.* layout."""
    from tandem.trainer.cli import main as cli
    from tandem.trainer.hf.reader import CheckpointReader
    from tandem.trainer.loop import run_training
    from tandem.trainer.recipe import load_config
    from tandem.trainer.run import build_run

    tmp = str(tmp_path)
    pre = ["mtp.num_steps=0", "model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
           "model.num_heads=4",
           "model.num_kv_heads=2", "model.intermediate_size=32", "model.moe_intermediate_size=32",
           "model.num_experts=4",
           "model.max_seq_len=128", "train.max_steps=10", "train.warmup_steps=2", "eval.interval=0",
           f"run.dir={tmp}/pre"] + QWEN4 + shape_overrides(tmp, corpus_cache)
    assert cli(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), *pre]) == 0
    assert cli(["export", "--checkpoint", f"{tmp}/pre", "--out", f"{tmp}/hf"]) == 0
    keys = CheckpointReader(f"{tmp}/hf").keys()
    assert any(".ngram_embedding.shard_" in k for k in keys) and not any(k.startswith("mtp.")
                                                                         for k in keys)

    # balancing is the run's choice: the drafter's softmax router must not grow an aux-free bias the
    # qwen4_exp layout cannot store
    ft = [f"model.init_from={tmp}/hf", f"run.dir={tmp}/ft", "train.max_steps=20", "train.lr=3e-3",
          "train.warmup_steps=2", "checkpoint.interval=0", "eval.interval=0",
          "model.balance=aux_loss"
          ] + shape_overrides(tmp, corpus_cache)
    cfg = load_config(os.path.join(ROOT, "recipes", "finetune_mtp.yaml"), ft)
    trainer = build_run(cfg)
    assert trainer.cfg.model.hc_count == 4 and trainer.cfg.mtp.trunk_input == "pre_norm"
    model = trainer.model
    trunk_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    record = run_training(trainer)
    assert record is not None and record["step"] == 20
    for k, v in trunk_before.items():
        assert torch.equal(v, model.state_dict()[k]), f"trunk tensor {k} changed"
    import json

    losses = [json.loads(x)["loss/mtp_1"] for x in open(f"{tmp}/ft/metrics.jsonl")
              if '"loss/mtp_1"' in x]
    assert losses[-1] < losses[0], losses
    assert cli(["export", "--checkpoint", f"{tmp}/ft", "--out", f"{tmp}/hf_mtp", "--family",
                "qwen4_exp"]) == 0
    keys = CheckpointReader(f"{tmp}/hf_mtp").keys()
    for name in ("mtp.fc_embedding.weight", "mtp.fc_hidden.weight",
                 "mtp.pre_fc_norm_embedding.weight",
                 "mtp.pre_fc_norm_hidden.weight", "mtp.hyper_connection_mixer.hc_norm.weight",
                 "mtp.layers.0.self_attn.indexer.index_qk_proj.weight",
                 "mtp.layers.0.mlp.experts.0.gate_proj.weight"):
        assert name in keys, name
