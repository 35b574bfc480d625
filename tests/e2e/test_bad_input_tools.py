"""Bad input to the tools around training (eval, generate, report, launch slurm): a one-line error
naming the flag, file or key, before the checkpoint is read or a job submitted, and nothing on disk
changed. The cases run the `tandem` CLI in-process against a copy of one tiny 2-step run
(test_bad_input.py's fixtures)."""

import fcntl
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tandem.models import flavors
from tandem.trainer import eval_cli, launch_checks
from tandem.trainer import generate as gen
from tandem.trainer.checkpoint import load_model_from_checkpoint, resolve_checkpoint
from tandem.trainer.cli import main
from tests.e2e import test_bad_input, test_slurm_launch
from tests.e2e.test_bad_input import RECIPE

# their fixtures, used here: a copy of the earlier tiny run per test (`ctx`), a stub sbatch on PATH
earlier_run, ctx = test_bad_input.earlier_run, test_bad_input.ctx
fake_sbatch = test_slurm_launch.fake_sbatch

EVAL_RECORD = {"prompt_ids": [1, 2], "output_ids": [3], "acceptance_length": 1.0, "drafts": 0,
               "accepted": 0}
# a run's eval_samples.jsonl record (the in-loop evaluator's): it holds the first three too
SAMPLE_RECORD = {"step": 2, "prompt": "a", "continuation": "b", "prompt_ids": [1, 2],
                 "output_ids": [3], "acceptance_length": 1.0}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n"}) + "\n")
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    """The checkpoint's weights must not be read before the refusal."""
    monkeypatch.setattr(eval_cli, "load_model_and_tokenizer",
                        lambda *a: pytest.fail("eval read the checkpoint"))
    monkeypatch.setattr(gen, "load_one_process",
                        lambda *a: pytest.fail("generate read the checkpoint"))


def _unseen_devices():
    """(flag value, message) for devices that cannot be used here."""
    cases = [("banana", "--device banana must be auto, cpu, cuda or npu"),
             ("meta", "--device meta must be auto, cpu, cuda or npu"),
             ("cuda:x", "--device cuda:x must be auto, cpu, cuda, npu, cuda:N or npu:N"),
             ("npu", "--device npu but torch_npu is not installed or no NPU is visible")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "--device cuda but no CUDA device is visible"))
    return cases


# --- --device -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device, message", _unseen_devices())
def test_eval_unusable_device(ctx, no_model, prompts, device, message):
    line = ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--device", device],
                     message)
    assert line.startswith("tandem eval: error: ")


@pytest.mark.parametrize("world", ["1", "2"])
@pytest.mark.parametrize("device, message", _unseen_devices())
def test_generate_unusable_device(ctx, no_model, prompts, tmp_path, monkeypatch, device, message,
                                  world):
    """Under torchrun (WORLD_SIZE 2) too: the process group's start named a config key 'device'
    that generate does not have. The flag is refused before any rendezvous."""
    monkeypatch.setenv("WORLD_SIZE", world)
    out = tmp_path / "g.jsonl"
    line = ctx.fails(["generate", "--checkpoint", ctx.run, "--prompts", prompts, "--out", str(out),
                      "--device", device], message)
    assert line.startswith("tandem generate: error: ") and not os.path.exists(f"{out}.meta.json")


def test_generate_device_auto_is_the_trainers(ctx, prompts, tmp_path, capsys):
    """`auto` resolves as `tandem train` resolves it (it once reached torch as a device name)."""
    out = tmp_path / "g.jsonl"
    assert main(["generate", "--checkpoint", ctx.run, "--prompts", prompts, "--out", str(out),
                 "--max-new-tokens", "3", "--device", "auto"]) == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "g.jsonl.meta.json").read_text())
    assert meta["num_prompts"] == 1 and len(out.read_text().splitlines()) == 1


# --- eval --output --------------------------------------------------------------------------------
def test_eval_output_is_the_prompts_file(ctx, no_model, prompts, tmp_path):
    before = open(prompts, "rb").read()
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--output", prompts],
              f"--output {prompts} is the --prompts input; pass another file")
    assert open(prompts, "rb").read() == before


