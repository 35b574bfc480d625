"""MTP fine-tuning with a frozen trunk, as users run it: the run takes the checkpoint's tokenizer,
its checkpoints hold only the MTP module (+ optimizer) and a fingerprinted reference to
`model.init_from`, resume / `tandem eval` / `tandem export` reassemble the model from both, and a
changed or vanished reference (or another tokenizer) is refused in one line naming the path, with
nothing written."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def common(cache):
    return ["data.stdlib_max_bytes=200000", "data.vocab_size=512", "data.seq_len=32",
            f"data.cache_dir={cache}",
            "train.dtype=fp32", "logging.wandb=false", "logging.progress=false",
            "train.micro_batch_size=2", "eval.interval=0"]


def listing(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(path) for f in fs)


def test_frozen_trunk_checkpoints_reference_the_trunk(tmp_path, capsys, corpus_cache):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    from tandem.trainer.cli import main as cli
    from tandem.trainer.eval_cli import eval_main

    tmp = str(tmp_path)
    pre = ["mtp.num_steps=0", "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=2",
           "model.num_heads=2",
           "model.num_kv_heads=2", "model.intermediate_size=64", "model.moe_intermediate_size=16",
           "model.num_experts=4",
           "model.max_seq_len=64", "train.max_steps=2", f"run.dir={tmp}/pre"] + common(corpus_cache)
    assert cli(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), *pre]) == 0
    assert cli(["export", "--checkpoint", f"{tmp}/pre", "--out", f"{tmp}/hf"]) == 0
    hf_tok = os.path.join(tmp, "hf", "tokenizer.json")
    assert os.path.isfile(hf_tok)
    # a run from scratch names its end of document as the model's EOS, where transformers and vLLM
    # look for it (they took the family's default, an ordinary token, and never stopped there)
    from transformers import AutoConfig, AutoTokenizer

    eod = AutoTokenizer.from_pretrained(f"{tmp}/hf").convert_tokens_to_ids("<|endoftext|>")
    assert AutoConfig.from_pretrained(f"{tmp}/hf").eos_token_id == eod
    assert AutoTokenizer.from_pretrained(f"{tmp}/hf").eos_token_id == eod
    # as a chat model's source lists its end-of-turn ids beside its EOS
    with open(f"{tmp}/hf/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [eod, 5]}, f)

    recipe = os.path.join(ROOT, "recipes", "finetune_mtp.yaml")
    ft = [f"model.init_from={tmp}/hf", "train.max_steps=2", "checkpoint.interval=1",
          "mtp.num_steps=2"] + common(corpus_cache)
    assert cli(["train", recipe, *ft, f"run.dir={tmp}/a"]) == 0
    step = os.path.join(tmp, "a", "checkpoints", "step_2")
    ref = json.load(open(os.path.join(step, "frozen_trunk.json")))
    assert ref["path"] == os.path.abspath(f"{tmp}/hf") and len(ref["fingerprint"]) == 64
    saved = [k for k in dcp.FileSystemReader(step).read_metadata().state_dict_metadata
             if k.startswith("model.")]
    # the trunk is not in the checkpoint
    assert saved and all(k.startswith("model.mtp.") for k in saved)
    # the checkpoint's tokenizer
    assert open(os.path.join(step, "tokenizer.json")).read() == open(hf_tok).read()

    # resume from step 1 reassembles trunk + MTP + optimizer: step 2 equals the uninterrupted run's
    shutil.copytree(f"{tmp}/a", f"{tmp}/b")
    shutil.rmtree(f"{tmp}/b/checkpoints/step_2")
    open(f"{tmp}/b/metrics.jsonl", "w").writelines(open(f"{tmp}/a/metrics.jsonl").readlines()[:1])
    assert cli(["train", recipe, *ft, f"run.dir={tmp}/b", "--resume"]) == 0
    last = [json.loads(line) for line in open(f"{tmp}/a/metrics.jsonl")][-1]
    again = [json.loads(line) for line in open(f"{tmp}/b/metrics.jsonl")][-1]
    assert again["step"] == 2 and again["loss/mtp_1"] == last["loss/mtp_1"]

    # model.init_from the fine-tune itself: its trunk from the checkpoint it references, its MTP
    # module from its own ("lacks trunk tensors" before), as tandem eval reassembles it
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.hf.init_from import load_initial_weights

    whole, saved_cfg = load_model_from_checkpoint(f"{tmp}/a")
    # the source it records, where tandem eval reads the model's stop ids (it was blanked: eval ran
    # past the end-of-turn ids tandem generate stops at)
    assert saved_cfg.model.init_from == os.path.abspath(f"{tmp}/hf")
    fresh = copy.deepcopy(whole)
    for p in fresh.parameters():
        p.data.zero_()
    load_initial_weights(fresh, f"{tmp}/a")
    assert all(torch.equal(p, whole.state_dict()[n]) for n, p in fresh.state_dict().items()
               if "tokens_per_expert" not in n)

    # a trunk named by its run directory, which saves a newer checkpoint meanwhile: the resume
    # reads the step the fine-tune started from (the newest one's tokenizer path read as another
    # tokenizer, and the frozen trunk as changed)
    from_run = ft[1:] + [f"model.init_from={tmp}/pre", f"run.dir={tmp}/from_run"]
    assert cli(["train", recipe, *from_run, "train.max_steps=1"]) == 0
    shutil.copytree(f"{tmp}/pre/checkpoints/step_2", f"{tmp}/pre/checkpoints/step_3")
    assert cli(["train", recipe, *from_run, "--resume"]) == 0
    ref = json.load(open(f"{tmp}/from_run/checkpoints/step_2/frozen_trunk.json"))
    assert ref["path"] == os.path.abspath(f"{tmp}/pre/checkpoints/step_2")
    shutil.rmtree(f"{tmp}/pre/checkpoints/step_3")

    # an unfrozen fine-tune resumed frozen: refused, nothing written (its trained trunk loaded, and
    # every later checkpoint recorded its MTP module on model.init_from's untrained trunk)
    unfrozen = ft + [f"run.dir={tmp}/unfrozen"]
    assert cli(["train", recipe, *unfrozen, "train.freeze_trunk=false", "train.max_steps=1"]) == 0
    before = listing(f"{tmp}/unfrozen")
    capsys.readouterr()
    assert cli(["train", recipe, *unfrozen, "train.freeze_trunk=true", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds its own trained trunk" in err and "train.freeze_trunk=false" in err, err
    assert listing(f"{tmp}/unfrozen") == before

    # export = the HF trunk (bit-identical) + the trained MTP module
    assert cli(["export", "--checkpoint", f"{tmp}/a", "--out", f"{tmp}/out"]) == 0
    trunk, out = load_file(f"{tmp}/hf/model.safetensors"), load_file(f"{tmp}/out/model.safetensors")
    assert all(torch.equal(v, out[k]) for k, v in trunk.items())
    assert len(out) > len(trunk)
    # ... served up to the trunk's own context (64), not the fine-tune's model.max_seq_len (4096,
    # the default), which claimed positions the trunk never had
    served = json.load(open(f"{tmp}/out/config.json"))["max_position_embeddings"]
    assert served == json.load(open(f"{tmp}/hf/config.json"))["max_position_embeddings"] == 64

    # a fine-tune of the fine-tune (model.init_from=a, frozen again): its trunk two references
    # away, which export looked for one away ("lacks tensors"), and its source's serving files (the
    # end-of-turn ids), which generate, eval and export read from the first model.init_from only
    from tandem.trainer.hf.importer import load_hf_model

    assert cli(["train", recipe, *ft, f"model.init_from={tmp}/a", "train.max_steps=1",
                f"run.dir={tmp}/chain"]) == 0
    assert cli(["export", "--checkpoint", f"{tmp}/chain", "--out", f"{tmp}/out_chain"]) == 0
    chained = load_file(f"{tmp}/out_chain/model.safetensors")
    assert all(torch.equal(v, chained[k]) for k, v in trunk.items())
    exported, own = load_hf_model(f"{tmp}/out_chain")[0], load_model_from_checkpoint(
        f"{tmp}/chain")[0]
    assert all(torch.equal(p, exported.state_dict()[n]) for n, p in own.state_dict().items()
               if "tokens_per_expert" not in n)
    with open(f"{tmp}/out_chain/generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == [eod, 5]
    with open(f"{tmp}/prompts.jsonl", "w") as f:
        f.write(json.dumps({"text": "def main():"}) + "\n")
    assert cli(["generate", "--checkpoint", f"{tmp}/chain", "--prompts", f"{tmp}/prompts.jsonl",
                "--out", f"{tmp}/gen.jsonl", "--max-new-tokens", "4"]) == 0
    with open(f"{tmp}/gen.jsonl.meta.json") as f:
        assert json.load(f)["eos_id"] == [eod, 5]
    capsys.readouterr()
    assert eval_main(["--checkpoint", f"{tmp}/a", "--num-prompts", "2", "--prompt-len", "8",
                      "--max-new-tokens", "4"]) == 0
    assert "acceptance_length" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # a changed trunk: refused by resume, eval and export in one line naming it; nothing written
    trunk["model.norm.weight"] = trunk["model.norm.weight"] * 2
    save_file(trunk, f"{tmp}/hf/model.safetensors", metadata={"format": "pt"})
    before = listing(f"{tmp}/a")
    capsys.readouterr()
    assert cli(["train", recipe, *ft, "train.max_steps=3", f"run.dir={tmp}/a", "--resume"]) == 2
    assert eval_main(["--checkpoint", f"{tmp}/a"]) == 2
    assert cli(["export", "--checkpoint", f"{tmp}/a", "--out", f"{tmp}/out2"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 3 and all(os.path.abspath(f"{tmp}/hf") in e and "changed" in e
                                    for e in errors), errors
    assert listing(f"{tmp}/a") == before and not os.path.exists(f"{tmp}/out2")
    os.rename(f"{tmp}/hf", f"{tmp}/hf_moved")
    assert eval_main(["--checkpoint", f"{tmp}/a"]) == 2
    assert "is gone" in capsys.readouterr().err
    os.rename(f"{tmp}/hf_moved", f"{tmp}/hf")

    # another tokenizer than the checkpoint's: refused naming both, unless forced
    from tandem.data_pipeline.tokenizer import train_bpe

    other = os.path.join(tmp, "other.json")
    train_bpe(["def f(x):\n    return x + 1\n" * 50, "import os\nprint(os.getcwd())\n" * 50], 300,
              other)
    capsys.readouterr()
    assert cli(["train", recipe, *ft, f"run.dir={tmp}/c", f"data.tokenizer={other}"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer mismatch" in err and other in err and hf_tok.rsplit("/", 1)[0] in err
    assert not os.path.exists(f"{tmp}/c/config.yaml")
