"""Bad input: a specific one-line error before expensive work, and nothing on disk lost.

Each case runs the `tandem` CLI in-process against a run directory that already holds an earlier
run (config, metrics, a checkpoint) and asserts the message and that those files are byte-identical.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tandem.data_pipeline.preprocess import preprocess
from tandem.trainer.cli import main
from tandem.trainer.loop import train
from tandem.trainer.recipe import load_config

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")


def snapshot(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == ".tandem.lock":  # names the process that last ran here
                continue
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory, tiny_base):
    """A finished 2-step run, copied fresh into each test."""
    root = tmp_path_factory.mktemp("earlier")
    train(load_config(RECIPE, tiny_base + [f"run.dir={root / 'run'}", "train.max_steps=2"]))
    return str(root / "run")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small Megatron indexed dataset with its own 300-token BPE."""
    root = tmp_path_factory.mktemp("data")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 20}) + "\n"
                            for i in range(40)))
    preprocess([str(docs)], str(root / "corpus"), vocab_size=300)
    return str(root / "corpus")


@pytest.fixture
def ctx(earlier_run, tiny_base, tmp_path, capsys):
    run = str(tmp_path / "run")
    shutil.copytree(earlier_run, run)
    base = tiny_base + [f"run.dir={run}", "train.max_steps=3"]

    class Ctx:
        before = snapshot(run)

        def fails(self, argv, message, code=2):
            rc = main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert rc == code, (rc, err)
            assert err and message in err[-1], err
            assert len(err[-1]) < 600
            assert snapshot(run) == self.before
            return err[-1]

    c = Ctx()
    c.run, c.base = run, base
    return c


# --- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("train.micro_batch_size=0", "config key 'train.micro_batch_size'=0 must be positive"),
    ("train.max_steps=-5", "config key 'train.max_steps'=-5 must be >= 0"),
    ("mtp.num_layers=0", "mtp.num_layers must be positive when mtp.num_steps=2 > 0"),
    ("mtp.loss.weights=[1.0]", "mtp.loss.weights has 1 entries but mtp.num_steps=2"),
    ("model.hidden_size=-8", "model.hidden_size must be positive"),
    ("train.lr=fast", "invalid value for config key 'train.lr'"),
    ("train.bad_step_policy=ignore", "config key 'train.bad_step_policy'='ignore'"),
    ("model.router_score=relu", "model.router_score must be 'softmax' or 'sigmoid'"),
    # a hybrid layer's choice is checked though this model has no such layer
    ("model.linear_kernel=fla2", "model.linear_kernel='fla2' must be one of auto, torch, fla"),
    ("train.typo_key=1", "unknown config key 'train.typo_key'"),
    ("train.beta1=2", "config key 'train.beta1'=2.0 must be in [0, 1)"),
    ("train.eps=-1", "config key 'train.eps'=-1.0 must be positive"),
    ("data.split=50,50,0,0", "config key 'data.split'='50,50,0,0' must be up to three"),
    ("data.stdlib_max_bytes=-1", "config key 'data.stdlib_max_bytes'=-1 must be >= 0"),
    ("model.first_k_dense=3", "model.first_k_dense must be in [0, model.num_layers=2], got 3"),
    # int(head_dim x inf) raised OverflowError, a traceback
    ("model.partial_rotary_factor=inf", "model.partial_rotary_factor=inf must give an even rotary"),
    # NaN passed `x < 0` checks: a NaN decay trained on with every step skipped as non-finite
    ("mtp.loss.decay=nan", "mtp.loss.decay must be positive and finite, got nan"),
    ("mtp.loss.acceptance_ce_weight=nan", "mtp.loss.acceptance_ce_weight=nan must be >= 0"),
    ("parallel.pp_virtual_stages=-1", "'parallel.pp_virtual_stages'=-1 must be positive"),
    # wandb refused it only once the model was built, after config.yaml was rewritten
    (f"logging.tags=[ok,{'x' * 65}]", "'logging.tags'=['ok', 'xxx"),
    ("parallel.pp_layout=[1,1]", "parallel.pp_layout=[1, 1] places pipeline stages, but "
                                 "parallel.pp=1 has one"),
    # the in-loop evaluator's decoding, refused here rather than eval.interval steps into the run
    ("eval.interval=2 eval.prompt_len=60", "the draft margin 4K+5=13 (K=2) exceed "
                                           "model.max_seq_len=64"),
    # ... and a parallel-style module asked to draft more tokens than it has heads (the run stopped
    # at its first evaluation, naming `num_steps`)
    ("eval.interval=2 mtp.style=parallel mtp.num_layers=2 eval.num_steps=3",
     "config key 'eval.num_steps'=3 (0: mtp.num_steps): num_steps=3 exceeds the 2 independent"),
])
def test_bad_config_values(ctx, override, message):
    ctx.fails(["train", RECIPE, *ctx.base, *override.split()], message)


