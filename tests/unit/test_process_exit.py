"""A rank of a multi-process `tandem` launch leaves without the interpreter's finalisation, where
gloo's threads can abort a finished run (trainer/parallel/layout.leave_distributed_process): its
exit code, exit handlers and output stay those of a normal exit; a single process exits normally."""

import os
import subprocess
import sys

from tests.distributed.torchrun import ROOT

# an exit handler (wandb's, logging's) and a finaliser that only interpreter shutdown runs
SCRIPT = """
import atexit, sys
class Finalised:
    def __del__(self):
        print("finalised", flush=True)
KEEP = Finalised()
atexit.register(lambda: print("exit handler", flush=True))
sys.argv = ["tandem", "no-such-command"]
from tandem.trainer.cli import main
sys.exit(main())
"""


def _run(world: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, WORLD_SIZE=world), timeout=120)


def test_a_rank_of_a_launch_skips_finalisation_but_keeps_its_code_and_exit_handlers():
    proc = _run("2")
    assert proc.returncode == 2  # the command's code (unknown command)
    assert "unknown command 'no-such-command'" in proc.stderr
    assert proc.stdout.split() == ["exit", "handler"]  # handlers ran; finalisation did not


def test_a_single_process_exits_normally():
    proc = _run("1")
    assert proc.returncode == 2
    assert proc.stdout.split() == ["exit", "handler", "finalised"]
