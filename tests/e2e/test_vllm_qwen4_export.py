"""`tandem export --family qwen4_exp` writes the drafter where vLLM's `Qwen4ExpMTP` loads it: every
exported name goes through vLLM's own weight-name remapping (run in the vLLM virtual environment the
serving test builds); every `mtp.*` tensor lands on a name of the draft model (`model.*`), the trunk's
tensors are skipped by the draft loader except the shared embedding and head, the drafter's decoder
layer is named exactly like a trunk QSA layer, and every shape follows the config. (vLLM serves this
model on CUDA only, so serving itself is `bench/gpu_check.py`'s.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "unit"))


def test_exported_drafter_names_follow_vllm_remapping(tmp_path):
    from test_qwen4_exp import EOS, VOCAB  # the tiny all-parts config of the parity test
    from test_vllm_serving import vllm_python

    from tandem.models import MTPConfig, ModelConfig, TandemModel
    from tandem.trainer.hf.exporter import export_hf
    from tandem.trainer.hf.importer import CheckpointReader

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                      moe_intermediate_size=16, num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True,
                      first_k_dense=0, router_score="softmax", balance="aux_loss", zero_centered_norm=True,
                      full_attention_interval=2, partial_rotary_factor=0.5, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, indexer_heads=2,
                      indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, hc_count=4, hc_lowrank=8,
                      ple_layers=[0], heads_per_ngram=2, ngram_vocab_base=97, eos_token_id=EOS, max_seq_len=64)
    mtp = MTPConfig(num_steps=3, num_layers=1)
    torch.manual_seed(0)
    out = tmp_path / "export"
    export_hf(TandemModel(cfg, mtp), str(out), "qwen4_exp", cfg=cfg, mtp=mtp)
    reader = CheckpointReader(str(out))
    shapes = {k: tuple(reader.shape(k)) for k in reader.keys()}
    reader.close()

    proc = subprocess.run([vllm_python(), os.path.join(HERE, "vllm_qwen4_names.py"), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    remapped = json.loads(proc.stdout.strip().splitlines()[-1])["names"]
    assert set(remapped) == set(shapes)

    mtp_keys = [k for k in shapes if k.startswith("mtp.")]
    assert mtp_keys and all(remapped[k] == "model." + k[len("mtp."):] for k in mtp_keys)
    assert remapped["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert remapped["lm_head.weight"] == "lm_head.weight"
    trunk = [k for k in shapes if k.startswith("model.layers.") or k.startswith("model.hyper_connection_mixer.")]
    assert trunk and all(remapped[k] is None for k in trunk)  # the draft model loads none of the trunk

    H, C, R = cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank
    expect = {"mtp.fc_embedding.weight": (H, H), "mtp.fc_hidden.weight": (H, H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (C * H,), "mtp.hyper_connection_mixer.hc_norm.weight": (C * H,),
              "mtp.hyper_connection_mixer.input_mix_weight_down.weight": (R, C * H),
              "mtp.hyper_connection_mixer.input_mix_weight_up.weight": (C * H, R)}
    for k, shape in expect.items():
        assert shapes[k] == shape, (k, shapes[k], shape)
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in shapes  # vLLM drops it; none exported
    # the drafter's layer is a QSA + MoE + hyper-connection decoder layer, named and shaped as trunk layer 1
    layer = {k[len("mtp.layers.0."):]: s for k, s in shapes.items() if k.startswith("mtp.layers.0.")}
    qsa = {k[len("model.layers.1."):]: s for k, s in shapes.items() if k.startswith("model.layers.1.")}
    assert layer == qsa
    assert not any(k.startswith("ple.") for k in layer)  # PLE off in the drafter
