"""The evaluator's teacher-forced figures under tensor parallelism (issue 20, item 4): the
vocab-parallel head keeps its vocabulary shard (no gathered [tokens x vocab] logits, no tensor wider
than a chunk of the shard) and gives one device's losses and top-1 accuracies, ties included (the
first vocab id wins, as argmax over the whole vocabulary picks it).

This file is also the worker, run in the suite's shared 2-rank launch (tp=2); each rank builds
tests/unit/test_eval_teacher_forced.py's trained tiny model and swaps its head for the
vocab-parallel one trainer/parallel/tensor.py installs."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import processes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


SHARED_JOBS = [(2, __name__, [])]  # the suite's shared 2-rank launch (shared_launch.py)


def test_vocab_parallel_teacher_forced(shared_jobs):
    for rank in range(2):
        with open(shared_jobs / f"rank{rank}.json") as f:
            r = json.load(f)
        for variant in ("trained", "ties"):
            want, got = r[variant]["one_device"], r[variant]["tp"]
            assert set(got) == set(want)
            for key, value in want.items():
                if key.startswith("tf_acc/"):
                    assert got[key] == value, (variant, key)
                else:
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=0), (variant, key)
        assert 0.05 < r["trained"]["one_device"]["tf_acc/mtp_1"] < 0.95
        # the largest tensor with a vocabulary dimension: at most one chunk of this rank's shard
        assert 0 < r["largest_vocab_tensor"] <= r["chunk"] * r["vocab"] // 2, r
        assert r["largest_full_vocab_tensor"] == 0, r


def main(argv) -> int:
    out_dir = argv[0]
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.eval.metrics import teacher_forced
    from tandem.trainer.parallel.tensor import VocabParallelHead
    from tests.unit import test_eval_teacher_forced as unit

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    trained = unit.trained_model()  # identical weights on both ranks
    data = unit.batches()
    ties = copy.deepcopy(trained)
    # every logit of the second shard equals the first's: argmax ties across ranks,
    with torch.no_grad():
        # which one device resolves to the first half (targets in the second are never predicted)
        half = unit.VOCAB // 2
        ties.lm_head.weight[half:] = ties.lm_head.weight[:half]
    result = {"chunk": unit.CHUNK, "vocab": unit.VOCAB}
    largest = {"any": 0, "full": 0}

    class Widest(unit.LargestVocabTensor):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in (unit.VOCAB,
                                                                                        unit.VOCAB
                                                                                        // 2):
                        largest["any"] = max(largest["any"], t.numel())
                        if t.shape[-1] == unit.VOCAB:
                            largest["full"] = max(largest["full"], t.numel())
            return out

    for name, model in (("trained", trained), ("ties", ties)):
        one = teacher_forced(model, data)
        weight = model.lm_head.weight
        model.lm_head = VocabParallelHead(weight, mesh["tp"])
        with Widest():
            tp = teacher_forced(model, data)
        result[name] = {"one_device": one, "tp": tp}
    result["largest_vocab_tensor"], result["largest_full_vocab_tensor"] = (
        largest["any"],
        largest["full"],
    )
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    # both ranks done before the group goes (a rank tearing down early aborts its peer)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    processes.finish(lambda: main(sys.argv[1:]))