def test_fresh_run_into_an_earlier_run(ctx):
    """Without --resume a run once started afresh here: it replaced the earlier run's config.yaml,
    truncated its metrics and wrote its checkpoints beside the earlier run's."""
    ctx.fails(["train", RECIPE, *ctx.base],
              "holds an earlier run (newest checkpoint step_2); pass --resume to continue it")


def test_fresh_run_into_an_earlier_run_without_a_complete_checkpoint(ctx):
    """An earlier run killed while saving (or one that saved none) still has a config.yaml and
    metrics a fresh start would replace."""
    os.remove(os.path.join(ctx.run, "checkpoints", "step_2", "COMPLETE"))
    ctx.before = snapshot(ctx.run)
    ctx.fails(["train", RECIPE, *ctx.base],
              "holds an earlier run (config.yaml, metrics.jsonl, checkpoints/step_2 (incomplete); "
              "no complete checkpoint); pass --resume to start it again from step 0")


def test_a_run_dir_another_process_trains_in(ctx):
    """Two runs started on one run.dir both ran: each replaced the other's metrics.jsonl and
    config.yaml. The second is refused while the first holds the directory's lock."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); f.write('pid 4242'); f.flush(); print(1, flush=True); "
         "time.sleep(60)", os.path.join(ctx.run, ".tandem.lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"1"
        ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
                  f"config key 'run.dir'={ctx.run!r} is in use by a running run (pid 4242")
    finally:
        holder.kill()
        holder.wait()


def test_an_unusable_lock_file_is_one_line(ctx):
    """Any OSError on the run directory (here its lock file is a directory) was a traceback."""
    lock = os.path.join(ctx.run, ".tandem.lock")
    os.remove(lock)
    os.mkdir(lock)
    ctx.before = snapshot(ctx.run)
    ctx.fails(["train", RECIPE, *ctx.base, "--resume"], f"Is a directory: {lock!r}")


def test_resume_at_max_steps_leaves_the_run_as_it_was(ctx, capsys):
    """A resume of a finished run with train.max_steps at its checkpoint trains nothing: it
    rewrote config.yaml with settings no step used. `--resume` may also stand between the
    overrides."""
    rc = main(["train", RECIPE, *ctx.base[:2], "--resume", *ctx.base[2:], "train.max_steps=2",
               "train.lr=0.5"])
    assert rc == 0
    assert "is at train.max_steps=2: nothing to train" in capsys.readouterr().err
    assert snapshot(ctx.run) == ctx.before


def test_unknown_recipe_path(ctx):
    ctx.fails(["train", "recipes/no_such_recipe.yaml", f"run.dir={ctx.run}"],
              "recipe file not found: recipes/no_such_recipe.yaml")


def test_recipe_with_typo(ctx, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("train:\n  max_step: 10\n")
    ctx.fails(["train", str(recipe), f"run.dir={ctx.run}"], "unknown config key 'train.max_step'")


def test_run_dir_not_writable(ctx, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    ctx.fails(["train", RECIPE, *ctx.base, f"run.dir={blocker}/run"],
              f"config key 'run.dir'='{blocker}/run' is not writable")


# --- hardware -----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_where_none_is_visible(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "device=cuda"],
              "config key 'device'='cuda' but no CUDA device is visible")


def test_npu_requested_where_none_is_visible(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "device=npu"],
              "config key 'device'='npu' but torch_npu is not installed or no NPU is visible")


def test_bf16_on_a_gpu_without_bf16(ctx, monkeypatch):
    # a V100 as torch would report it; nothing may reach the (absent) device before the refusal
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    ctx.fails(["train", RECIPE, *ctx.base, "device=cuda", "train.dtype=bf16"],
              "config key 'train.dtype'='bf16' but this cuda device (Tesla V100-SXM2-16GB) has no "
              "native bf16")


# --- data ---------------------------------------------------------------------------------------
def test_missing_dataset_prefix(ctx, tmp_path):
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron", f"data.paths=[{tmp_path}/nope]"],
              f"dataset {tmp_path}/nope: missing {tmp_path}/nope.bin")


def test_truncated_bin(ctx, dataset, tmp_path):
    for ext in (".bin", ".idx", ".tokenizer.json", ".meta.json"):
        shutil.copy(dataset + ext, str(tmp_path / "cut") + ext)
    with open(str(tmp_path / "cut.bin"), "r+b") as f:
        f.truncate(os.path.getsize(dataset + ".bin") // 2)
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron", f"data.paths=[{tmp_path}/cut]"],
              "cut.bin")


def test_idx_from_another_dtype(ctx, dataset, tmp_path):
    for ext in (".bin", ".idx", ".tokenizer.json", ".meta.json"):
        shutil.copy(dataset + ext, str(tmp_path / "mixed") + ext)
    with open(str(tmp_path / "mixed.idx"), "r+b") as f:
        f.seek(17)
        f.write(bytes([4]))  # claims int32 tokens while the .bin holds uint16
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron",
               f"data.paths=[{tmp_path}/mixed]"], "mixed")


def test_tokenizer_larger_than_model_vocab(ctx, dataset):
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron", f"data.paths=[{dataset}]",
               "model.vocab_size=200", "data.vocab_size=300"], "larger than model.vocab_size=200")


def test_token_ids_past_the_model_vocabulary_without_meta_json(ctx, dataset, tmp_path):
    """Data made without Tandem's meta.json (Megatron-LM's own preprocessing) is not checked
    against the tokenizer at start-up; a token id past model.vocab_size stops the run in one line
    naming the data before the first forward (an index error inside the embedding before; a
    device-side assert on a GPU)."""
    for ext in (".bin", ".idx"):
        shutil.copy(dataset + ext, str(tmp_path / "bare") + ext)
    docs = tmp_path / "small.jsonl"
    docs.write_text(json.dumps({"text": "x = 1\n" * 50}) + "\n")
    preprocess([str(docs)], str(tmp_path / "small"), vocab_size=260)
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron",
               f"data.paths=[{tmp_path}/bare]", f"data.tokenizer={tmp_path}/small.tokenizer.json",
               "data.vocab_size=260", "model.vocab_size=260", "data.split=100,0,0",
               f"run.dir={tmp_path}/fresh"],
              f"data.paths=['{tmp_path}/bare']: sample 0.. holds token id")


def test_split_that_leaves_a_split_no_sequences(ctx, dataset):
    """megatron-core would count epochs of zero tokens forever (the run hung, printing nothing)."""
    ctx.fails(["train", RECIPE, *ctx.base, "data.source=megatron", f"data.paths=[{dataset}]",
               "data.vocab_size=300", "data.split=99.9,0.1,0"],
              "config key 'data.split'='99.9,0.1,0' gives the validation split none of the 40 "
              "sequences")


def test_resume_below_the_checkpoint_step(ctx):
    """A resume whose train.max_steps is below its checkpoint's step trained nothing, exited 0 and
    rewrote config.yaml with the lower max_steps."""
    ctx.fails(["train", RECIPE, *ctx.base, "train.max_steps=1", "--resume"],
              "config key 'train.max_steps'=1 is below the step of the checkpoint to resume")


LAUNCH_1 = ["--nodes", "1", "--procs-per-node", "1"]


def test_launch_resume_below_the_checkpoint_step(ctx):
    """The job's `tandem train --resume` would stop at once: refused before sbatch."""
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, "train.max_steps=1", *LAUNCH_1],
              "config key 'train.max_steps'=1 is below the step of the checkpoint to resume")


