"""The real CLI on several ranks: `tandem train recipes/tiny.yaml parallel.*` on the stdlib corpus
(the ranks forked as torchrun would start them, tests/processes.py; the README's documented torchrun
launches run torchrun itself, tests/e2e/test_readme_commands.py).

With dp=1 the per-step loss/main in metrics.jsonl equals the single-process run of the same recipe;
expert parallelism splits the batch over its ranks (Megatron: ep is carved out of data parallelism),
so ep=2 is compared with the single-process run of twice the gradient-accumulation steps, which by
the sampler's contract sees exactly the same samples per step.
"""

from __future__ import annotations

import json
import os

import pytest

from tests import processes
from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
# The tiny model and corpus slice of the distributed CLI tests (tp2 needs the 2 kv heads).
TINY_MODEL_DATA = DEBUG_MODEL + ["model.num_kv_heads=2"] + TINY_DATA + QUIET
SMALL = TINY_MODEL_DATA + [
    "train.max_steps=3", "train.grad_accum_steps=2", "train.eps=1e-6",
    # the in-loop evaluator at the last step: speculative decoding on the sharded model as trained
    "eval.interval=3", "eval.num_prompts=2", "eval.prompt_len=12", "eval.max_new_tokens=12",
    "eval.batch_size=2", "eval.loss_batches=1",
]
# The flagship recipe in miniature: its layout shape (tp x ep x pp, SP, interleaved 1F1B with 3
# stages per rank, layers and loss depths placed by pp_balance) at 8 ranks (tp2 x ep2 x pp2 instead
# of tp2 x ep4 x pp2: 16 processes are too many for a 2-core CI machine), with 4 layers.
FLAGSHIP = ["parallel.tp=2", "parallel.ep=2", "parallel.pp=2", "parallel.sequence_parallel=true",
            "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=3",
            "parallel.pp_balance=true", "model.num_layers=4"]
# Through the CLI only the flagship: each degree alone and the other combinations are compared with
# one process parameter by parameter in test_parallel_equivalence.py (pp=2, ep=2, tp=2, tp=2 + SP,
# tp=2 x pp=2, ...), and the in-loop evaluator under them in test_eval_layouts.py; what the CLI adds
# (the launcher, the data split, the run directory, evaluation in the loop) the flagship run shows,
# and test_cli_bf16_under_fsdp_and_ep below shows it in bf16 under FSDP and ep.
LAYOUTS = [(8, FLAGSHIP)]


