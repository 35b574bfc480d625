"""`parallel.dp_mode=allreduce` runs on torch's own replicate (FSDP2's machinery with replicated
parameters): gradients are all-reduced per module *during* backward, as soon as each block's
gradients are final: in every micro-batch's backward by default
(`parallel.reshard_after_microbatch`), or only in the last one's with reshard_after_microbatch=false
(the earlier micro-batches' gradients accumulate locally, no communication). That the sums are right
is test_parallel_equivalence.py's job (every all-reduce layout matches one process, in both
modes)."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.distributed]

WORKER = "tests.distributed.allreduce_overlap_worker"
SHARED_JOBS = [(2, WORKER, [])]  # the suite's shared 2-rank launch (shared_launch.py)


def test_allreduce_mode_overlaps_each_backward_or_the_last_only(shared_jobs):
    printed = "".join((shared_jobs / f"stdout.allreduce_overlap_worker.rank{r}").read_text()
                      for r in range(2))
    found = re.findall(r"rank\d every=(True|False) micro_batches=(\d+) blocks=(\d+) "
                       r"all_reduces_in_backward=([\d,]+)",
                       printed)
    assert sorted(every for every, *_ in found) == ["False", "False", "True", "True"], printed
    for every, micro, blocks, per_backward in found:
        per_backward = [int(n) for n in per_backward.split(",")]
        assert len(per_backward) == int(micro) >= 2, per_backward
        # one all-reduce per block at least (its own parameters, its experts), plus the root's
        assert per_backward[-1] >= int(blocks) + 1, per_backward
        if every == "True":  # each micro-batch's backward syncs like the last one
            assert per_backward[:-1] == per_backward[-1:] * (len(per_backward) - 1), per_backward
        else:  # accumulation: no communication before the last backward
            assert all(n == 0 for n in per_backward[:-1]), per_backward
