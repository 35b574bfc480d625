"""Every command the README shows runs: its ```bash blocks are parsed and each `tandem` / `torchrun`
command is executed as written, with only tiny-model overrides and a 2-step budget appended (later
`key=value` overrides win), so the documentation cannot rot.

`pip install ... && X` lines test X; `python -m pytest` is what this suite is, and is not recursed into.
The evaluator runs at step 2 of every command (small prompt set), so each documented layout also
shows it logs `eval/*`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
# the suite's tiny model and corpus slice (tests/conftest.py), with 2 kv heads for tp=2, 2 steps and
# an evaluation at step 2 (later overrides win)
TINY = TINY_OVERRIDES + [
    "model.num_kv_heads=2", "train.warmup_steps=1", "train.max_steps=2", "checkpoint.interval=0",
    "eval.interval=2", "eval.num_prompts=2", "eval.prompt_len=8", "eval.max_new_tokens=6", "eval.batch_size=2",
    "eval.loss_batches=1",
]


def readme_commands():
    """The runnable commands of the README's bash blocks, as written."""
    with open(README) as f:
        text = f.read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for part in (p.strip() for p in line.split("&&")):
                if part.startswith("pip ") or "-m pytest" in part:
                    continue
                out.append(part)
    return out


COMMANDS = readme_commands()


def cli_layouts_command(command: str):
    """The torchrun layout of `tests/distributed/test_cli_layouts.py` this README command is, if any:
    that test runs the same launcher, recipe and parallel flags (tiny overrides appended, 3 steps and an
    evaluation) and checks losses and acceptance against one process, so it runs it here too."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
    from test_cli_layouts import LAYOUTS, RECIPE

    argv = shlex.split(command)
    prefix = ["torchrun", "--nproc-per-node"]
    if argv[:2] != prefix or argv[3:7] != ["--no-python", "tandem", "train", os.path.relpath(RECIPE, ROOT)]:
        return None
    world, flags = int(argv[2]), argv[7:]
    return next(((w, o) for w, o in LAYOUTS if w == world and o == flags), None)


def test_readme_shows_the_commands_this_test_runs():
    assert any(c.startswith("tandem train recipes/tiny.yaml") for c in COMMANDS), COMMANDS
    assert sum(c.startswith("torchrun") for c in COMMANDS) >= 4, COMMANDS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_torchrun_layouts_are_checked_by_the_cli_layout_test():
    """The README's basic torchrun layouts of the tiny recipe are run (and compared with one process) by
    test_cli_layouts.py: at least the pp, ep, tp, tp+SP and tp x pp commands."""
    covered = [c for c in COMMANDS if cli_layouts_command(c)]
    assert len(covered) >= 5, covered


@pytest.mark.parametrize("command", [c for c in COMMANDS if cli_layouts_command(c) is None])
def test_readme_command_runs(command, tmp_path, corpus_cache):
    argv = shlex.split(command)
    assert argv[0] in ("tandem", "torchrun"), f"unexpected README command {command!r}"
    if argv[0] == "torchrun":  # the same launcher, from this interpreter
        argv = [sys.executable, "-m", "torch.distributed.run"] + argv[1:]
    run_dir = tmp_path / "run"
    argv += TINY + [f"data.cache_dir={corpus_cache}", f"run.dir={run_dir}"]
    bin_dir = os.path.dirname(sys.executable)
    # a free rendezvous port through torchrun's environment (the command line stays as written)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", PET_MASTER_PORT=str(_free_port()))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in records if "loss/main" in r] == [1, 2]
    evals = [r for r in records if "eval/acceptance_length" in r]
    assert len(evals) == 1 and evals[0]["step"] == 2, (command, proc.stderr[-2000:])
    assert evals[0]["eval/identical_to_autoregressive"] == 1.0
