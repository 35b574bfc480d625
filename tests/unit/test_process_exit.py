"""A rank of a multi-process `tandem` launch leaves without the interpreter's finalisation, where
gloo's threads can abort a finished run (trainer/parallel/layout.leave_distributed_process): its
exit code, exit handlers and output stay those of a normal exit, a failing rank's too
(`run_as_process`, the entry of `tandem` and of the bench and test workers); a single process
exits normally."""

import os
import subprocess
import sys

from tests.processes import ROOT

# an exit handler (wandb's, logging's) and a finaliser that only interpreter shutdown runs
HANDLERS = """
import atexit, sys
class Finalised:
    def __del__(self):
        print("finalised", flush=True)
KEEP = Finalised()
atexit.register(lambda: print("exit handler", flush=True))
"""

SCRIPT = HANDLERS + """
sys.argv = ["tandem", "no-such-command"]
from tandem.trainer.cli import main
sys.exit(main())
"""


def _run(world: str, script: str = SCRIPT, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, WORLD_SIZE=world), timeout=120)


def test_a_rank_of_a_launch_skips_finalisation_but_keeps_its_code_and_exit_handlers():
    proc = _run("2")
    assert proc.returncode == 2  # the command's code (unknown command)
    assert "unknown command 'no-such-command'" in proc.stderr
    assert proc.stdout.split() == ["exit", "handler"]  # handlers ran; finalisation did not


def test_a_single_process_exits_normally():
    proc = _run("1")
    assert proc.returncode == 2
    assert proc.stdout.split() == ["exit", "handler", "finalised"]


RAISING = HANDLERS + """
from tandem.trainer.parallel.layout import run_as_process
def main():
    if sys.argv[1] == "raise":
        raise RuntimeError("the command failed")
    raise SystemExit("bench.py: the layout failed under torchrun")
sys.exit(run_as_process(main))
"""


def test_a_failing_rank_reports_its_error_and_leaves_with_code_1_without_finalisation():
    for how, message in (("raise", "RuntimeError: the command failed"),
                         ("exit", "bench.py: the layout failed under torchrun")):
        proc = _run("2", RAISING, how)
        assert proc.returncode == 1, proc.stderr
        assert message in proc.stderr
        assert proc.stdout.split() == ["exit", "handler"]
        if how == "raise":
            assert "Traceback" in proc.stderr
