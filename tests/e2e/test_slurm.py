"""`tandem launch slurm` against a real one-node Slurm cluster (tests/e2e/slurm_cluster.py).

Slurm's own pre-timeout signal (`--signal=USR1@N` from a 1-minute time limit) reaches the real
trainer (`tandem train`, 2 ranks on gloo under torchrun): it checkpoints, requeues itself, resumes
from the checkpoint and finishes with a continuous step count.

The cluster starts once per session (about 2 s once Slurm is installed; installing it with apt-get
takes longer). The module skips only when Slurm is missing and cannot be installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA, fault_env
from tests.e2e.slurm_cluster import SlurmCluster, SlurmUnavailable

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY_RECIPE = REPO / "recipes" / "tiny.yaml"
PROCS = 2
TINY = DEBUG_MODEL + TINY_DATA + ["eval.interval=0"] + QUIET
FINAL_STATES = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm():
    try:
        cluster = SlurmCluster()
        cluster.start()
    except SlurmUnavailable as exc:
        print(f"skipping Slurm e2e tests: {exc}")
        pytest.skip(f"Slurm unavailable: {exc}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        cluster.stop()


def _env(extra_path: List[Path] = (), **kw) -> Dict[str, str]:
    # The interpreter's own bin dir first: `torchrun`/`tandem` resolve to real scripts, not pyenv
    # shims (a shim re-prepends its bin dir to PATH, which would hide a stub `tandem`).
    path = [str(p) for p in extra_path] + [os.path.dirname(sys.executable), os.environ["PATH"]]
    return dict(os.environ, PATH=":".join(path), **kw)


def launch(argv: List[str], env: Dict[str, str]) -> str:
    tandem = shutil.which("tandem", path=env["PATH"])
    cmd = [tandem] if tandem else [sys.executable, "-m", "tandem.trainer.cli"]
    res = subprocess.run(cmd + ["launch", "slurm", *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    assert job_id.isdigit(), res.stdout
    return job_id


def job_fields(slurm: SlurmCluster, job_id: str) -> Dict[str, str]:
    out = slurm.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))


def wait_job(slurm: SlurmCluster, job_id: str, run_dir: Path, timeout: float) -> Dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        f = job_fields(slurm, job_id)
        if f.get("JobState") in FINAL_STATES:
            return f
        time.sleep(1)
    slurm.run("scancel", job_id, check=False)
    pytest.fail(f"job {job_id} not done after {timeout}s: "
                f"{job_fields(slurm, job_id)}\n{job_logs(run_dir, job_id)}\n{slurm.logs()}")


def job_logs(run_dir: Path, job_id: str) -> str:
    """The job's whole stdout and stderr: every attempt appends to them (`--open-mode=append`), and
    a job requeued three times under load writes past 6 kB of tracebacks, so a tail can lose the
    first attempt's lines the checks look for."""
    parts = []
    for ext in ("out", "err"):
        p = run_dir / "slurm" / f"{job_id}.{ext}"
        parts.append(f"--- {p.name}\n" + (p.read_text(errors="replace") if p.exists()
                                          else "(missing)"))
    return "\n".join(parts)


def steps(run_dir: Path) -> List[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if "loss" in rec:
            out.append(rec["step"])
    return out


def checkpoint_steps(run_dir: Path) -> List[int]:
    ck = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in ck.glob("step_*")) if ck.is_dir() else []


# -- the real trainer ------------------------------------------------------------------------------
needs_trainer = pytest.mark.skipif(not TINY_RECIPE.exists(), reason="recipes/tiny.yaml not present")


@needs_trainer
def test_time_limit_signal_preempts_requeues_and_resumes(slurm, tmp_path, corpus_cache):
    """A real run submitted by `tandem launch slurm` with a 2-minute limit and Slurm's own
    `--signal=USR1@100` (it fires 20-50 s in: slurmctld checks limits every ~30 s, and the 100 s
    before the limit leave room for a check that a loaded machine delays: with a 1-minute limit and
    USR1@40 one run was killed at its limit without the signal). Its first attempt is slowed to 4 s
    a step from outside (tests/fault_injection), so it would need 160 s: only a working preemption
    path finishes the job (a requeued attempt signalled again before it finishes
    requeues once more; every attempt continues from the last one's checkpoint). Slurm signals the
    job step; torchrun ignores SIGUSR1 and each rank's handler catches it; the run checkpoints,
    requeues, resumes from that checkpoint and completes every step once, and the requeued attempt
    survives the exit (this also covers a plain run's interval checkpoints, config.yaml and the
    job's provenance)."""
    run_dir = tmp_path / "run"
    max_steps = 40
    job_id = launch(
        [str(TINY_RECIPE), f"run.dir={run_dir}", f"train.max_steps={max_steps}",
         "checkpoint.interval=20",
         f"data.cache_dir={corpus_cache}", *TINY, "--nodes", "1", "--procs-per-node", str(PROCS),
         "--time", "00:02:00", "--signal-seconds", "100"],
        fault_env(_env(), TANDEM_TEST_SLOW_FIRST_ATTEMPT="4"),
    )
    # alone one requeue (about a minute); beside the suite's largest torchrun launches a requeued
    # attempt can be signalled again before it finishes, each attempt a cycle of 20-50 s
    f = wait_job(slurm, job_id, run_dir, timeout=480)
    logs = job_logs(run_dir, job_id)
    assert f["JobState"] == "COMPLETED" and f["ExitCode"] == "0:0", (f, logs)
    assert int(f["Restarts"]) >= 1, ("the job finished before the preemption signal took effect", f,
                                     logs)
    assert "preemption: SIGUSR1 received" in logs, logs
    m = re.search(r"preempted: checkpointed step (\d+)", logs)
    assert m, logs
    ck_step = int(m.group(1))
    assert 0 < ck_step < max_steps, ck_step
    assert ck_step in checkpoint_steps(run_dir), logs
    assert re.search(rf"resumed from \S*step_{ck_step}\S* at step {ck_step}", logs), logs
    assert "start (restart 1)" in logs
    # Every step exactly once, in order: the resumed attempt continued from the checkpoint step.
    assert steps(run_dir) == list(range(1, max_steps + 1)), logs
    assert {20, 40} <= set(checkpoint_steps(run_dir)), logs  # the interval's and the final one
    assert (run_dir / "config.yaml").exists()
    prov = json.loads(next((run_dir / "slurm").glob("launch_*.json")).read_text())
    assert prov["job_id"] == job_id and prov["trainer_argv"][:3] == ["tandem", "train",
                                                                     str(TINY_RECIPE)]