def test_eval_output_is_a_directory(ctx, no_model, prompts, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--output", str(out)],
              f"--output {out} is a directory; pass a file path")
    assert (out / "keep.txt").read_text() == "keep"


@pytest.mark.parametrize("content", ["notes, not results\n", json.dumps({"text": "a"}) + "\n",
                                     json.dumps(EVAL_RECORD) + "\n[1, 2]\n",
                                     json.dumps(SAMPLE_RECORD) + "\n"],
                         ids=["text", "prompts_jsonl", "one_foreign_line", "eval_samples"])
def test_eval_output_is_someone_elses_file(ctx, no_model, prompts, tmp_path, content):
    out = tmp_path / "precious.jsonl"
    out.write_text(content)
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--output", str(out)],
              f"--output {out} exists and is not an earlier tandem eval --output (JSONL of "
              "prompt_ids, output_ids, acceptance_length, drafts, accepted, no `step`); pass "
              "another file")
    assert out.read_text() == content


def test_eval_output_under_a_file(ctx, no_model, prompts, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    ctx.fails(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--output",
               f"{blocker}/out.jsonl"],
              f"--output {blocker}/out.jsonl: {blocker} is a file, not a directory")
    assert blocker.read_text() == "x"


def test_eval_rerun_replaces_an_earlier_output_on_device_auto(ctx, prompts, tmp_path, capsys):
    """The re-run flow: an earlier --output is replaced; `--device auto` resolves as training's."""
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(EVAL_RECORD) + "\n" + json.dumps(EVAL_RECORD) + "\n")
    assert main(["eval", "--checkpoint", ctx.run, "--prompts", prompts, "--max-new-tokens", "3",
                 "--output", str(out), "--device", "auto"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 1 and records[0]["output_ids"] != EVAL_RECORD["output_ids"]
    assert not os.path.exists(f"{out}.tmp")


# --- sampling flags -------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_temperature(ctx, no_model, prompts, tmp_path, command, value):
    out = ["--out", str(tmp_path / "g.jsonl")] if command == "generate" else []
    ctx.fails([command, "--checkpoint", ctx.run, "--prompts", prompts, *out, "--temperature",
               value], f"--temperature {value} must be a finite number")


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "--temperature -1.0 must be >= 0 (0: greedy)"),
    ("--max-new-tokens", "0", "--max-new-tokens 0 must be >= 1"),
    ("--samples-per-prompt", "-2", "--samples-per-prompt -2 must be >= 1"),
    # greedy samples of one prompt are one response written M times
    ("--samples-per-prompt", "3", "--samples-per-prompt 3 at --temperature 0.0 (greedy) writes the "
     "same response 3 times"),
    ("--batch-size", "0", "--batch-size 0 must be >= 1"),
    ("--top-p", "1.5", "--top-p 1.5 must be in (0, 1]"),
    ("--top-k", "-1", "--top-k -1 must be >= 0 (0: all)"),
    ("--tp", "2", "--tp 2 --pp 1 --ep 1 need a multiple of 2 processes, not 1: launch with "
     "torchrun --nproc-per-node 2"),
])
def test_generate_names_the_bad_flag(ctx, no_model, prompts, tmp_path, flag, value, message):
    ctx.fails(["generate", "--checkpoint", ctx.run, "--prompts", prompts, "--out",
               str(tmp_path / "g.jsonl"), flag, value], message)
    assert not os.path.exists(tmp_path / "g.jsonl.meta.json")


def test_generate_sidecar_not_an_object(ctx, no_model, prompts, tmp_path):
    out = tmp_path / "g.jsonl"
    meta = tmp_path / "g.jsonl.meta.json"
    meta.write_text("[1, 2]\n")
    ctx.fails(["generate", "--checkpoint", ctx.run, "--prompts", prompts, "--out", str(out),
               "--max-new-tokens", "4"],
              f"{meta}: not a JSON object (not written by tandem generate); pass another --out")
    assert meta.read_text() == "[1, 2]\n" and not out.exists()


