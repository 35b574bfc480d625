"""A DeepSeek-V3 checkpoint (MLA, one MTP layer at `model.layers.{N}`) exported by Tandem is served
by vLLM's CPU build (`DeepseekV3ForCausalLM` with its `DeepSeekMTP` proposer, K=3 drafts from the
one layer) with the tokens and the spec-decode counters of Tandem's own decoder under the `serving`
convention: the drafts, the accepted tokens and the accepted per position, exactly (slow: vLLM's
venv, as test_vllm_serving.py).

The model is built here, not trained: its drafts are made to agree partly with the trunk
(tests/eval_helpers.make_agreeing), so acceptance is neither 0 nor all. vLLM's CPU MLA kernels take
bf16 weights only (`convert_weight_packed`), so vLLM runs the export in bf16 while Tandem decodes in
fp32 and in bf16; the tokens and counts must agree with both (the drafts' margins are far above
bf16's rounding here)."""

import json
import os
import subprocess

import pytest
import torch

from tandem.eval.spec_decode import generate
from tandem.models import TandemModel
from tandem.models.config import ModelConfig
from tandem.models.mtp_config import MTPConfig
from tandem.trainer.hf.export import export_hf
from tests.e2e.test_vllm_serving import DRIVER, vllm_python
from tests.eval_helpers import make_agreeing

K, MAX_NEW = 3, 24
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [30, 31, 32, 33, 34, 35, 36, 37]]
# vLLM's CPU MLA wants DeepSeek-V3's own per-head widths (nope 128, rope 64, v 128) and a latent of
# 512; the rest is tiny
MLA = dict(kv_lora_rank=512, q_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128)


def _has_bf16_cpu() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.mark.slow
@pytest.mark.skipif(not _has_bf16_cpu(), reason="vLLM's CPU MLA kernels need bf16 instructions "
                                                "(avx512_bf16 / amx_bf16)")
def test_vllm_serves_an_exported_deepseek_v3_with_the_same_tokens_and_acceptance(tmp_path):
    py = vllm_python()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=4, top_k=2,
                      num_shared_experts=1, first_k_dense=1, routed_scaling_factor=1.5,
                      max_seq_len=256, **MLA)
    # vLLM's proposer reads the trunk's normed output
    model = TandemModel(cfg, MTPConfig(num_steps=K, num_layers=1, trunk_input="final_norm"))
    make_agreeing(model.eval(), 0.05, seed=1)
    hf = str(tmp_path / "hf")
    assert export_hf(model, hf) == "deepseek_v3"

    ours = []
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            out = generate(model.to(dtype), PROMPTS, MAX_NEW, K, draft_convention="serving")
        s = out.stats
        ours.append((out.outputs, [int(s.rounds.sum()), int(s.accepted_all.sum())]
                     + s.accepted_all_at.sum(0).tolist()))
    assert ours[0] == ours[1], ours

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([py, DRIVER, hf, str(prompts), "--k", str(K), "--max-tokens",
                           str(MAX_NEW), "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=600, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")]
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads(line[-1][len("VLLM_RESULT "):])
    vm = got["metrics"]
    served = [vm["num_drafts"], vm["num_accepted_tokens"]] + vm["accepted_per_pos"]
    print(json.dumps({"vllm": served, "tandem": ours[0][1],
                      "acceptance_length": round(1 + served[1] / served[0], 4)}))
    assert got["outputs"] == ours[0][0]
    assert served == ours[0][1] and 0 < served[1] < K * served[0]