def test_launch_into_an_earlier_run_without_a_complete_checkpoint(ctx):
    """`tandem train` refuses this directory without --resume, but the job always passes --resume,
    which started the earlier run again from step 0 over its config.yaml and metrics."""
    os.remove(os.path.join(ctx.run, "checkpoints", "step_2", "COMPLETE"))
    ctx.before = snapshot(ctx.run)
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, "model.hidden_size=64", *LAUNCH_1],
              "holds an earlier run (config.yaml, metrics.jsonl, checkpoints/step_2 (incomplete); "
              "no complete checkpoint) that no launch of this recipe and overrides started")


def test_checks_before_the_corpus_is_prepared(ctx, dataset, tmp_path):
    """A resume into another model shape, and a tokenizer that does not fit, fail before the
    embedded corpus is prepared into a fresh cache."""
    cache = tmp_path / "fresh_cache"
    ctx.fails(["train", RECIPE, *ctx.base, f"data.cache_dir={cache}", "model.hidden_size=48",
               "--resume"], "has a different model shape")
    ctx.fails(["train", RECIPE, *ctx.base, f"data.cache_dir={cache}",
               f"data.tokenizer={dataset}.tokenizer.json", "model.vocab_size=280",
               "data.vocab_size=280"], "has vocab_size=300, larger than model.vocab_size=280")
    assert not cache.exists()