@pytest.mark.parametrize("command", ["generate", "export"])
def test_an_output_under_a_file(ctx, no_model, prompts, tmp_path, command):
    """`--out FILE/x`: generate said "[Errno 17] File exists: FILE; run it again to resume", which
    never helps, and export printed the bare errno; both now say the parent is a file, before any
    work, as `tandem eval --output` does."""
    blocker = tmp_path / "results"
    blocker.write_text("keep")
    out = str(blocker / "x.jsonl")
    argv = {"generate": ["generate", "--checkpoint", ctx.run, "--prompts", prompts, "--out", out,
                         "--max-new-tokens", "4"],
            "export": ["export", "--checkpoint", ctx.run, "--out", out]}[command]
    ctx.fails(argv, f"--out {out}: {blocker} is a file, not a directory")
    assert blocker.read_text() == "keep"


# --- corrupt weights ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_checkpoint_with_a_nan_weight_is_refused(ctx, prompts, tmp_path, command):
    """A NaN weight makes every logit NaN, whose argmax is token 0 for the drafts and the trunk
    alike: the decode reported a high acceptance length for a corrupt checkpoint."""
    step = resolve_checkpoint(ctx.run)
    model, _ = load_model_from_checkpoint(step)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights["mtp.layers.0.eh_proj.weight"][3, 1] = float("nan")
    dcp.save({"model": weights}, checkpoint_id=step)
    ctx.before = test_bad_input.snapshot(ctx.run)
    argv = {"eval": ["--prompts", prompts],
            "generate": ["--prompts", prompts, "--out", str(tmp_path / "g.jsonl"),
                         "--max-new-tokens", "3"]}[command]
    ctx.fails([command, "--checkpoint", ctx.run, *argv],
              f"{step}: the weights are corrupt: mtp.layers.0.eh_proj.weight (1 of ")
    assert not os.path.exists(tmp_path / "g.jsonl")


# --- report ---------------------------------------------------------------------------------------
def test_report_out_is_a_file(ctx, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("an old page")
    ctx.fails(["report", ctx.run, "--out", str(out)],
              f"--out {out} is a file, not a directory; pass another --out")
    ctx.fails(["report", ctx.run, "--out", f"{out}/sub"],
              f"--out {out}/sub is under {out}, a file, not a directory")
    assert out.read_text() == "an old page"


def test_report_negative_ema_span(ctx):
    ctx.fails(["report", ctx.run, "--ema-span", "-3"], "--ema-span -3 must be >= 0")


# --- launch slurm ---------------------------------------------------------------------------------
SIZES = ["--nodes", "1", "--procs-per-node", "1"]


def test_launch_run_dir_not_writable(ctx, fake_sbatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, f"run.dir={blocker}/run", *SIZES],
              f"config key 'run.dir'='{blocker}/run' is not writable")
    assert fake_sbatch.argv is None and blocker.read_text() == "x"


@pytest.mark.parametrize("mode", [[], ["--check"], ["--dry-run"]], ids=["submit", "check", "dry"])
def test_launch_into_checkpoints_of_another_shape(ctx, fake_sbatch, mode):
    """The job always resumes: `tandem train --resume` would refuse these checkpoints on the
    cluster, so the launcher refuses now with its message."""
    line = ctx.fails(["launch", "slurm", RECIPE, *ctx.base, "model.hidden_size=48", *SIZES, *mode],
                     "has a different model shape: model.hidden_size: checkpoint 32 vs config 48")
    assert line.startswith("tandem launch slurm: error: checkpoint ") and "step_2" in line
    assert fake_sbatch.argv is None


def test_eval_of_a_run_whose_data_is_not_found_from_here(ctx, monkeypatch):
    """A run trained on data.paths relative to where it trained, evaluated from elsewhere (or its
    data moved): `tandem eval` stopped in a traceback whose hint said to run tandem preprocess."""
    for config in __import__("pathlib").Path(ctx.run).glob("**/config.yaml"):
        text = config.read_text().replace("source: stdlib", "source: megatron")
        config.write_text(text.replace("paths: []", "paths:\n  - data/mycorp"))
    ctx.before = test_bad_input.snapshot(ctx.run)
    line = ctx.fails(["eval", "--checkpoint", ctx.run], "the run's validation data: ")
    assert "data/mycorp" in line and "pass --prompts or --suite" in line
    assert "tandem preprocess" not in line


