"""`tandem generate` under torchrun (dp2: batches dealt over two replicas, one padding slot; tp2:
the model sharded over two ranks; pp2: two stages) writes byte for byte the file one process
writes, greedy, sampled (same seed) and drafting past the trained depths, from a Tandem checkpoint
and (tp2) from its Hugging Face export, each rank reading only its shards of the safetensors. Run
as a script, this file is the torchrun worker: one launch and process group for every layout and
decode. The first decode starts while the checkpoint's run directory publishes a newer step, which
rank 0 sees and rank 1 does not: rank 1 used to decode the older one into the same file.

A write that fails on the writer (a full disk, injected at its second batch) returns 2 on every
rank, under pp2 (the follower stage's rank is released) and dp2 (the other replica stops decoding),
in a process group that outlives the command; the other ranks used to wait for the writer forever.
Run again, each resumes to one process's file.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import processes
from tests.conftest import fault_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 5 prompts in batches of 2: three batches, so two replicas split them unevenly (one pads a slot)
PROMPTS = ["def main():\n", "import os\n", "class Foo:", "x = 1\n", "for i in range(3):\n"]
COMMON = ["--max-new-tokens", "6", "--batch-size", "2"]
CASES = {"greedy": [],
         "sampled": ["--temperature", "0.8", "--top-p", "0.9", "--samples-per-prompt", "2",
                                   "--seed", "3"],
         # drafting past the trained K=2, as a looped module may: under pp the depths past the
         # trained ones were looked up past the stage placement, and the first draft crashed
         "longer": ["--num-steps", "4"]}
LAYOUTS = {"dp2": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
FAULT_LAYOUTS = {"pp2": ["--pp", "2"], "dp2": []}
"""Where a failed write is injected: a pipeline follower and a second replica wait on the writer."""
SOURCES = {"checkpoint": ("dp2", "tp2", "pp2"), "hf": ("tp2",)}
"""Where each source runs: a Tandem checkpoint on both layouts, its Hugging Face export sharded
over tp (the one-process --hf load is tests/e2e/test_generate.py's)."""


def _args(source: str, path: str, prompts: str, case: str, out: str) -> list:
    return [f"--{source}", path, "--prompts", prompts, *COMMON, *CASES[case], "--out", out]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache):
    """A tiny checkpoint (2 kv heads for tp2) and its Hugging Face export, the prompts, and one
    process's file of each source and case."""
    from tandem.trainer.cli import main as cli
    from tandem.trainer.generate import generate_main
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("generate_layouts")
    train(load_config("recipes/tiny.yaml", TINY_OVERRIDES + [
        f"run.dir={root / 'run'}", "train.max_steps=2", "checkpoint.interval=1",
        "model.num_kv_heads=2", f"data.cache_dir={corpus_cache}"]))
    assert cli(["export", "--checkpoint", str(root / "run"), "--out", str(root / "hf")]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    files = {}
    for source in SOURCES:
        for case in CASES:
            files[source, case] = root / f"single_{source}_{case}.jsonl"
            args = _args(source, str(root / ("run" if source == "checkpoint" else "hf")),
                         str(prompts), case, str(files[source, case]))
            assert generate_main(args) == 0
    return root, files


@pytest.fixture(scope="module")
def launched(reference):
    """Both layouts in one 2-rank launch (its start costs as much as a layout's decoding)."""
    root, _ = reference
    for layout in [*LAYOUTS, "failed"]:
        (root / layout).mkdir()
    # the first decode's ranks look up the run's newest checkpoint around its publication: rank 1
    # before (step_1), rank 0 after (step_2); every rank must decode rank 0's, as one process does
    step_2 = root / "run" / "checkpoints" / "step_2"
    os.rename(step_2, root / "staged_step_2")
    env = fault_env(dict(os.environ), TANDEM_TEST_PUBLISH_AT_START=f"{root / 'staged_step_2'}:"
                                                                   f"{step_2}")
    proc = processes.command([sys.executable, "-m", __name__, root, *LAYOUTS], 2, timeout=300,
                              env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_writes_what_one_process_writes(layout, reference, launched):
    _, files = reference
    out = launched / layout
    for source in [s for s, layouts in SOURCES.items() if layout in layouts]:
        for case in CASES:
            single = files[source, case]
            got = (out / f"{source}_{case}.jsonl").read_text()
            assert len(got.splitlines()) == len(PROMPTS) * (2 if case == "sampled" else 1)
            assert got == single.read_text(), (source, case)
            meta = (out / f"{source}_{case}.jsonl.meta.json").read_text()
            assert meta == open(f"{single}.meta.json").read(), (source, case)


def test_a_failed_write_stops_every_rank_and_a_rerun_resumes(reference, launched):
    _, files = reference
    for layout in FAULT_LAYOUTS:
        got = (launched / "failed" / f"{layout}.jsonl").read_text()
        assert got == files["checkpoint", "greedy"].read_text(), layout


def _failing_writes(layout: str, root: str) -> None:
    """Each layout of FAULT_LAYOUTS: the writer's second write fails (every rank returns 2, having
    kept the first batch's rows), then a rerun resumes."""
    import errno

    from tandem.trainer import generate

    write, calls = generate.write_lines, []

    def full_disk_at_the_second(path, rows, mode):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return write(path, rows, mode)

    out = os.path.join(root, "failed", f"{layout}.jsonl")
    args = _args("checkpoint", os.path.join(root, "run"), os.path.join(root, "prompts.jsonl"),
                 "greedy", out) + FAULT_LAYOUTS[layout]
    generate.write_lines = full_disk_at_the_second
    try:
        assert generate.generate_main(args) == 2, layout
    finally:
        generate.write_lines = write
    assert generate.generate_main(args) == 0, layout


def _worker(root: str, *layouts: str) -> int:
    import torch
    import torch.distributed as dist

    from tandem.trainer.generate import generate_main

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for layout in layouts:
        for source in [s for s, runs_on in SOURCES.items() if layout in runs_on]:
            path = os.path.join(root, "run" if source == "checkpoint" else "hf")
            for case in CASES:
                rc = generate_main(_args(source, path, os.path.join(root, "prompts.jsonl"), case,
                                         os.path.join(root, layout, f"{source}_{case}.jsonl"))
                                   + LAYOUTS[layout])
                assert rc == 0, (layout, source, case, rc)
    for layout in FAULT_LAYOUTS:
        _failing_writes(layout, root)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: _worker(*sys.argv[1:]))