def launch(world, args, env):
    """`tandem ARGS` on `world` ranks (tests/processes.py: forked, as torchrun would start them),
    asserted to succeed."""
    proc = processes.tandem(args, world=world, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def main_losses(run_dir):
    return {r["step"]: r["loss/main"] for r in records(run_dir) if "loss/main" in r}


def grad_norms(run_dir):
    """step -> the logged gradient norm before clipping: the tiny recipe clips at 1.0, below
    every step's norm, and clipping and Adam cancel a gradient's constant factor in the losses."""
    return {r["step"]: r["grad_norm"] for r in records(run_dir) if "grad_norm" in r}


EVAL_EXACT = ["eval/acceptance_length", "eval/draft_acceptance_rate",
              "eval/identical_to_autoregressive"]
EVAL_EXACT_FAMILIES = ("eval/accept_rate/pos_", "eval/T1/")
"""... and every per-position rate and speculative-sampling figure (eval.temperatures' default T=1,
seeded per batch: the same draws under any layout), the only check of sampled decoding under the
interleaved flagship placement with ep."""
# bf16 vs fp32 through the CLI (tiny recipe, 3 warm-up steps): measured 1e-6..1e-5 relative on the
# losses and eval losses; 10x that. fp32 layouts agree with one process to ~1e-7, so a gap > 1e-6
# shows bf16 in effect.
BF16_CLI_RTOL = 1e-4
EVAL_CLOSE = ["eval/loss/main", "eval/loss/mtp_1", "eval/loss/mtp_2", "eval/tf_acc/mtp_1"]


def eval_record(run_dir):
    return next((r for r in records(run_dir) if "eval/acceptance_length" in r), None)


class _References:
    def __init__(self, root, cache):
        self.root, self.runs, self.dirs = root, {}, {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        # the final checkpoint is saved too: DCP over the sharded parameters must work
        self.common = SMALL + [f"data.cache_dir={cache}"]

    def losses(self, accum: int, model=()):
        key = (accum, tuple(model))
        if key not in self.runs:
            run_dir = self.root / (f"single_accum{accum}"
                                   f"{''.join(m.replace('model.', '_') for m in model)}")
            launch(1, ["train", RECIPE, f"run.dir={run_dir}", *self.common,
                       f"train.grad_accum_steps={accum}", *model], self.env)
            self.runs[key], self.dirs[key] = (main_losses(run_dir), eval_record(run_dir)), run_dir
        return self.runs[key]

    def norms(self, accum: int, model=()):
        self.losses(accum, model)
        return grad_norms(self.dirs[(accum, tuple(model))])


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    return _References(tmp_path_factory.mktemp("cli"), corpus_cache)


@pytest.mark.parametrize("world,overrides", LAYOUTS, ids=[" ".join(o) for _, o in LAYOUTS])
def test_cli_layout_matches_single_process(world, overrides, references):
    """Losses and every eval/* acceptance figure as one process (the evaluator decodes under each
    layout)."""
    batch_ranks = 2 if "parallel.ep=2" in overrides else 1
    ref, ref_eval = references.losses(2 * batch_ranks,
                                      [o for o in overrides if o.startswith("model.")])
    root, env, common = references.root, references.env, references.common
    run_dir = root / ("_".join(o.replace("parallel.", "").replace("=", "") for o in overrides))
    launch(world, ["train", RECIPE, f"run.dir={run_dir}", *common, *overrides], env)
    got = main_losses(run_dir)
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step in ref:
        assert abs(got[step] - ref[step]) <= 1e-5 * abs(ref[step]), (step, got, ref)
    got, ref = grad_norms(run_dir), references.norms(2 * batch_ranks, [o for o in overrides
                                                                     if o.startswith("model.")])
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step in ref:
        assert abs(got[step] - ref[step]) <= 1e-5 * ref[step], (step, got, ref)
    got_eval = eval_record(run_dir)
    assert ref_eval is not None and got_eval is not None and got_eval["step"] == 3
    assert got_eval["eval/identical_to_autoregressive"] == 1.0
    family = [k for k in ref_eval if k.startswith(EVAL_EXACT_FAMILIES) and "/loss/" not in k]
    assert {f for f in EVAL_EXACT_FAMILIES if any(k.startswith(f) for k in family)} == set(
        EVAL_EXACT_FAMILIES), sorted(ref_eval)
    for key in EVAL_EXACT + family:
        assert got_eval[key] == ref_eval[key], (key, got_eval[key], ref_eval[key])
    for key in EVAL_CLOSE:
        assert abs(got_eval[key] - ref_eval[key]) <= 1e-5 * max(abs(ref_eval[key]),
                                                                1e-3), (key, got_eval, ref_eval)


def test_cli_bf16_under_fsdp_and_ep(references):
    """`train.dtype=bf16` through the real CLI: FSDP2 gathers bf16 parameters while the ep-sharded
    experts (kept out of FSDP at dp=1) stay fp32, and the in-loop evaluator decodes on that model
    under the same autocast. Losses and eval losses are bf16 roundings of the fp32 run's
    (BF16_CLI_RTOL)."""
    ref, ref_eval = references.losses(4)
    root, env, common = references.root, references.env, references.common
    run_dir = root / "ep2_bf16"
    launch(2, ["train", RECIPE, f"run.dir={run_dir}", *common, "parallel.ep=2",
               "train.dtype=bf16"], env)
    got, got_eval = main_losses(run_dir), eval_record(run_dir)
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    gaps = [abs(got[s] - ref[s]) / abs(ref[s]) for s in ref]
    gaps += [abs(got_eval[k] - ref_eval[k]) / abs(ref_eval[k]) for k in EVAL_CLOSE
             if k.startswith("eval/loss")]
    print(f"bf16 vs fp32 CLI gaps: {['%.1e' % g for g in gaps]}")
    assert max(gaps) < BF16_CLI_RTOL, gaps
    assert max(gaps) > 1e-6, "bf16 run identical to fp32: bf16 not in effect"
    assert got_eval["step"] == 3 and got_eval["eval/acceptance_length"] >= 1.0