@pytest.fixture
def wider_source(ctx, tmp_path):
    """A copy of the earlier run whose checkpoint's config says hidden_size 48: a fine-tune's
    model.init_from takes its shape from that config."""
    source = tmp_path / "wider"
    shutil.copytree(ctx.run, source)
    for config in source.glob("**/config.yaml"):
        config.write_text(config.read_text().replace("hidden_size: 32", "hidden_size: 48"))
    return str(source)


@pytest.mark.parametrize("mode", [[], ["--check"]], ids=["submit", "check"])
def test_launch_fine_tune_into_checkpoints_of_another_shape(ctx, fake_sbatch, wider_source, mode):
    """A fine-tune's job resumes run.dir's checkpoint with model.init_from's shape: refused now,
    as the job would be (the launcher left that check to the job)."""
    line = ctx.fails(["launch", "slurm", RECIPE, *ctx.base, f"model.init_from={wider_source}",
                      *SIZES, *mode],
                     "has a different model shape: model.hidden_size: checkpoint 32 vs config 48")
    assert line.startswith("tandem launch slurm: error: checkpoint ") and "step_2" in line
    assert fake_sbatch.argv is None


def test_launch_fine_tune_into_its_own_run_submits(ctx, fake_sbatch, tmp_path, capsys):
    """... and the same fine-tune requeued into its own run.dir (its checkpoint took the source's
    shape and tokenizer) is submitted."""
    run = str(tmp_path / "fine_tune")
    fine_tune = [*ctx.base, f"model.init_from={ctx.run}", f"run.dir={run}"]
    assert main(["train", RECIPE, *fine_tune, "train.max_steps=1"]) == 0, capsys.readouterr().err
    assert main(["launch", "slurm", RECIPE, *fine_tune, *SIZES]) == 0, capsys.readouterr().err
    assert fake_sbatch.argv is not None


@pytest.mark.parametrize("overrides, message", [
    # the evaluator's decoding, the job's first check
    (["eval.interval=2", "eval.prompt_len=60"], "4K+5=13 (K=2) exceed model.max_seq_len=64"),
    # the job would build the data and the model to print "nothing to train"
    (["train.max_steps=2"], "is at config key 'train.max_steps'=2, so the job would train "
                            "nothing"),
])
def test_launch_refuses_what_the_job_refuses_at_start(ctx, fake_sbatch, overrides, message):
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, *overrides, *SIZES], message)
    assert fake_sbatch.argv is None


@pytest.mark.parametrize("overrides, message", [
    (["data.source=megatron", "data.paths=[/nonexistent/corpus]"],
     "config key 'data.paths': dataset /nonexistent/corpus: missing"),
    (["data.source=jsonl", "data.paths=[/nonexistent/chat.jsonl]", "data.tokenizer={tok}"],
     "config key 'data.paths': data file not found"),
    (["data.tokenizer=/nonexistent/tokenizer.json"],
     "config key 'data.tokenizer'='/nonexistent/tokenizer.json': no such file"),
])
def test_launch_refuses_data_the_job_cannot_read(ctx, fake_sbatch, tmp_path, overrides, message):
    fresh = [f"run.dir={tmp_path / 'fresh'}"]
    (tmp_path / "tokenizer.json").write_text("{}")  # there; the job reads it
    overrides = [o.format(tok=tmp_path / "tokenizer.json") for o in overrides]
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, *fresh, *overrides, *SIZES], message)
    assert fake_sbatch.argv is None
    # ... unless the job waits on the one that writes it, or only the cluster's nodes see it
    for deferred in ("--sbatch-arg=--dependency=afterok:7", "--files-on-nodes"):
        fake_sbatch.log.unlink(missing_ok=True)
        assert main(["launch", "slurm", RECIPE, *ctx.base, *fresh, *overrides, *SIZES,
                     deferred]) == 0
        assert fake_sbatch.argv is not None


