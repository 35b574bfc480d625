"""The documentation site builds with `mkdocs build --strict` (material theme, no network): a broken
link, a missing anchor or a page left out of the nav fails the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           os.path.join(ROOT, "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pages = sorted(n[:-3] for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    for page in pages:
        built = site / ("index.html" if page == "index" else os.path.join(page, "index.html"))
        assert built.is_file(), page
    # no font or asset fetched from the network at build or read time
    html = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in html and "fonts.gstatic.com" not in html


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs exactly the README's test command; a change to either must change both."""
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read().split("# --- README test command (keep identical to README.md) ---\n",
                            1)[1].strip()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"```bash\n{ci}\n```" in readme, ci


def test_the_torch_floor_is_the_version_ci_tests():
    """pyproject.toml asked for torch>=2.6 while the suite ran only on 2.13: on 2.6 Tandem failed
    at import, and `pip install -e .` kept the older torch a user had."""
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        pinned = re.search(r"torch==(\d+\.\d+)", f.read())
    assert pinned, ".ci/run pins no torch==X.Y"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        dependencies = f.read().split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    # "torch" and what follows it up to the closing quote, not torch-npu's
    floors = re.findall(r"""["']torch(?![\w.-])\s*([^"']*)["']""", dependencies)
    assert len(floors) == 1 and floors[0].split(",")[0] == f">={pinned.group(1)}", floors