def test_preprocess_refuses_to_overwrite(dataset, capsys):
    before = snapshot(os.path.dirname(dataset))
    with pytest.raises(SystemExit) as exit_:
        main(["preprocess", "--input", dataset + ".meta.json", "--output-prefix", dataset])
    assert exit_.value.code == 2  # as every other command's bad input
    assert "already exists" in capsys.readouterr().err
    assert snapshot(os.path.dirname(dataset)) == before


def test_preprocess_missing_input(tmp_path, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        main(["preprocess", "--input", str(tmp_path / "absent.jsonl"), "--output-prefix",
              str(tmp_path / "out")])
    assert "absent.jsonl" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# --- checkpoints --------------------------------------------------------------------------------
def test_resume_with_different_model_shape(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "model.hidden_size=48", "--resume"],
              "has a different model shape: model.hidden_size: checkpoint 32 vs config 48")


def test_resume_with_other_training_coefficients(ctx, capsys):
    """model.* keys that set training, not the weights' layout, may change on a resume: it refused
    them as 'a different model shape'."""
    assert main(["train", RECIPE, *ctx.base, "model.bias_update_rate=0.002",
                 "model.z_loss_coef=0.001", "model.max_seq_len=96", "--resume"]) == 0, (
        capsys.readouterr().err)


def test_init_from_leaves_the_stage_settings_a_run_sets(ctx, tmp_path, capsys):
    """model.init_from gives the run the checkpoint's model fields, but a later stage may set the
    RoPE base, a YaRN stretch (DeepSeek-V3's 4K -> 128K) and QSA's budget itself (a long-context
    stage): an override of any was reverted to the checkpoint's silently. A weight shape is still
    the checkpoint's."""
    ckpt = os.path.join(ctx.run, "checkpoints", "step_2")
    stage2 = str(tmp_path / "stage2")
    stage = ["model.rope_theta=123456.0", "model.indexer_budget=96", "model.hidden_size=48",
             "model.rope_scaling=yarn", "model.rope_factor=4.0", "model.rope_original_max_len=16"]
    argv = ["train", RECIPE, *ctx.base, f"run.dir={stage2}", f"model.init_from={ctx.run}", *stage]
    assert main(argv) == 0, capsys.readouterr().err
    assert "model.rope_theta: 123456.0 as set (the checkpoint's " in capsys.readouterr().err
    saved = load_config(os.path.join(stage2, "config.yaml")).model
    assert (saved.rope_theta, saved.indexer_budget, saved.hidden_size) == (123456.0, 96, 32)
    assert (saved.rope_scaling, saved.rope_factor, saved.rope_original_max_len) == ("yarn", 4.0,
                                                                                   16)
    assert saved.init_from == ckpt
    # from a Hugging Face export too: its loader refused the settings as "a different model shape"
    hf = str(tmp_path / "hf")
    assert main(["export", "--checkpoint", ctx.run, "--out", hf]) == 0
    stage3 = str(tmp_path / "stage3")
    assert main(["train", RECIPE, *ctx.base, f"run.dir={stage3}", f"model.init_from={hf}",
                 *stage]) == 0, capsys.readouterr().err
    assert load_config(os.path.join(stage3, "config.yaml")).model.rope_factor == 4.0
    # a frozen trunk (MTP fine-tuning) runs as it was trained: its RoPE is not a stage's to change
    ctx.fails(["train", RECIPE, *ctx.base, f"run.dir={tmp_path / 'stage4'}",
               f"model.init_from={hf}", "train.freeze_trunk=true", "model.rope_factor=4.0",
               "model.rope_scaling=yarn"],
              "model.rope_scaling='yarn' differs from the frozen trunk's 'none'")


def test_resume_with_different_mtp_depth(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "mtp.num_steps=3", "--resume"],
              "mtp.num_steps: checkpoint 2 vs config 3")


