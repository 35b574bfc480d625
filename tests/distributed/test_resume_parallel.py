"""Resume is bit-exact under a parallel layout (ep2 on gloo): a job stopped after step 2 and resumed
gives the uninterrupted job's losses, grad norms, learning rates and consumed samples bit for
bit. The uninterrupted job saves asynchronously (checkpoint.async_save), its steps' collectives
running while a save is in flight: on the default group, the save's planning collectives and the
steps' were paired in different orders by the two ranks (a gloo mismatch, or a hang, at step 2)."""

import json
import os

import pytest

from tests import processes
from tests.conftest import fault_env
from tests.distributed.test_cli_layouts import RECIPE, TINY_MODEL_DATA

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL = TINY_MODEL_DATA + ["eval.interval=0", "checkpoint.interval=2", "parallel.ep=2"]


def launch(run_dir, cache, steps, resume=False, extra=(), faults=None):
    """`tandem train` on 2 ranks (tests/processes.py); its stderr."""
    args = ["train", RECIPE, *SMALL, *extra, f"train.max_steps={steps}", f"run.dir={run_dir}",
            f"data.cache_dir={cache}"] + (["--resume"] if resume else [])
    env = dict(os.environ, WANDB_MODE="disabled")
    env = fault_env(env, **faults) if faults else env
    proc = processes.tandem(args, world=2, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [(r["step"], r["loss"], r["loss/main"], r["loss/mtp_1"], r["loss/mtp_2"],
             r["loss/mtp_3"], r["grad_norm"],
             r["lr"], r["consumed_samples"], r["consumed_tokens"]) for r in recs]


def peaks(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["mem/peak_gb"] for line in f]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_cache):
    root = tmp_path_factory.mktemp("resume_ep2")
    launch(root / "full", corpus_cache, 5, extra=["checkpoint.async_save=true"])
    return root, losses(root / "full")


def test_stopped_and_resumed_ep2_is_bit_exact(uninterrupted, corpus_cache):
    root, reference = uninterrupted
    # rank 1 holds 1.5 GiB more than rank 0: mem/peak_gb is the largest rank's
    launch(root / "resumed", corpus_cache, 2, faults={"TANDEM_TEST_BALLAST": "1:1536"})
    assert min(peaks(root / "resumed")) > 1.5 > max(peaks(root / "full")), (
        peaks(root / "resumed"), peaks(root / "full"))
    err = launch(root / "resumed", corpus_cache, 5, resume=True)
    assert "at step 2" in err and "global batch" not in err  # the same 8 samples per step: no note
    assert losses(root / "resumed") == reference
    assert [r[-2] for r in reference] == [4, 8, 12, 16, 20]  # micro-batch 2 on each of 2 ep ranks

