"""`tandem launch slurm` without a cluster: rendering, quoting (the script is really executed by
bash with stub srun/torchrun/tandem), submission through a stub sbatch, the batch-shell signal
relay, and the preemption API (including the all-reduce agreement on two gloo processes)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.trainer.launch import _time_limit_seconds, launch_slurm_main

SLURM_ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1",
             "SLURM_CPUS_PER_TASK": "2"}


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


class FakeSbatch:
    """A stub `sbatch` first on PATH: it records its argv (`argv`, None if never called) and prints
    a job id, as `sbatch --parsable` does."""

    def __init__(self, tmp_path: Path, monkeypatch):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        self.log = tmp_path / "sbatch_argv.json"
        _exe(bin_dir / "sbatch",
             f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], "
             f"open({str(self.log)!r}, "
             "'w'))\nprint('4242')\n")
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    @property
    def argv(self):
        return json.loads(self.log.read_text()) if self.log.exists() else None


@pytest.fixture
def fake_sbatch(tmp_path, monkeypatch) -> FakeSbatch:
    return FakeSbatch(tmp_path, monkeypatch)


def _recipe(dir_: Path, run_dir: Path, name: str = "r.yaml") -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    p = dir_ / name
    p.write_text(f"run:\n  dir: {run_dir}\n")
    return p


def _dry_run(capsys, argv):
    rc = launch_slurm_main(argv + ["--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def _directives(script: str):
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_dry_run_cpu(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = _recipe(tmp_path, run_dir)
    out = _dry_run(capsys,
                   [str(recipe), "train.max_steps=6", "--nodes", "2", "--procs-per-node", "2",
                            "--partition", "debug", "--time", "00:10:00", "--account", "proj1",
                    "--job-name", "tiny"])
    d = _directives(out)
    for want in ["--job-name=tiny", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                 "--time=00:10:00",
                 "--partition=debug", "--account=proj1", f"--output={run_dir}/slurm/%j.out",
                 f"--error={run_dir}/slurm/%j.err", "--signal=USR1@120", "--requeue",
                 "--open-mode=append"]:
        assert want in d, (want, d)
    assert not any("gres" in x or "gpu" in x for x in d), d
    assert "--nproc-per-node=2" in out
    assert '--nnodes="$SLURM_NNODES"' in out and "--rdzv-backend=c10d" in out
    assert (
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in out and '--rdzv-id="$SLURM_JOB_ID"' in out
    )
    assert f"--no-python tandem train {recipe} train.max_steps=6 --resume" in out
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in out
    assert not run_dir.exists(), "--dry-run must not write anything"


def test_dry_run_gpu_and_extras(tmp_path, capsys):
    recipe = _recipe(tmp_path, tmp_path / "run")
    out = _dry_run(capsys,
                   [str(recipe), "--nodes", "4", "--gpus-per-node", "8", "--signal-seconds", "300",
                            "--sbatch-arg=--exclusive", "--sbatch-arg=--qos=high"])
    d = _directives(out)
    assert "--gres=gpu:8" in d and "--cpus-per-task=64" in d and "--signal=USR1@300" in d
    assert "--exclusive" in d and "--qos=high" in d and "--nodes=4" in d
    assert "--nproc-per-node=8" in out


def test_ascend_recipe_requests_npus(capsys):
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes",
                          "moe_4b_mtp_ascend.yaml")
    d = _directives(_dry_run(capsys, [recipe, "--nodes", "2", "--gpus-per-node", "8"]))
    assert "--gres=npu:8" in d and not any(x.startswith("--gres=gpu") for x in d)
    d = _directives(_dry_run(capsys, [recipe, "--nodes", "2", "--gpus-per-node", "8", "--gres-name",
                                      "gpu"]))
    assert "--gres=gpu:8" in d


def test_procs_and_gpus_are_exclusive(tmp_path, capsys):
    recipe = _recipe(tmp_path, tmp_path / "run")
    with pytest.raises(SystemExit):
        launch_slurm_main([str(recipe), "--nodes", "1", "--procs-per-node", "2", "--gpus-per-node",
                           "2"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["bogus.key=1"], "unknown config key 'bogus'"),
        (["--job-name", "a b"], "--job-name"),
        (["--sbatch-arg=--comment=x\n#SBATCH --wrap=id"], "--sbatch-arg"),
        (["--time", "1:00\n#SBATCH --x"], "--time"),
        # a final newline ended the #SBATCH block: sbatch dropped --time, --signal and --requeue
        (["--partition", "gpu\n"], "--partition='gpu\\n' cannot go on an #SBATCH line"),
        (["--time", "4h"], "--time '4h' is not a Slurm time limit"),
        (["--time", "00:01:30", "--signal-seconds", "90"], "is not below --time 00:01:30 (90 s)"),
        (["--sbatch-arg=--nodes=5"], "contradicts --nodes, which the script already sets (use "
                                     "--nodes"),
        (["--sbatch-arg=--nod=5"], "contradicts --nodes"),  # getopt's abbreviation
        # a time limit the launcher cannot check the checkpoint signal against, however spelt
        (["--sbatch-arg=--time=00:01:00"], "contradicts --time, which the launcher checks "
                                           "--signal-seconds against (use --time)"),
        (["--sbatch-arg=-t1"], "contradicts --time"),
        (["--sbatch-arg=--ti=1"], "contradicts --time"),
        (["--sbatch-arg=-Qpgpu", "--partition", "a"], "contradicts --partition"),  # a bundle
        (["--sbatch-arg=--no-requeue"], "contradicts --requeue, which the script already sets "
                                        "(the launcher needs its own value)"),
        (["--sbatch-arg=-n4"], "contradicts --ntasks-per-node"),
        # sbatch's #SBATCH parser strips quotes and backslashes: this one is --output
        (["--sbatch-arg=--\"output\"=/tmp/x.out"], "holds a quote, backslash or #"),
        (["--sbatch-arg=--no-req\\ueue"], "holds a quote, backslash or #"),
        (["--sbatch-arg=--comment=a#b"], "holds a quote, backslash or #"),
        # the script skips a missing env.d: the job ran without the site's settings
        (["--env-dir", "/no/such/env.dd"], "--env-dir /no/such/env.dd is not a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, needle):
    recipe = _recipe(tmp_path, tmp_path / "run")
    rc = launch_slurm_main([str(recipe), "--nodes", "1", "--procs-per-node", "1", "--dry-run",
                            *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("sizes, needle", [
    (["--nodes", "-1", "--gpus-per-node", "8"], "--nodes must be >= 1"),
    (["--nodes", "1", "--gpus-per-node", "0"], "--gpus-per-node / --procs-per-node must be >= 1"),
])
def test_check_refuses_impossible_job_sizes(tmp_path, capsys, sizes, needle):
    """`--check` once sized a job of -1 nodes (or 0 GPUs each) and printed its memory per rank."""
    recipe = _recipe(tmp_path, tmp_path / "run")
    rc = launch_slurm_main([str(recipe), *sizes, "--check"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_missing_recipe_exits_2(tmp_path, capsys):
    rc = launch_slurm_main([str(tmp_path / "nope.yaml"), "--nodes", "1", "--procs-per-node", "1"])
    assert rc == 2 and "recipe file not found" in capsys.readouterr().err


def test_unsafe_run_dir_rejected(tmp_path, capsys):
    recipe = _recipe(tmp_path, tmp_path / "run 50%")
    rc = launch_slurm_main([str(recipe), "--nodes", "1", "--procs-per-node", "1", "--dry-run"])
    assert rc == 2 and "run.dir" in capsys.readouterr().err


def test_submit_writes_script_and_provenance(tmp_path, capsys, fake_sbatch):
    run_dir = tmp_path / "run"
    recipe = _recipe(tmp_path, run_dir)
    rc = launch_slurm_main([str(recipe), "train.max_steps=3", "--nodes", "1", "--procs-per-node",
                            "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() == "4242"
    argv = fake_sbatch.argv
    assert argv[0] == "--parsable" and len(argv) == 2
    script = Path(argv[1])
    assert (
        script.parent == run_dir / "slurm"
        and script.name.startswith("launch_")
        and script.suffix == ".sbatch"
    )
    prov = json.loads(script.with_suffix(".json").read_text())
    assert prov["trainer_argv"] == ["tandem", "train", str(recipe), "train.max_steps=3", "--resume"]
    assert prov["job_id"] == "4242" and prov["sbatch_script"] == str(script)


def test_relaunch_before_the_first_checkpoint(tmp_path, capsys, fake_sbatch, monkeypatch):
    """A job that started (config.yaml, metrics) but saved no checkpoint may be launched again as
    it was (its --resume starts it from step 0); another recipe or overrides would start over the
    earlier run's files, and are refused."""
    run_dir = tmp_path / "run"
    recipe = _recipe(tmp_path, run_dir)
    argv = [str(recipe), "train.max_steps=3", "--nodes", "1", "--procs-per-node", "1"]
    assert launch_slurm_main(argv) == 0
    (run_dir / "config.yaml").write_text("the job's\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert launch_slurm_main(argv) == 0
    monkeypatch.chdir(tmp_path)  # the same recipe, named relative to another directory
    assert launch_slurm_main(["r.yaml", *argv[1:]]) == 0
    capsys.readouterr()
    fake_sbatch.log.unlink()
    assert launch_slurm_main([str(recipe), "train.max_steps=4", *argv[2:]]) == 2
    assert "holds an earlier run (config.yaml, metrics.jsonl; no complete checkpoint)" in (
        capsys.readouterr().err)
    assert fake_sbatch.argv is None


def test_a_missing_init_from_is_refused_before_sbatch(tmp_path, capsys, fake_sbatch):
    """A job reads model.init_from / mtp.init_from as it starts: one naming no checkpoint (a stage
    not yet run, one without a complete checkpoint) was submitted and failed on every node."""
    run_dir, empty = tmp_path / "run", tmp_path / "stage1"
    empty.mkdir()
    recipe = _recipe(tmp_path, run_dir)
    for key in ("model.init_from", "mtp.init_from"):
        rc = launch_slurm_main([str(recipe), f"{key}={empty}", "--nodes", "1",
                                "--procs-per-node", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and key in err and str(empty) in err and "nothing submitted" in err, err
        assert err.count("\n") == 1 and fake_sbatch.argv is None and not run_dir.exists()
    # --check reads no checkpoint: the recipe of a stage that has yet to run is checked
    assert launch_slurm_main([str(recipe), f"model.init_from={empty}", "--nodes", "1",
                              "--procs-per-node", "1", "--check"]) == 0, capsys.readouterr().err
    # a job queued behind the stage that writes the checkpoint is submitted, and says so
    rc = launch_slurm_main([str(recipe), f"model.init_from={empty}", "--nodes", "1",
                            "--procs-per-node", "1", "--sbatch-arg=--dependency=afterok:41"])
    err = capsys.readouterr().err
    assert rc == 0 and "submitted anyway, after --dependency=afterok:41" in err, err
    script = Path(fake_sbatch.argv[-1]).read_text()
    assert "#SBATCH --dependency=afterok:41" in script


def _stub_bin(bin_dir: Path, argv_out: Path, marker_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    # srun/torchrun: drop their own options and exec the command they were given.
    _exe(bin_dir / "srun", '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    _exe(bin_dir / "torchrun",
         '#!/bin/bash\nwhile [[ "$1" != --no-python ]]; do shift; done\nshift\nexec "$@"\n')
    _exe(bin_dir / "scontrol", "#!/bin/bash\necho localhost\n")
    _exe(bin_dir / "scancel", f"#!/bin/bash\necho \"$@\" >> {marker_dir}/../scancel.log\n")
    _exe(bin_dir / "tandem",
         f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(argv_out)!r}, "
         "'w'))\n")


def test_hostile_values_reach_the_trainer_literally(tmp_path, capsys, monkeypatch):
    """Render with a hostile recipe path, working directory and overrides, then run the script with
    bash."""
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    m = str(marker_dir)
    # File names cannot hold "/", so the path parts use relative markers (PWNED_*), looked for
    # everywhere.
    hostile_dir = tmp_path / "w $(touch PWNED_d1) `touch PWNED_d2` 'q\" ;touch PWNED_d3\nnl"
    recipe = _recipe(hostile_dir, tmp_path / "run",
                     name="r$(touch PWNED_r1);`touch PWNED_r2`'\".yaml")
    overrides = [
        f"run.name=$(touch {m}/o1)",
        f"run.name=a`touch {m}/o2`b",
        f"run.name=x'; touch {m}/o3; echo '",
        f'run.name=q"$(touch {m}/o4)"',
        f"run.name=l1\nl2 $(touch {m}/o5)",
        "logging.project=$HOME;$PATH && |",
    ]
    monkeypatch.chdir(hostile_dir)
    script = _dry_run(capsys, [str(recipe), *overrides, "--nodes", "1", "--procs-per-node", "2"])
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(script)

    argv_out = tmp_path / "argv.json"
    _stub_bin(tmp_path / "bin", argv_out, marker_dir)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", **SLURM_ENV)
    res = subprocess.run(["bash", str(script_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(argv_out.read_text()) == ["train", str(recipe), *overrides, "--resume"]
    assert sorted(os.listdir(marker_dir)) == [], "a hostile value was executed"
    assert [p for p in tmp_path.rglob("PWNED*")] == [], "a hostile path was executed"
    assert "srun exited with 0" in res.stdout


def _one_node_job(tmp_path, capsys):
    """A one-node, one-process job script of a tiny recipe, with the stubs of `_stub_bin` in
    tmp_path/bin; its path."""
    recipe = _recipe(tmp_path, tmp_path / "run")
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(_dry_run(capsys, [str(recipe), "--nodes", "1", "--procs-per-node", "1"]))
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    _stub_bin(tmp_path / "bin", tmp_path / "argv.json", marker_dir)
    return script_path


@pytest.mark.parametrize("env,timeout", [({}, "120"), ({"TANDEM_SHUTDOWN_TIMEOUT": "900"}, "900")])
def test_torchrun_gives_a_sigterm_checkpoint_time(tmp_path, capsys, env, timeout):
    """On SIGTERM (the time limit, scancel) the ranks checkpoint, but torchrun SIGKILLed them after
    its default 30 s, whatever the site's KillWait: a longer save was lost and the job not
    requeued. The job's torchrun waits TANDEM_SHUTDOWN_TIMEOUT (default 120 s). Its rendezvous
    port stays below Linux's ephemeral ports (job 123456 took 32956 among them)."""
    script_path = _one_node_job(tmp_path, capsys)
    options = tmp_path / "torchrun_options"
    _exe(tmp_path / "bin" / "torchrun",
         f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(options))}\n')
    run_env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                   **{**SLURM_ENV, "SLURM_JOB_ID": "123456"}, **env)
    res = subprocess.run(["bash", str(script_path)], cwd=tmp_path, env=run_env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    given = options.read_text().splitlines()
    assert f"--shutdown-timeout={timeout}" in given and "--rdzv-endpoint=localhost:23456" in given


def test_batch_shell_relays_usr1_to_steps_and_keeps_waiting(tmp_path, capsys):
    """`scancel --batch --signal=USR1` reaches only the batch shell: it must relay to the steps
    (scancel without --batch) and go on waiting for srun, exiting with srun's status."""
    script_path = _one_node_job(tmp_path, capsys)
    started = tmp_path / "srun_started"
    # srun runs until the relay reached scancel (at most 30 s), however late a loaded machine
    # delivers the signal, then exits 3: the shell must still be waiting for it
    relayed = tmp_path / "scancel.log"
    _exe(tmp_path / "bin" / "srun",
         f"#!/bin/bash\ntouch {shlex.quote(str(started))}\nfor _ in $(seq 300); do "
         f"[ -e {shlex.quote(str(relayed))} ] && break; "
         "sleep 0.1; done\nexit 3\n")
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", **SLURM_ENV)
    proc = subprocess.Popen(["bash", str(script_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3, out
    assert "relaying to the job steps" in out and "srun exited with 3" in out
    assert relayed.read_text().split() == ["--signal=USR1", "77"]


# -- preemption API --------------------------------------------------------------------------------
@pytest.fixture
def preemption(monkeypatch):
    import importlib

    from tandem.trainer import preemption as mod

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    mod = importlib.reload(mod)  # fresh flag
    yield mod
    for s, h in saved.items():
        signal.signal(s, h)


def test_preemption_flag_and_requeue(preemption, tmp_path, monkeypatch):
    assert not preemption.preemption_requested()
    preemption.install_preemption_handler()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.preemption_requested() and preemption.agree_preemption()

    log = tmp_path / "scontrol.log"
    _exe(tmp_path / "scontrol", f'#!/bin/bash\necho "$@" >> {log}\n')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preemption.requeue_current_job() is False and not log.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("RANK", "1")
    assert preemption.requeue_current_job() is False and not log.exists()
    monkeypatch.setenv("RANK", "0")
    assert preemption.requeue_current_job() is True
    assert log.read_text().split() == ["requeue", "123"]


def test_preemption_sigterm_sets_flag(preemption):
    """SIGTERM (scancel, the scheduler's preemption) asks to stop, and wins over an earlier
    SIGUSR1's requeue: a plain scancel requeued the job."""
    preemption.install_preemption_handler()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.agree_preemption() == preemption.REQUEUE
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.preemption_requested()
    assert preemption.agree_preemption() == preemption.STOP


def test_preemption_signal_during_the_build_is_kept(preemption):
    """The `tandem train` process routes the signals before it builds the run; the loop's own
    install must not clear a signal that came in between."""
    preemption.install_preemption_handler()
    os.kill(os.getpid(), signal.SIGUSR1)
    preemption.install_preemption_handler()
    assert preemption.preemption_requested()


_LATE_SIGNAL = """
import os, signal, sys
from tandem.trainer.cli import main
sys.argv = ["tandem", "train", sys.argv[1]]
rc = main()  # the console script's call: the process's own entry point
os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's time-limit warning, after training is over
os.kill(os.getpid(), signal.SIGTERM)
os.write(1, f"RC {rc}\\n".encode())
"""


def test_train_process_survives_a_preemption_signal_after_training(tmp_path):
    """A finished (here: refused) `tandem train` ignores a late SIGUSR1/SIGTERM until it exits, so
    Slurm does not mark a job FAILED that had finished or had checkpointed and requeued."""
    script = tmp_path / "late.py"
    script.write_text(_LATE_SIGNAL)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout.strip()) == (0, "RC 2"), res.stderr[-2000:]


_AGREE = """
import os, signal, sys
import torch.distributed as dist
from tandem.trainer import preemption as P
# SIGTERM stays fatal: a timed-out test can kill it
P.install_preemption_handler(signals=(signal.SIGUSR1,))
dist.init_process_group("gloo")
r = dist.get_rank()
seen = [P.agree_preemption()]
if r == 1:
    os.kill(os.getpid(), signal.SIGUSR1)
seen.append(P.agree_preemption())
# one write(2) of a short line: atomic on the pipe both ranks share (print may split it and
# interleave)
os.write(1, f"RESULT {r} {P.preemption_requested()} {seen}\\n".encode())
# leave as a rank of tandem does: finalisation after gloo collectives can abort (pytorch#190489)
from tandem.trainer.parallel.layout import leave_distributed_process
leave_distributed_process(0)
"""


@pytest.mark.distributed
def test_agree_preemption_is_max_over_ranks(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(_AGREE)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("RESULT"))
    # SIGUSR1's level, REQUEUE (1), on both ranks
    assert lines == ["RESULT 0 False [0, 1]", "RESULT 1 True [0, 1]"], res.stdout


ROOT = Path(__file__).resolve().parents[2]


def test_bad_layout_for_the_world_size_is_refused_before_sbatch(tmp_path, capsys, monkeypatch,
                                                                fake_sbatch):
    """The error `tandem train` would hit in the job's first seconds is printed now; nothing is
    written or submitted (the stub sbatch records any call)."""
    from tandem.trainer.cli import train_main

    run_dir = tmp_path / "run"
    bad = ["parallel.tp=2", "parallel.pp=2", f"run.dir={run_dir}"]
    rc = launch_slurm_main([str(ROOT / "recipes" / "tiny.yaml"), *bad, "--nodes", "1",
                            "--procs-per-node", "2"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert fake_sbatch.argv is None and not (run_dir / "slurm").exists()
    # the same message as the trainer itself, started with that world size
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_main([str(ROOT / "recipes" / "tiny.yaml"), *bad]) == 2
    train_err = capsys.readouterr().err.strip()
    message = train_err.removeprefix("tandem train: error: ")
    assert "world size 2 is not divisible by parallel.tp*pp*cp*ep" in message
    assert err.startswith(f"tandem launch slurm: error: {message} (world size 2 = --nodes 1 x 2 "
                          "per node)")
    # the same recipe fits 2 nodes x 2 processes
    assert launch_slurm_main([str(ROOT / "recipes" / "tiny.yaml"), *bad, "--nodes", "2",
                              "--procs-per-node", "2", "--dry-run"]) == 0
    capsys.readouterr()


def test_check_prints_parameters_and_memory_and_submits_nothing(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    rc = launch_slurm_main([str(ROOT / "recipes" / "moe_4b_mtp_gpu.yaml"), f"run.dir={run_dir}",
                            "--nodes", "2", "--gpus-per-node", "8", "--check"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (
        "world size 16: layout ok" in out and "params total=" in out and "per-rank memory" in out
    ), out
    assert not run_dir.exists()
    # the recipe's data and tokenizer are not on this machine: said, as a submission refuses them
    # (the check passed them in silence)
    assert "note: config key 'data.tokenizer'='/data/tokenizers/deepseek-v2': no such file" in err
    # the flagship layout (tp2 x ep4 x pp2) does not fit 1 node of 8
    rc = launch_slurm_main([str(ROOT / "recipes" / "moe_4b_mtp_gpu.yaml"), f"run.dir={run_dir}",
                            "--nodes", "1", "--gpus-per-node", "8", "--check"])
    assert rc == 2 and "not divisible by parallel.tp*pp*cp*ep" in capsys.readouterr().err


@pytest.mark.parametrize("time, seconds", [
    ("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("1-2", 93600), ("1-2:30", 95400),
    ("1-0:0:5", 86405), ("UNLIMITED", None), ("0", None), ("00:00:00", None),
])
def test_time_limits_read_as_slurm_reads_them(time, seconds):
    """Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (sbatch(1)), hand-converted; 0 is
    no limit."""
    assert _time_limit_seconds(time) == seconds


@pytest.mark.parametrize("extra", [
    ["--sbatch-arg=--gres=nvme:1"],  # a CPU job writes no --gres
    ["--sbatch-arg=--time-min=30"], ["--sbatch-arg=--gres-flags=enforce-binding"],
    ["--sbatch-arg=-Q"], ["--time=0"],
])
def test_sbatch_args_the_script_does_not_contradict_pass(tmp_path, capsys, extra):
    recipe = _recipe(tmp_path, tmp_path / "run")
    rc = launch_slurm_main([str(recipe), "--nodes", "1", "--procs-per-node", "1", "--dry-run",
                            *extra])
    assert rc == 0, capsys.readouterr().err
    assert f"#SBATCH {extra[0].split('--sbatch-arg=')[-1]}\n" in capsys.readouterr().out


def test_check_of_a_fine_tune_sees_the_checkpoints_model(tmp_path, capsys, fake_sbatch):
    """A fine-tuning recipe's model is its model.init_from checkpoint's (the job takes the shape as
    it starts): the layout check and `--check` see that model, here a DeepSeek-V3-shaped export
    with 4 experts and MLA, not the recipe's placeholder of 8 experts."""
    from tokenizers import Tokenizer, models

    from tandem.models import TandemModel, flavors
    from tandem.models.mtp_config import MTPConfig
    from tandem.trainer import cost
    from tandem.trainer.hf.export import export_hf
    from tandem.trainer.recipe import load_config

    model = TandemModel(flavors.model_config("debug_mla", max_seq_len=128), MTPConfig(num_steps=0))
    hf = tmp_path / "hf"
    export_hf(model, str(hf))
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 500)}}
    Tokenizer(models.WordLevel(vocab, unk_token="w1")).save(str(hf / "tokenizer.json"))
    recipe = _recipe(tmp_path, tmp_path / "run")
    argv = [str(recipe), f"model.init_from={hf}", "mtp.num_steps=1", "--nodes", "1",
            "--procs-per-node", "8", "parallel.ep=8"]
    assert launch_slurm_main(argv + ["--check"]) == 2  # 8 experts would have passed
    err = capsys.readouterr().err
    assert "model.num_experts=4 is not divisible by parallel.ep=8" in err, err
    assert launch_slurm_main(argv[:-1] + ["parallel.ep=4", "--check"]) == 0
    out, err = capsys.readouterr()
    assert "model.kv_lora_rank: 0 -> 16" in err, err
    # the attention layers' FLOPs are MLA's at the recipe's window
    seq_len = load_config(str(recipe), []).data.seq_len
    attn = cost.attention(model.cfg, seq_len).flops
    assert f"attn={attn / 1e6:.3g}M" in out, (attn, out)
    assert fake_sbatch.argv is None
    # a stage that has yet to run (either source): --check checks the recipe's own shape and says
    # so, and a job queued behind that stage is submitted
    later = tmp_path / "stage1"
    later.mkdir()
    for key in ("model.init_from", "mtp.init_from"):
        stage = argv[:1] + [f"{key}={later}"] + argv[2:-1] + ["parallel.ep=4"]
        assert launch_slurm_main(stage + ["--check"]) == 0, capsys.readouterr().err
        assert "the recipe's own model shape is checked" in capsys.readouterr().err
        assert launch_slurm_main(stage + ["--sbatch-arg=--dependency=afterok:41"]) == 0
        assert "submitted anyway, after --dependency=afterok:41" in capsys.readouterr().err
        fake_sbatch.log.unlink()
    # one that is there but cannot be read is an error, not a stage still to run
    (hf / "model.safetensors").unlink()
    assert launch_slurm_main(argv[:-1] + ["parallel.ep=4", "--check"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("tandem launch slurm: error:"), err
    assert "no *.safetensors" in err and err.endswith("; nothing submitted\n"), err
