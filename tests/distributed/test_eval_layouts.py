"""The in-loop evaluator on parallel layouts equals one process: the same speculative greedy tokens
and every eval/* acceptance figure identical, teacher-forced losses within fp32 rounding.

Pipeline (1F1B and interleaved placements), sequence parallelism (decode steps on whole sequences),
expert parallelism (replicas decoding different prompts in lockstep for the all-to-alls, one of
them padding a slot) and data parallelism (FSDP), in the suite's one torchrun launch per world size
(tests/distributed/eval_worker.py, shared_launch.py); the single-process reference runs here.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import eval_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Each path in the fewest layouts that check it (the suite's budget); what covers a left-out layout
# is named. dp=2 and ep=2,pp=2: Qwen4-Exp's ep=2 and flagship shape below decode on replicas in
# lockstep with FSDP over their batch ranks; tp=2,pp=2 + SP (1F1B): Qwen4-Exp's flagship shape; the
# plain interleaved schedule: the flagship placement below.
LAYOUTS = {
    # loss depths spread (layout lists separated by `:`): MTP depth 1 on the trunk's stage, the head
    # (the driver) and depth 2 on the next, so the decoder routes depth 1 to the other rank ...
    "pp=2,pp_layout=[4:0],pp_depth_stages=[1:0:1]": 2,
    # ... and the head on the trunk's stage with both MTP depths on the other rank (no MTP layer
    # where the head is: that rank drafts every depth the serving way, on one cache, and each depth
    # where it is placed for the tandem convention's figure), with weights whose drafts differ
    # between the conventions (it drafted as trained, under the serving name, and matched the
    # agreeing weights' serving figure)
    f"pp=2,pp_layout=[4:0],pp_depth_stages=[0:1:1],{eval_worker.DRAFTER_CONTEXT}": 2,
    # context parallelism: the cp ranks decode as extra replicas (whole sequences; the switch turns
    # the chunks off around decoding, and SP's with them), the teacher-forced losses run on each
    # rank's chunks of the windows, as training does
    "cp=2,tp=2,sequence_parallel=true": 4,
    # ... and under a pipeline, whose driver runs the teacher-forced windows whole (it says so)
    "cp=2,pp=2": 4,
    # MLA (DeepSeek-V3's attention) decodes over cached latents with kv_b_proj absorbed: each tp
    # rank its own heads' expansion, the latents replicated; weights whose tokens depend on the
    # attention
    f"tp=2,sequence_parallel=true,preset.mla=1,{eval_worker.HISTORY}": 2,
    # the flagship recipe's stage placement (interleaved with 3 stages per rank, layers and depths
    # placed by pp_balance) under tp + SP, 4 ranks; with ep as well (8 ranks) through the CLI with
    # trained weights (test_cli_layouts.py), and Qwen4-Exp's flagship shape below
    "tp=2,pp=2,sequence_parallel=true,pp_schedule=interleaved_1f1b,pp_virtual_stages=3,"
    "pp_balance=true": 4,
}
# Qwen4-Exp (eval_worker.QWEN4_*; its own one-process reference): the hc_count x hidden streams
# between stages, PLE's token ids on every stage, stage caches with the decoder's ring size and
# row_end for a padded prefill longer than a ring (Gated DeltaNet's chunked form), QSA recall from
# every rank's layers; weights that make the tokens depend on every layer's recurrent state
# (eval_worker.HISTORY) on the even split (Gated DeltaNet + PLE and QSA on the follower); agreeing
# weights with the depths spread: the driver holds the head only, the trunk and both MTP depths (one
# stage: they reuse depth 1's QSA selection) with their stream mixer run on the other rank, both
# conventions (the serving one reads depth 1's selection k - 1 positions back there).
Q4_LAYOUTS = {
    f"pp=2,preset.qwen4=1,{eval_worker.HISTORY}": 2,
    "pp=2,pp_layout=[4:0],pp_depth_stages=[1:0:0],preset.qwen4=1": 2,
    # expert parallelism: replicas decoding different prompts in lockstep through the all-to-alls
    # and the PLE lookup, the hybrid layers FSDP-sharded over the batch ranks, PLE tables sharded
    # outside it (which covers dp=2)
    "ep=2,preset.qwen4=1": 2,
    # the flagship layout shape, tp x ep x pp + SP (1F1B), which covers tp=2 + SP: each rank's
    # decoder state holds its own Gated DeltaNet / QSA heads, the QSA indexer keys and selections
    # are replicated, and under SP the decode steps run on whole sequences
    f"tp=2,ep=2,pp=2,sequence_parallel=true,preset.qwen4=1,{eval_worker.HISTORY}": 8,
    # context parallelism: the teacher-forced pass on each rank's chunks (Gated DeltaNet's carried
    # state, QSA's gathered keys) and QSA's recall the mean of the ranks' equal shares
    "cp=2,preset.qwen4=1": 2,
}
EXACT = ["eval/acceptance_length", "eval/draft_acceptance_rate", "eval/accept_rate/pos_1",
         "eval/accept_rate/pos_2",
         "eval/identical_to_autoregressive", "eval/distinct_2", "eval/distinct_4",
         # speculative sampling at T=1 (eval.temperatures default), seeded per batch: the same draws
         # anywhere
         "eval/T1/acceptance_length", "eval/T1/draft_acceptance_rate", "eval/T1/accept_rate/pos_1",
         "eval/T1/accept_rate/pos_2"]
CLOSE = ["eval/loss/main", "eval/loss/mtp_1", "eval/loss/mtp_2", "eval/tf_acc/mtp_1",
         "eval/tf_acc/mtp_2"]


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return eval_worker.evaluate("single")


def _by_world() -> dict:
    by_world = {}
    for layout, world in {**LAYOUTS, **Q4_LAYOUTS}.items():
        by_world.setdefault(world, []).append(layout)
    return by_world


# one job per world size in the suite's shared launches (tests/distributed/shared_launch.py)
SHARED_JOBS = [(world, eval_worker.__name__, layouts) for world, layouts in _by_world().items()]


@pytest.fixture(scope="module")
def runs(shared_launches):
    name = __name__.rsplit(".", 1)[-1]
    try:
        return shared_launches.check(name)
    except AssertionError as exc:
        # the launch's report last: it ends with the dead rank's native stack and the exit note
        raise AssertionError(f"{stack_report(shared_launches.dir(name))}\n{exc}") from None


def stack_report(out) -> str:
    """Every rank's stack file (eval_worker.record_stacks: the layout each rank was on and, if it
    died of a signal or was stopped by the launcher after another rank died, where each thread
    was); the ranks that died of a signal last and longer. No relaunch: a crash is a defect to
    find, not a flake to retry."""
    files = sorted((out / "stacks").glob("rank*.txt")) if (out / "stacks").is_dir() else []
    texts = [(path.name, path.read_text()) for path in files]
    texts.sort(key=lambda named: "Fatal Python error" in named[1])
    return "\n".join(f"--- {name} ---\n"
                     f"{text[-4000:] if 'Fatal Python error' in text else text[-1500:]}"
                     for name, text in texts)


def test_reference_exercises_acceptance(reference):
    m = reference["metrics"]
    assert m["eval/identical_to_autoregressive"] == 1.0
    assert 1.2 < m["eval/acceptance_length"] < 3.0  # drafts partly accepted, not all or none
    assert len(reference["outputs"]) == 5 and all(len(o) == eval_worker.MAX_NEW_TOKENS
                                                 for o in reference["outputs"])
    assert m["eval/seconds"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_layout_matches_single_process(layout, runs, reference, layout_references):
    single = reference_layout(layout)
    assert_matches_single_process(layout, runs,
                                  reference if single == "single" else layout_references[single])


def assert_matches_single_process(layout, runs, reference):
    got = torch.load(runs / f"{layout}.pt", weights_only=False)
    assert got["outputs"] == reference["outputs"]
    assert got["samples"] == reference["samples"]  # ids and per-sample acceptance, greedy and T=1
    ref = reference["metrics"]
    # and the other drafting convention's figure (`eval/tandem/acceptance_length`)
    for key in EXACT + [k for k in ref if k.endswith("/acceptance_length")]:
        assert got["metrics"][key] == ref[key], (layout, key, got["metrics"][key], ref[key])
    for key in CLOSE:
        assert abs(got["metrics"][key] - ref[key]) <= 1e-5 * max(abs(ref[key]), 1e-3), (layout, key)
    assert set(got["metrics"]) == set(ref)


def test_context_parallel_teacher_forcing_keeps_the_windows_split(runs, reference):
    """Under cp the evaluator's teacher-forced windows stay split as in training: no rank looks up
    a whole window (at the 256k stage, 32 ranks' worth of activations). Decode forwards are shorter
    than half a window here (prompts of at most 8 tokens, then K + 1 per step)."""
    window = eval_worker.worker.SEQ
    assert reference["widest_lookup"] == window
    got = torch.load(runs / "cp=2,tp=2,sequence_parallel=true.pt", weights_only=False)
    assert got["widest_lookup"] == window // 2, got["widest_lookup"]


def reference_layout(layout: str) -> str:
    """The one-process layout a case compares with: its dotted keys and weights."""
    kept = [kv for kv in layout.split(",") if "." in kv.split("=")[0] or kv.startswith("weights=")]
    return ",".join(["single"] + kept)


class _References(dict):
    def __missing__(self, single: str):
        torch.set_num_threads(1)
        self[single] = eval_worker.evaluate(single)
        return self[single]


@pytest.fixture(scope="module")
def layout_references():
    return _References()


@pytest.mark.parametrize("layout", list(Q4_LAYOUTS))
def test_qwen4_eval_layout_matches_single_process(layout, runs, layout_references):
    history = eval_worker.HISTORY in layout.split(",")
    reference = layout_references[reference_layout(layout)]
    ref = reference["metrics"]
    assert ref["eval/identical_to_autoregressive"] == 1.0
    assert ref["eval/acceptance_length"] > (1.0 if history else 1.2)  # some drafts accepted
    assert_matches_single_process(layout, runs, reference)
    got = torch.load(runs / f"{layout}.pt", weights_only=False)["metrics"]
    assert abs(got["eval/qsa_recall"] - ref["eval/qsa_recall"]) <= 1e-5 * ref["eval/qsa_recall"], \
        (got["eval/qsa_recall"], ref["eval/qsa_recall"])
