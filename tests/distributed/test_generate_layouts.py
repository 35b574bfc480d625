"""`tandem generate` under torchrun (dp2: batches dealt over two replicas, one padding slot; tp2:
the model sharded over two ranks) writes byte for byte the file one process writes, greedy and
sampled (same seed). Run as a script, this file is the torchrun worker: one process group, both
decodes.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.distributed import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 5 prompts in batches of 2: three batches, so two replicas split them unevenly (one pads a slot)
PROMPTS = ["def main():\n", "import os\n", "class Foo:", "x = 1\n", "for i in range(3):\n"]
COMMON = ["--max-new-tokens", "6", "--batch-size", "2"]
CASES = {"greedy": [],
         "sampled": ["--temperature", "0.8", "--top-p", "0.9", "--samples-per-prompt", "2",
                                   "--seed", "3"]}
LAYOUTS = {"dp2": [], "tp2": ["--tp", "2"]}


def _args(ckpt: str, prompts: str, case: str, out: str) -> list:
    return ["--checkpoint", ckpt, "--prompts", prompts, *COMMON, *CASES[case], "--out", out]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_cache, one_thread):
    """A tiny checkpoint (2 kv heads for tp2), the prompts, and one process's file of each case."""
    from tandem.trainer.generate import generate_main
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config
    from tests.conftest import TINY_OVERRIDES

    root = tmp_path_factory.mktemp("generate_layouts")
    train(load_config("recipes/tiny.yaml", TINY_OVERRIDES + [
        f"run.dir={root / 'run'}", "train.max_steps=2", "model.num_kv_heads=2",
        f"data.cache_dir={corpus_cache}"]))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    files = {}
    for case in CASES:
        files[case] = root / f"single_{case}.jsonl"
        assert generate_main(_args(str(root / "run"), str(prompts), case, str(files[case]))) == 0
    return root, files


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_writes_what_one_process_writes(layout, reference):
    root, files = reference
    out = root / layout
    out.mkdir()
    proc = torchrun.run(2, __name__, root / "run", root / "prompts.jsonl", out, *LAYOUTS[layout],
                        timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    for case, single in files.items():
        got = (out / f"{case}.jsonl").read_text()
        assert len(got.splitlines()) == len(PROMPTS) * (2 if case == "sampled" else 1)
        assert got == single.read_text(), case
        assert (out / f"{case}.jsonl.meta.json").read_text() == open(f"{single}.meta.json").read()


def _worker(ckpt: str, prompts: str, out: str, *layout: str) -> int:
    import torch
    import torch.distributed as dist

    from tandem.trainer.generate import generate_main

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case in CASES:
        rc = generate_main(_args(ckpt, prompts, case,
                                 os.path.join(out, f"{case}.jsonl")) + list(layout))
        assert rc == 0, (case, rc)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    torchrun.finish(lambda: _worker(*sys.argv[1:]))
