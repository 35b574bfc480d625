"""`tandem export` streams a checkpoint tensor by tensor; its output equals the in-memory export of
the loaded model (same names, values and dtype), in one file or in shards."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.models import TandemModel
from tandem.trainer.checkpoint import load_model_from_checkpoint, save_checkpoint
from tandem.trainer.hf.export import export_hf, export_main
from tandem.trainer.recipe import load_config, to_yaml

SHAPE = ["model.vocab_size=512", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2",
         "model.intermediate_size=64", "model.moe_intermediate_size=16", "model.num_experts=4",
         "model.first_k_dense=1",
         "model.num_shared_experts=1", "mtp.num_steps=2", "mtp.num_layers=1",
         "mtp.trunk_input=final_norm", "data.vocab_size=512", "data.seq_len=32"]


def _read(out):
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    state = {}
    for f in files:
        state.update(load_file(os.path.join(out, f)))
    return state, files


@pytest.mark.parametrize("dtype,shard_mb", [(torch.float32, 0), (torch.bfloat16, 0.02)])
def test_streamed_export_equals_in_memory_export(tmp_path, dtype, shard_mb):
    # a cache of its own: the export looks for the run's stdlib tokenizer there, and a machine's
    # default cache holding one (from any earlier run) added its EOS to one side only
    cfg = load_config(None, SHAPE + [f"run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/c"])
    torch.manual_seed(0)
    model = TandemModel(cfg.model, cfg.mtp).to(dtype)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
    save_checkpoint(str(tmp_path / "run"), 1, model, None, to_yaml(cfg), {})
    args = ["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "streamed"), "--family",
            "glm4_moe"]
    assert export_main(args + (["--max-shard-mb", str(shard_mb)] if shard_mb else [])) == 0
    loaded, _ = load_model_from_checkpoint(str(tmp_path / "run"))
    export_hf(loaded.to(dtype), str(tmp_path / "memory"), "glm4_moe")
    got, files = _read(tmp_path / "streamed")
    want, _ = _read(tmp_path / "memory")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == dtype and torch.equal(got[k], want[k].to(dtype)), k
    assert (len(files) > 1) == bool(shard_mb)
    with open(tmp_path / "streamed" / "config.json") as f:
        config = json.load(f)
    assert config == json.load(open(tmp_path / "memory" / "config.json"))
    # the tensors' dtype, which transformers (and vLLM) load at by default: it said float32
    # whatever was written, and a bf16 export loaded at twice its memory
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    # the looped module's one layer drafts K=2: a re-import drafts 2 as well (it took K = its
    # layers, so `tandem eval --hf` and `tandem generate --hf` drafted 1)
    from tandem.trainer.hf.importer import load_hf_model

    assert config["tandem_mtp_num_steps"] == 2 and config["num_nextn_predict_layers"] == 1
    again = load_hf_model(str(tmp_path / "streamed"))[1]
    assert (again.mtp.num_steps, again.mtp.num_layers) == (2, 1)
    if dtype == torch.bfloat16:
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "streamed")).dtype == dtype


@pytest.mark.parametrize("trunk_input", ["pre_norm", "final_norm"])
def test_a_pre_norm_drafter_exported_for_vllm_is_said(tmp_path, capsys, trunk_input):
    """vLLM's GLM-4.5 / DeepSeek-V3 proposer hands the drafter the trunk's normed output: an
    export of a pre_norm module (the default job's) loaded there without a word."""
    cfg = load_config(None, SHAPE + [f"run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/c",
                                     f"mtp.trunk_input={trunk_input}"])
    save_checkpoint(str(tmp_path / "run"), 1, TandemModel(cfg.model, cfg.mtp), None, to_yaml(cfg),
                    {})
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                        "--family", "glm4_moe"]) == 0
    said = "note: its MTP module reads the trunk's pre-norm state" in capsys.readouterr().err
    assert said == (trunk_input == "pre_norm")
