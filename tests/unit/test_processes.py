"""tests/processes.py, the suite's forked processes, reports what a cold process would: exit codes
and signals, separate stdout and stderr, the environment's start-up effects, and a launch whose rank
fails stops its other ranks instead of hanging in their collective."""

import os
import signal
import sys
import textwrap

from tests import processes

SIGNAL_ITSELF = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"


def _code(source: str, *args, **kwargs):
    return processes.command([sys.executable, "-c", textwrap.dedent(source), *args], **kwargs)


def test_exit_code_output_and_exit_handlers_of_a_single_process(tmp_path):
    proc = _code("""
        import atexit, sys
        atexit.register(lambda: print("exit handler"))
        print("out", sys.argv[1:])
        print("err", file=sys.stderr)
        sys.exit(3)
        """, "a", "b", cwd=str(tmp_path))
    assert proc.returncode == 3
    assert proc.stdout == "out ['a', 'b']\nexit handler\n" and proc.stderr == "err\n"
    assert _code(SIGNAL_ITSELF).returncode == -signal.SIGKILL
    raised = _code("raise KeyError('missing')")
    assert raised.returncode == 1 and "KeyError: 'missing'" in raised.stderr


def test_environment_and_start_up_are_the_given_ones(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = '1'\n")
    proc = _code("""
        import os, torch, warnings
        warnings.warn("shown only without PYTHONWARNINGS=ignore")
        print(os.getcwd(), os.environ.get("SITE_RAN"), os.environ.get("ONLY_HERE"),
              "HOME" in os.environ, torch.get_num_threads())
        """, cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path), "ONLY_HERE": "x",
                                     "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path), "1", "x", "False", "1"]
    assert proc.stderr == ""


def test_a_failing_rank_stops_the_launch(tmp_path):
    proc = _code("""
        import os, torch.distributed as dist
        dist.init_process_group("gloo")
        print("rank", dist.get_rank(), "of", os.environ["WORLD_SIZE"], flush=True)
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 fails")
        dist.barrier()  # rank 0 waits here for a rank that is gone
        """, world=2, timeout=120, env=dict(os.environ, TORCH_DIST_INIT_BARRIER="0"))
    assert proc.returncode == 1, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]
    assert "RuntimeError: rank 1 fails" in proc.stderr and "rank 1 exited with 1" in proc.stderr
