"""The newcomer's path: the product files that `tandem train recipes/tiny.yaml` enters before its
first loss value, and the direction of every call between them.

Traced with `sys.setprofile` in a fresh interpreter with the corpus prepared, from `cli.main()` to
the return of the first `TrainStep.__call__`; a file counts when a function in it runs (module
bodies run by imports do not). No call may go up a layer (models and data_pipeline below eval,
eval below trainer), and the number of files may not grow unnoticed: a file added to the path
raises MAX_FILES in the same change, and takes its place in docs/index.md's reading order, which
names each file once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tandem.data_pipeline.stdlib_corpus import prepare_stdlib_corpus
from tandem.trainer.recipe import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = ("models", "data_pipeline", "eval", "trainer")
"""Lowest first; models and data_pipeline import nothing from each other."""

MAX_FILES = 44
"""The path's files on this commit (docs/index.md, "Where things are", walks the path)."""

TRACE = textwrap.dedent("""
    import json, os, sys
    root, out = sys.argv[1], sys.argv[2]
    sys.argv = ["tandem", "train", *sys.argv[3:]]
    rel_of_code = {}

    def rel_of(code):
        rel = rel_of_code.get(code, 0)
        if rel == 0:
            path, rel = os.path.realpath(code.co_filename), None
            if os.path.isabs(code.co_filename) and path.startswith(root + os.sep):
                rel = os.path.relpath(path, root)
                rel = None if rel.startswith(("tests", "bench")) else rel
            rel_of_code[code] = rel
        return rel

    files, edges = {}, set()

    def profile(frame, event, arg):
        code = frame.f_code
        rel = rel_of(code)
        if rel is None:
            return
        if event == "return" and rel == "trainer/step.py" and code.co_name == "__call__":
            sys.setprofile(None)
            with open(out, "w") as f:
                json.dump({"files": list(files), "edges": sorted(edges)}, f)
            sys.stdout.flush()
            os._exit(0)
        if event != "call" or not code.co_flags & 0x2:  # functions only, not module bodies
            return
        files.setdefault(rel, code.co_name)
        caller = frame.f_back
        while caller is not None and rel_of(caller.f_code) is None:
            caller = caller.f_back
        if caller is not None and rel_of(caller.f_code) != rel:
            edges.add((f"{rel_of(caller.f_code)}:{caller.f_code.co_name}", f"{rel}:{code.co_name}"))

    from tandem.trainer import cli
    sys.setprofile(profile)
    cli.main()
""")


def _layer(site: str) -> int:
    return LAYERS.index(site.split("/")[0])


@pytest.mark.slow
def test_the_path_to_the_first_loss_calls_only_downward_through_few_files(tiny_overrides,
                                                                          tmp_path):
    out = tmp_path / "path.json"
    args = [os.path.realpath(ROOT), str(out), os.path.join(ROOT, "recipes", "tiny.yaml"),
            *tiny_overrides, "train.max_steps=1", "checkpoint.interval=0"]
    # the corpus prepared first, as after a first run: its one-time preparation is not the path
    prepare_stdlib_corpus(load_config(args[2], args[3:]).data)
    proc = subprocess.run([sys.executable, "-c", TRACE, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert out.exists(), proc.stderr[-3000:]
    traced = json.loads(out.read_text())
    files = traced["files"]
    assert files[0] == "trainer/cli.py" and "trainer/step.py" in files, files
    assert "models/model.py" in files and "data_pipeline/batches.py" in files, files
    up = [(a, b) for a, b in traced["edges"] if _layer(b) > _layer(a)]
    assert not up, f"calls up a layer: {up}"
    assert len(files) <= MAX_FILES, (f"{len(files)} files on the path, {MAX_FILES} before:\n"
                                     + "\n".join(files))
    _check_the_reading_order(files)


def _check_the_reading_order(files):
    """docs/index.md names every file of the path once: the fifteen that tell the story, then the
    rest."""
    page = open(os.path.join(ROOT, "docs", "index.md"), encoding="utf-8").read()
    story, rest = page.split("Fifteen of them tell the story")[1].split("## Next")[0].split(
        "The other ")
    named = {part: re.findall(r"`([\w/]+\.py)`", text) for part, text in (("story", story),
                                                                           ("rest", rest))}
    assert len(named["story"]) == 15, named["story"]

    def traced(name):
        hits = [f for f in files if f == name or f.endswith("/" + name)]
        assert len(hits) == 1, f"docs/index.md names {name}: on the path {hits}"
        return hits[0]

    shown = [traced(name) for name in named["story"] + named["rest"]]
    assert sorted(shown) == sorted(files), set(files) ^ set(shown)
    assert f"The other {len(files) - 15} " in page
