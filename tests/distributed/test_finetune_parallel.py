"""MTP fine-tuning under tensor parallelism, from a Hugging Face export and from a Tandem run
directory: the weights are read into the already-sharded model (each rank reads its own slices)
and training matches one process."""

import json
import os

import pytest
from omegaconf import OmegaConf

from tandem.trainer.cli import main
from tests import processes
from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA, fault_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = TINY_DATA + ["eval.interval=0"] + QUIET
TRUNK = DEBUG_MODEL + ["model.num_kv_heads=2", "mtp.num_steps=0"]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_finetune_from_hf_export_under_tp2_matches_one_process(tmp_path, corpus_cache):
    cache = f"data.cache_dir={corpus_cache}"
    assert main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), *DATA, *TRUNK, cache,
                 "train.max_steps=3", f"run.dir={tmp_path / 'pretrain'}"]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "pretrain"), "--out",
                 str(tmp_path / "hf")]) == 0
    finetune = [os.path.join(ROOT, "recipes", "finetune_mtp.yaml"), *DATA, cache,
                "train.max_steps=2",
                f"model.init_from={tmp_path / 'hf'}", "checkpoint.save_final=false"]
    assert main(["train", *finetune, f"run.dir={tmp_path / 'single'}"]) == 0
    proc = processes.tandem(["train", *finetune, f"run.dir={tmp_path / 'tp2'}", "parallel.tp=2"],
                            world=2, env=dict(os.environ, WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    single, tp2 = losses(tmp_path / "single"), losses(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [r["step"] for r in single] == [1, 2]
    for a, b in zip(single, tp2):
        for key in ("loss/main", "loss/mtp_1", "loss/mtp_2", "loss/mtp_3"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])


def test_finetune_from_a_run_directory_reads_one_step_on_every_rank(tmp_path, corpus_cache):
    """`model.init_from` naming a run directory reads its newest checkpoint, which moves on while
    that run trains. Each rank looked it up for itself: a checkpoint published between two ranks'
    looks (here step_2, between rank 1's and rank 0's) gave the ranks trunks of different steps
    (wrong losses) or tokenizers (a crash on a dataset index no rank built). Every rank now reads
    the step rank 0 found, as one process fine-tuning from that step does."""
    cache = f"data.cache_dir={corpus_cache}"
    pretrain = tmp_path / "pretrain"
    assert main(["train", os.path.join(ROOT, "recipes", "tiny.yaml"), *DATA, *TRUNK, cache,
                 "train.max_steps=2", "checkpoint.interval=1", f"run.dir={pretrain}"]) == 0
    step_2 = pretrain / "checkpoints" / "step_2"
    os.rename(step_2, tmp_path / "staged_step_2")
    finetune = [os.path.join(ROOT, "recipes", "finetune_mtp.yaml"), *DATA, cache,
                "train.max_steps=2", "checkpoint.save_final=false"]
    env = fault_env(dict(os.environ, WANDB_MODE="disabled"),
                    TANDEM_TEST_PUBLISH_AT_START=f"{tmp_path / 'staged_step_2'}:{step_2}")
    proc = processes.tandem(["train", *finetune, f"model.init_from={pretrain}",
                             f"run.dir={tmp_path / 'tp2'}", "parallel.tp=2"], world=2, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert OmegaConf.load(tmp_path / "tp2" / "config.yaml").model.init_from == str(step_2)
    assert main(["train", *finetune, f"model.init_from={step_2}",
                 f"run.dir={tmp_path / 'single'}"]) == 0
    single, tp2 = losses(tmp_path / "single"), losses(tmp_path / "tp2")
    assert [r["step"] for r in tp2] == [r["step"] for r in single] == [1, 2]
    for a, b in zip(single, tp2):
        for key in ("loss/main", "loss/mtp_1", "loss/mtp_2", "loss/mtp_3"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])
