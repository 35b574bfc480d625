"""`ruff check .` with the project's configuration (pyproject.toml [tool.ruff]) passes: pyflakes,
import order and line length hold in every file, product code, tests and benchmarks alike."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    done = subprocess.run(cmd + ["check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