def test_resume_into_a_different_tokenizer(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "data.vocab_size=400", "--resume"],
              "was trained with a different tokenizer: data.vocab_size: checkpoint 512 vs config "
              "400")


def _recorded_tokenizer(ctx) -> dict:
    """The run's tokenizer.json, as its checkpoint recorded it."""
    with open(os.path.join(ctx.run, "checkpoints", "step_2", "tokenizer.json")) as f:
        return json.load(f)


def _tokenizer_copy(ctx, dest, swap=False):
    """The run's tokenizer (its checkpoint's copy) at another path; `swap`: two ids exchanged."""
    data = _recorded_tokenizer(ctx)
    if swap:
        vocab = data["model"]["vocab"]
        a, b = list(vocab)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data))
    return str(dest)


def test_resume_reads_the_same_tokenizer_at_another_path(ctx, tmp_path, capsys):
    """A fine-tune whose source step was pruned reads the same tokenizer from a newer step: the
    checkpoint's recorded copy decides, not the path."""
    same = _tokenizer_copy(ctx, tmp_path / "elsewhere" / "tokenizer.json")
    assert main(["train", RECIPE, *ctx.base, f"data.tokenizer={same}", "--resume"]) == 0, \
        capsys.readouterr().err
    other = _tokenizer_copy(ctx, tmp_path / "other" / "tokenizer.json", swap=True)
    ctx.before = snapshot(ctx.run)
    ctx.fails(["train", RECIPE, *ctx.base, "train.max_steps=4", f"data.tokenizer={other}",
               "--resume"], "was trained with a different tokenizer: data.tokenizer: ")


def test_resume_onto_a_tokenizer_rewritten_in_place(ctx, tmp_path, capsys):
    tok = _tokenizer_copy(ctx, tmp_path / "tok" / "tokenizer.json")
    run = [*ctx.base, f"run.dir={tmp_path / 'own'}", f"data.tokenizer={tok}"]
    assert main(["train", RECIPE, *run, "train.max_steps=1"]) == 0, capsys.readouterr().err
    _tokenizer_copy(ctx, tmp_path / "tok" / "tokenizer.json", swap=True)
    ctx.fails(["train", RECIPE, *run, "--resume"],
              f"data.tokenizer: {tok} no longer holds the tokenizer the checkpoint recorded")


def test_resume_onto_the_same_ids_with_another_end_of_document(ctx, tmp_path, capsys):
    """The same tokenizer.json read bare, without the tokenizer_config.json that made
    `<|im_end|>` its end-of-document token: other documents, so another tokenizer."""
    data = _recorded_tokenizer(ctx)
    vocab = data["model"]["vocab"]
    last = max(vocab, key=vocab.get)  # its id becomes <|im_end|>'s
    vocab["<|im_end|>"] = vocab.pop(last)
    data["model"]["merges"] = [m for m in data["model"]["merges"]
                               if "".join(m.split(" ") if isinstance(m, str) else m) != last]
    data["added_tokens"].append({"id": vocab["<|im_end|>"], "content": "<|im_end|>",
                                 "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": True})
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps(data))
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    run = [*ctx.base, f"run.dir={tmp_path / 'own'}"]
    assert main(["train", RECIPE, *run, f"data.tokenizer={tok}", "train.max_steps=1"]) == 0, \
        capsys.readouterr().err
    ctx.fails(["train", RECIPE, *run, f"data.tokenizer={tok / 'tokenizer.json'}", "--resume"],
              "was trained with a different tokenizer: data.tokenizer: ")


def test_resume_at_another_window(ctx):
    """A resume at another data.seq_len read the saved count of samples as windows of the new
    length: other tokens, in another order, and consumed_tokens mixing the two lengths. A window
    past the checkpoint's max_seq_len, which a longer window needs raised, gets the same answer."""
    ckpt = os.path.join(ctx.run, "checkpoints", "step_2")
    ctx.fails(["train", RECIPE, *ctx.base, "data.seq_len=96", "model.max_seq_len=128", "--resume"],
              f"checkpoint {ckpt} was trained at another window (data.seq_len: checkpoint 32 vs "
              "config 96): its sample stream does not continue at another data.seq_len; start a "
              f"new stage from it with model.init_from={ckpt} in another run.dir")


