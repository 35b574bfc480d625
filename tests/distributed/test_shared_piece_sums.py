"""The gradient sums of the pipeline's shared pieces (embedding, final norm, head, MTP module held
by several pp ranks): one all-reduce per bucket (`gradients.launch_gradient_sums`) instead of one
per parameter, started by the pipeline as soon as the stages of a rank using a piece finished their
backward, not after the whole schedule. That the sums are right is test_parallel_equivalence.py's
job (these layouts, and the ones with pieces kept whole over dp x ep, match one process)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import worker

pytestmark = [pytest.mark.distributed]

# the MTP module (many parameters), head, norm and embedding on both pp ranks; and, interleaved, the
# embedding on rank 1's last stage (3) only, whose backward ends before that rank's stage 1's does
SPREAD = "pp=2,pp_layout=[4:0],pp_depth_stages=[1:0:1]"
INTERLEAVED = "pp=2,pp_schedule=interleaved_1f1b,train.dtype=bf16"
PIECES = ("embed_tokens", "norm", "lm_head", "mtp")


# the suite's shared 2-rank launch (shared_launch.py)
SHARED_JOBS = [(2, "tests.distributed.shared_sums_worker", [SPREAD, INTERLEAVED])]


@pytest.fixture(scope="module")
def runs(shared_jobs):
    return shared_jobs


def plan(layout):
    from tandem.trainer.parallel.pipeline_plan import PipelinePlan

    return PipelinePlan(worker.make_cfg(layout, worker.GRAD_ACCUM))


@pytest.mark.parametrize("layout", [SPREAD, INTERLEAVED])
def test_shared_piece_sums_are_bucketed(layout, runs):
    """Per step and rank, one all-reduce per group of pp ranks holding the same pieces (all fp32
    gradients, far below a bucket), where summing per parameter issued one per parameter (SPREAD:
    the MTP module's alone has more than ten)."""
    holders = plan(layout).holders()
    for rank in range(2):
        events = torch.load(runs / f"{layout}.rank{rank}.pt", weights_only=False)["events"]
        groups = {tuple(holders[p]) for p in PIECES if rank in holders[p] and len(holders[p]) > 1}
        per_step = [n for kind, _, n in events if kind == "sync"]
        started = sum(n for kind, _, n in events if kind == "start")
        assert len(per_step) == worker.STEPS, events
        assert sum(per_step) + started == worker.STEPS * len(groups) > 0, (rank, groups, events)


def test_shared_piece_sums_start_before_the_schedule_ends(runs):
    """Interleaved: rank 1 holds stages 1 and 3, the embedding's copy only on stage 3 (the MTP steps
    embed tokens t+k); its pp sum starts when stage 3's backward is done, while stage 1's last
    backward is still to run, and every shared piece's sum is started by the pipeline, not
    `sync`."""
    events = torch.load(runs / f"{INTERLEAVED}.rank1.pt", weights_only=False)["events"]
    step = events[:events.index(next(e for e in events if e[0] == "sync"))]
    order = [(kind, what) for kind, what, _ in step]
    assert order.index(("start", ["embed_tokens"])) < order.index(("stage_done", 1)), order
    assert [what for kind, what in order if kind == "start"] == [["embed_tokens"],
                                                                 ["lm_head", "mtp", "norm"]], order


@pytest.mark.parametrize("layout", [SPREAD, INTERLEAVED])
def test_a_second_backward_before_the_finisher_is_an_error(layout, runs):
    """The pipeline starts the shared pieces' sums inside its backward: a second forward_backward
    before clip_gradients would sum the first one's gradients twice, so it stops with a one-line
    error instead, on every rank holding a shared piece, before the step communicates."""
    errors = [torch.load(runs / f"{layout}.rank{r}.pt",
                         weights_only=False)["second_backward"] for r in range(2)]
    assert all("call it after every forward_backward" in e for e in errors), errors