@pytest.mark.parametrize("overrides, message", [
    (["model.vocab_size=300"], "has vocab_size=512, larger than model.vocab_size=300"),
    # the debug Qwen4-Exp model's PLE n-grams stop at id 1; this tokenizer's end of document is 0
    ([*flavors.overrides("debug_qwen4"), "model.vocab_size=512"],
     "config key 'model.eos_token_id'=1 is not the end-of-document token of "),
])
def test_launch_refuses_a_tokenizer_that_does_not_fit_the_model(ctx, fake_sbatch, tmp_path,
                                                                overrides, message):
    """The job found these only after building its data, on the cluster."""
    tokenizer = f"data.tokenizer={ctx.run}/checkpoints/step_2/tokenizer.json"
    fresh = [f"run.dir={tmp_path / 'fresh'}", tokenizer]
    ctx.fails(["launch", "slurm", RECIPE, *ctx.base, *fresh, *overrides, *SIZES], message)
    assert fake_sbatch.argv is None


def test_launch_into_a_run_dir_a_running_run_holds(ctx, fake_sbatch, capsys):
    with open(os.path.join(ctx.run, ".tandem.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.truncate(0)
        held.write("pid 1 on node7\n")
        held.flush()
        ctx.fails(["launch", "slurm", RECIPE, *ctx.base, *SIZES],
                  f"'run.dir'='{ctx.run}' is in use by a running run (pid 1 on node7)")
        assert fake_sbatch.argv is None
        assert main(["launch", "slurm", RECIPE, *ctx.base, *SIZES,
                     "--sbatch-arg=--dependency=afterany:7"]) == 0
        assert "submitted anyway, after --dependency=afterany:7" in capsys.readouterr().err


def test_launch_with_a_lock_file_it_cannot_read(ctx, fake_sbatch, monkeypatch, capsys):
    """(another user's, say): the job decides; no traceback here."""
    lock = os.path.join(ctx.run, ".tandem.lock")

    def unreadable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(launch_checks, "open", unreadable, raising=False)
    assert os.path.isfile(lock)
    assert main(["launch", "slurm", RECIPE, *ctx.base, *SIZES]) == 0, capsys.readouterr().err
    assert fake_sbatch.argv is not None


def test_launch_frozen_trunk_fine_tune_resumed_unfrozen(ctx, fake_sbatch, tmp_path, capsys):
    """A checkpoint holding only the MTP module resumes only on the trunk it was trained on."""
    run = str(tmp_path / "frozen")
    fine_tune = [*ctx.base, f"model.init_from={ctx.run}", f"run.dir={run}"]
    assert main(["train", RECIPE, *fine_tune, "train.freeze_trunk=true",
                 "train.max_steps=1"]) == 0, capsys.readouterr().err
    ctx.fails(["launch", "slurm", RECIPE, *fine_tune, "train.freeze_trunk=false", *SIZES],
              "was trained on the frozen trunk")
    assert fake_sbatch.argv is None


def test_launch_behind_the_stage_that_writes_its_source(ctx, fake_sbatch, tmp_path, capsys):
    """The recipe's own shape (4 experts) does not split over ep=3, the source's may: a note, and
    the job checks the layout as it starts; degrees that do not make up the world size are refused
    whatever the shape."""
    behind = [*ctx.base, f"model.init_from={tmp_path / 'stage_1'}", f"run.dir={tmp_path / 'b'}",
              "parallel.ep=3", "--nodes", "1", "--procs-per-node", "3",
              "--sbatch-arg=--dependency=afterok:7"]
    assert main(["launch", "slurm", RECIPE, *behind]) == 0
    assert "with the recipe's own model shape; submitted anyway" in capsys.readouterr().err
    assert fake_sbatch.argv is not None
    assert main(["launch", "slurm", RECIPE, *behind[:-3], "--procs-per-node", "2",
                 behind[-1]]) == 2
    assert "is not divisible by parallel.tp*pp*cp*ep" in capsys.readouterr().err


def test_launch_accelerators_without_gres_is_noted(ctx, capsys):
    assert main(["launch", "slurm", RECIPE, *ctx.base, "device=cuda", *SIZES, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "--gres" not in out
    assert "device=cuda with --procs-per-node requests no accelerators" in err


def test_launch_into_a_matching_run_submits(ctx, fake_sbatch, capsys):
    assert main(["launch", "slurm", RECIPE, *ctx.base, *SIZES]) == 0, capsys.readouterr().err
    assert fake_sbatch.argv is not None and capsys.readouterr().out.strip() == "4242"