def test_resume_from_corrupt_checkpoint(ctx):
    ckpt = os.path.join(ctx.run, "checkpoints", "step_2")
    shard = next(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
    os.remove(os.path.join(ckpt, shard))
    ctx.before = snapshot(ctx.run)
    ctx.fails(["train", RECIPE, *ctx.base, "--resume"],
              "checkpoints/step_2 is unreadable or corrupt")


# --- CLI ----------------------------------------------------------------------------------------
def test_unknown_command(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_override_without_equals(ctx):
    ctx.fails(["train", RECIPE, *ctx.base, "train.max_steps"],
              "override 'train.max_steps' is not of the form key=value")


def test_launch_needs_slurm_word(capsys):
    assert main(["launch", "kubernetes"]) == 2
    assert "usage: tandem launch slurm" in capsys.readouterr().err


# --- fine-tuning from a checkpoint (issue 11: model.init_from shards, tokenizer) ------------------
@pytest.fixture(scope="module")
def sharded_export(earlier_run, tmp_path_factory):
    """The earlier run exported as a sharded Hugging Face checkpoint (index + several files +
    tokenizer)."""
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    assert main(["export", "--checkpoint", earlier_run, "--out", out, "--max-shard-mb",
                 "0.05"]) == 0
    return out


def _shards(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_init_from_missing_shard(ctx, sharded_export, tmp_path):
    hf = str(tmp_path / "hf")
    shutil.copytree(sharded_export, hf)
    assert len(_shards(hf)) > 1
    os.remove(os.path.join(hf, _shards(hf)[1]))
    line = ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={hf}"], "is missing (named by")
    assert os.path.join(hf, _shards(sharded_export)[1]) in line


def test_init_from_partial_shard(ctx, sharded_export, tmp_path):
    hf = str(tmp_path / "hf")
    shutil.copytree(sharded_export, hf)
    shard = os.path.join(hf, _shards(hf)[0])
    os.truncate(shard, os.path.getsize(shard) - 100)
    ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={hf}"],
              f"checkpoint shard {shard} is partial")


def test_init_from_shard_without_a_tensor_its_index_maps_to_it(ctx, sharded_export, tmp_path):
    """A shard of another revision (or a partial copy) that lacks a tensor the index names: a
    KeyError traceback naming only the tensor, after the data was built and the model allocated."""
    from safetensors.torch import load_file, save_file

    hf = str(tmp_path / "hf")
    shutil.copytree(sharded_export, hf)
    shard = os.path.join(hf, _shards(hf)[-1])
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, shard)
    line = ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={hf}"],
                     "maps 1 tensor(s) to shards that do not hold them")
    assert dropped in line and os.path.basename(shard) in line


def test_init_from_index_naming_a_shard_outside_its_directory(ctx, sharded_export, tmp_path):
    """An index may name only files in its directory: `../elsewhere/x.safetensors` loaded weights
    from wherever it pointed on the machine."""
    hf, elsewhere = str(tmp_path / "hf"), tmp_path / "elsewhere"
    shutil.copytree(sharded_export, hf)
    elsewhere.mkdir()
    shard = _shards(hf)[-1]
    shutil.move(os.path.join(hf, shard), elsewhere / shard)
    index = os.path.join(hf, "model.safetensors.index.json")
    mapping = json.load(open(index))
    mapping["weight_map"] = {k: f"../elsewhere/{v}" if v == shard else v
                             for k, v in mapping["weight_map"].items()}
    json.dump(mapping, open(index, "w"))
    ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={hf}"],
              f"{index} maps a tensor to '../elsewhere/{shard}', which is not a file name in its "
              "directory")


@pytest.mark.parametrize("field, value", [("rms_norm_eps", "abc"), ("num_hidden_layers", "4"),
                                          ("hidden_size", True)])
def test_init_from_config_json_with_a_number_written_as_text(ctx, sharded_export, tmp_path,
                                                             field, value):
    """`"rms_norm_eps": "abc"` stopped with "could not convert string to float: 'abc'", naming
    neither file nor key; `"num_hidden_layers": "4"` loaded as if a number."""
    hf = str(tmp_path / "hf")
    shutil.copytree(sharded_export, hf)
    config = os.path.join(hf, "config.json")
    fields = json.load(open(config))
    fields[field] = value
    json.dump(fields, open(config, "w"))
    ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={hf}"],
              f"{config}: {field}={json.dumps(value)} must be a number")


def _without_tensor(export, out, pick):
    """A copy of the sharded export without the first tensor `pick` accepts (index and shard)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    index_file = os.path.join(out, "model.safetensors.index.json")
    index = json.load(open(index_file))
    name = sorted(k for k in index["weight_map"] if pick(k))[0]
    shard = os.path.join(out, index["weight_map"].pop(name))
    save_file({k: v for k, v in load_file(shard).items() if k != name}, shard)
    json.dump(index, open(index_file, "w"))
    return name


@pytest.mark.parametrize("key", ["model.init_from", "mtp.init_from"])
def test_init_from_without_a_tensor_fails_before_the_data_and_the_model(ctx, sharded_export,
                                                                        tmp_path, monkeypatch,
                                                                        key):
    """A checkpoint that lacks one tensor was refused only once the data was built (every record
    tokenised) and the model allocated: minutes into a real fine-tune."""
    from tandem.trainer import run as run_module

    hf = str(tmp_path / "hf")
    trunk = key == "model.init_from"  # a trunk tensor; else one of the MTP layer's (layer 2)
    name = _without_tensor(sharded_export, hf, lambda k: "layers.0." in k if trunk
                           else ("mtp" in k or "layers.2." in k))

    def built(*args, **kwargs):
        raise AssertionError("the data was built before the checkpoint was checked")

    monkeypatch.setattr(run_module, "build_datasets", built)
    line = ctx.fails(["train", RECIPE, *ctx.base, f"{key}={hf}"], "missing tensors (1)")
    assert name in line and (key == "model.init_from" or f"'{key}'" in line)


def test_finetune_with_another_tokenizer_than_the_checkpoint(ctx, sharded_export, dataset):
    other = dataset + ".tokenizer.json"
    line = ctx.fails(["train", RECIPE, *ctx.base, f"model.init_from={sharded_export}",
                      f"data.tokenizer={other}"],
                     "tokenizer mismatch: data.tokenizer=")
    assert other in line and sharded_export in line and "data.force_tokenizer=true" in line


# --- evaluation inputs (issue 14: --prompts texts, eval.temperatures) -----------------------------
def _prompts_file(tmp_path, texts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n")
    return str(path)


def test_eval_prompts_empty_text(ctx, tmp_path):
    path = _prompts_file(tmp_path, ["def f():\n", "import os\n", ""])
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", path], f"{path}:3: empty prompt text")


def test_eval_prompts_not_json(ctx, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n\n" + "text: b\n")
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", str(path)],
              f"{path}:3: not a JSON object")


def test_eval_prompts_too_long(ctx, tmp_path):
    # tiny_base: model.max_seq_len=64, K=2: with 8 new tokens a prompt fits in 64 - 8 - 13 = 43
    # tokens
    path = _prompts_file(tmp_path, ["x = 1\n", "x = 1\n" * 40])
    line = ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", path, "--max-new-tokens", "8"],
                     f"{path}:2: prompt is ")
    assert "1 to 43 fit" in line and "model.max_seq_len=64" in line


def test_eval_with_no_room_for_a_prompt(ctx, tmp_path):
    """64 - 51 new tokens - 13 leaves 0 prompt tokens: one line, before any prompt is read (a
    suite's prompts were cut to row[-0:], their whole text, and the run died in an IndexError)."""
    for source in (["--suite", "humaneval"], ["--prompts", _prompts_file(tmp_path, ["x = 1\n"])]):
        line = ctx.fails(["eval", "--checkpoint", ctx.run, *source, "--max-new-tokens", "51"],
                         "no room for a prompt: ")
        assert "= 0 tokens" in line


@pytest.mark.parametrize("value", ["[0]", "[0.7,2.5]"])
def test_eval_temperatures_outside_range(ctx, value):
    ctx.fails(["train", RECIPE, *ctx.base, f"eval.temperatures={value}"],
              "config key "
              f"'eval.temperatures'={[float(v) for v in value.strip('[]').split(',')]!r} must each "
              "be in "
              "(0, 2]")


@pytest.mark.parametrize("size", ["-5", "inf"])
def test_export_refuses_a_negative_or_infinite_shard_size(tmp_path, capsys, size):
    """A negative --max-shard-mb once wrote one file per tensor (156 for the tiny model), an
    infinite one stopped in a traceback; both fail before the checkpoint is read (the one named
    here does not exist) and write nothing."""
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tmp_path / "missing"), "--out", str(out),
                 "--max-shard-mb", size]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tandem export: error: --max-shard-mb {float(size)} must be a finite number "
                   ">= 0 (0: one file)")
    assert not out.exists()
