"""The benchmarks run (tiny sizes, a couple of steps), so they cannot rot between the runs that
produce the figures of docs/results.md."""

from __future__ import annotations

import os
import sys

import pytest

from tests import processes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mtp_objectives_bench(tiny_base, tmp_path):
    """Looped MTP (`ce`) against parallel heads over 2 seeds: every run trains, each variant's mean
    row parses, the pair and block-vs-token verification are compared with intervals and a verdict,
    and the summary line names the best variant with its significance."""
    cmd = [sys.executable, "bench/mtp_objectives.py", "--steps", "2", "--seeds", "2",
           "--objectives", "ce,parallel_heads", "--num-prompts", "2", "--prompt-len", "8",
           "--max-new-tokens", "6", "--out", str(tmp_path), *tiny_base]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines
            if line.split()[0] in ("ce", "parallel_heads")}
    assert set(rows) == {"ce", "parallel_heads"}
    for row in rows.values():
        greedy, sampled = float(row[1]), float(row[2])
        assert 1.0 <= greedy <= 3.0 and 1.0 <= sampled <= 3.0  # K=2: at most 3 tokens per verify
    assert "[greedy] acceptance_length: ce vs parallel_heads (2 seeds x 2 prompts)" in lines
    verdicts = [line for line in lines if line.lstrip().startswith("difference ")]
    assert len(verdicts) == 4 and all(v.endswith(("significant=yes",
                                                  "significant=no")) for v in verdicts)
    summary = dict(field.split("=") for field in lines[-1].split())
    assert summary["best_greedy"] in rows and summary["best_t1"] in rows
    assert {summary["best_greedy_significant"],
            summary["ce.block_minus_token_t1_significant"]} <= {"yes", "no"}
    for objective in ("ce", "parallel_heads"):
        for seed in (1234, 1235):  # the recipe's train.seed, then the next
            assert os.path.isdir(tmp_path / objective / f"seed_{seed}" / "checkpoints")


def test_throughput_bench():
    """Tandem vs transformers' Qwen3-MoE at tiny sizes, as docs/results.md runs it (bf16 autocast,
    Tandem's blocks compiled as well as eager): same parameter count (the config mapping holds),
    every runner steps, and the ratio lines are printed last."""
    flags = ["--dtype", "bf16", "--compile", "--head-backward", "fused"]
    cmd = [sys.executable, "bench/throughput.py", "--layers", "1", "--hidden", "64", "--heads", "2",
           "--kv-heads", "1",
           "--experts", "4", "--moe-width", "32", "--vocab", "128", "--seq-len", "16", "--batch",
           "2", "--steps", "1", "--k", "2", *flags]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "parameters tandem 0.05M, transformers 0.05M" in lines[0]
    runners = {"tandem_k0", "tandem_k2", "transformers", "tandem_k0_compiled"}
    assert {line.split(":")[0] for line in lines[1:1 + len(runners)]} == runners
    assert lines[-6].startswith("fastest-step ratios: ")
    ratios = [line.split("=")[0] for line in lines[-5:-1]]
    assert ratios == ["tandem_k2_over_transformers_k0", "tandem_k2_over_k0: step_time",
                      "tandem_eager_over_transformers_eager",
                      "tandem_compiled_over_transformers_eager"], lines
    # the FLOP ratio the step-time ratio compares with: cost.py's for these two configs
    flop_ratio = float(lines[-4].split("flop_ratio=")[1])
    assert 1.5 < flop_ratio < 4
    assert lines[-1].startswith("tandem_over_transformers=") and float(lines[-1].split("=")[1]) > 0


def test_qwen4_exp_trunk_bench():
    """Qwen4-Exp tiny trunk vs a full-attention trunk of equal active parameters (--quick: lengths
    64 and 128): the active parameters match within the bench's tolerance, every per-length line
    parses with positive ratios, and the selected fraction is the budget's share of the causal
    pairs."""
    from tandem.trainer.recipe import load_config

    proc = processes.command([sys.executable, "bench/qwen4_exp_trunk.py", "--quick"], timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    active = [line for line in lines if line.startswith("active_params ")]
    assert len(active) == 1, lines
    counts = dict(field.split("=") for field in active[0].split()[1:])
    qwen, dense = int(counts["qwen4_exp"]), int(counts["dense"])
    assert qwen > 0 and abs(dense / qwen - 1) <= 0.03
    assert abs(float(counts["rel_diff"]) - (dense / qwen - 1)) < 1e-4
    rows = [dict(field.split("=") for field in line.split()) for line in lines
            if line.startswith("seq=")]
    assert [(int(r["seq"]), int(r["batch"])) for r in rows] == [(64, 2), (128, 1)], lines
    ratios = {"step_ratio", "step_ratio_fastest"} | {
        f"mem_ratio_{form}{kl}" for form in ("auto", "mask", "gather") for kl in ("", "_kl")
    }
    m = load_config("recipes/qwen4_exp_tiny.yaml", []).model
    blocks, r = m.indexer_budget // m.indexer_compress_ratio, m.indexer_compress_ratio
    for row in rows:
        assert ratios | {"selected_fraction"} <= set(row), row
        assert all(float(row[k]) > 0 for k in ratios), row
        # each query: min(budget / r, complete blocks) blocks plus its incomplete tail
        s = int(row["seq"])
        selected = sum(min(blocks, (t + 1) // r) * r + (t + 1) % r for t in range(s))
        assert abs(float(row["selected_fraction"]) - selected / (s * (s + 1) / 2)) < 1e-3, row


def test_qsa_reuse_bench(tmp_path, corpus_cache):
    """QSA index reuse on 2-step qwen4_exp_tiny checkpoints of 2 training seeds, trained by the
    bench: with reuse the drafter runs its indexer once per round (depth 1), without it at each of
    the K depths; block scoring and the indexer's projection shrink accordingly, both decode
    exactly what autoregressive decoding gives, and reuse vs own is compared over the seeds with a
    verdict."""
    cmd = [sys.executable, "bench/qsa_reuse.py", "--seeds", "2", "--steps", "2", "--out",
           str(tmp_path / "q4"),
           "--num-prompts", "2", "--prompt-len", "24", "--max-new-tokens", "8", "--batch-size", "2",
           f"data.cache_dir={corpus_cache}", "data.stdlib_max_bytes=200000", "data.vocab_size=512",
           "model.vocab_size=512", "data.seq_len=64", "train.warmup_steps=1", "train.dtype=fp32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = processes.command(cmd, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    line = dict(field.split("=") for field in lines[-1].split())
    assert (
        float(line["indexer_calls_per_round_reuse"]) == 1.0
        and float(line["indexer_calls_per_round_own"]) == 3.0
    )
    saved = 1 - float(line["indexer_macs_per_round_reuse"]) / float(
        line["indexer_macs_per_round_own"]
    )
    assert 0 < saved < 1 and abs(saved - float(line["indexer_work_saved"])) < 1e-3
    # the indexer's projection runs only on the rows it scores: a reusing depth runs neither
    for name in ("reuse", "own"):
        assert (line[f"indexer_projected_rows_per_round_{name}"]
                == line[f"indexer_scored_rows_per_round_{name}"]), line
    assert (
        line["identical_to_autoregressive_reuse"]
        == line["identical_to_autoregressive_own"]
        == "1.0000"
    )
    assert "[acceptance_greedy] acceptance_length: reuse vs own (2 seeds x 2 prompts)" in lines
    assert line["reuse_minus_own_acceptance_greedy_significant"] in ("yes", "no")
    assert line["block_minus_token_T1_reuse_significant"] in ("yes", "no")
    assert all(os.path.isdir(tmp_path / "q4" / f"seed_{s}" / "checkpoints") for s in (1234, 1235))


def test_gdn_chunk_solve_bench():
    """The chunk-solve bench runs at a tiny size and its accuracy table shows the fix: the blocked
    solve within 1e-5 of the recurrence on every adversarial input, the old power series far off."""
    cmd = [sys.executable, "bench/gdn_chunk_solve.py", "--heads", "2", "--seq", "128", "--reps",
           "1", "--no-rule"]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("random", "run", "run_slow", "periodic",
                                                    "correlated")}
    assert len(rows) == 5 and all(float(blocked) < 1e-5 for _, blocked, _ in rows.values())
    assert float(rows["correlated"][0]) > 1.0
    assert proc.stdout.strip().splitlines()[-1].startswith("solve_ratio_to_blocked ")


def test_qsa_gather_backward_bench():
    """The gather-form bench runs at a tiny size: both paths' gradients agree, and the form's own
    backward writes less than the checkpoint per chunk it replaced."""
    cmd = [sys.executable, "bench/qsa_gather_backward.py", "--seqs", "256", "--slots", "19",
           "--chunks", "16", "--heads", "2", "--head-dim", "8", "--reps", "1"]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.strip().splitlines()[-2].split()
    assert row[0] == "256" and int(row[7]) < int(row[6]) and float(row[8]) < 1e-5, row
    assert proc.stdout.strip().splitlines()[-1].startswith("old_over_new=")


def test_pipeline_balance_bench():
    """`python bench/pipeline_balance.py` as docs/results.md and docs/parallelism.md quote it: the
    most expensive stage over the mean x2.588 with every depth on the last stage, x1.135 balanced at
    2 or 4 stages per rank, x1.176 at the recipe's 3 (x1.041 per pp rank). No test ran it (a
    docstring named it)."""
    proc = processes.command([sys.executable, "bench/pipeline_balance.py"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = [line.split("=")[1] for line in proc.stdout.splitlines()
             if line.strip().startswith("max_stage_over_mean=")]
    assert stage[:6] == ["2.588", "1.135", "3.546", "1.176", "4.729", "1.135"], stage
    assert "max_rank_over_mean=1.041" in proc.stdout


def test_ep_dispatch_bench():
    """bench/ep_dispatch.py at ep=2 for one step: both dispatches step, and the host syncs it counts
    are the dispatches' own: the exact one reads its split sizes back (`tolist`), the padded one
    never does."""
    proc = processes.command([sys.executable, "bench/ep_dispatch.py", "--layouts", "ep=2",
                              "--warmup", "0", "--steps", "1"], timeout=300,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines
            if line.split()[0] in ("exact", "padded")}
    assert int(rows["exact"][4]) > 0 and "tolist" in " ".join(rows["exact"][5:]), lines
    assert int(rows["padded"][4]) == 0 and rows["padded"][5] == "{}", lines
    assert lines[-1].startswith("padded_over_exact_step_time[ep=2]=")
    assert float(lines[-1].rsplit("=", 1)[1]) > 0


def test_fsdp_accumulation_memory_bench():
    """bench/fsdp_accumulation_memory.py at dp=2 in fp32 (bf16's figures: docs/results.md, from the
    bench's default run): every case's measured peak is within 30% of trainer/estimate.py's
    (0.953-0.966 measured here), and so is the extra memory of reducing the gradients once per step
    instead of every micro-batch (0.866; one step's peak, before the bench took the least of three,
    gave 0.67 in a suite run, a late free of gloo's: see the bench's docstring)."""
    proc = processes.command([sys.executable, "bench/fsdp_accumulation_memory.py", "--dtypes",
                              "fp32"], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = dict(field.split("=") for field in proc.stdout.strip().splitlines()[-1].split())
    low, high = (float(x) for x in summary["peak_over_estimate"].split(".."))
    assert 0.7 <= low <= high <= 1.3, summary
    assert 0.7 <= float(summary["delta_measured_over_estimated"]) <= 1.3, summary


def test_mtp_overhead_bench():
    """`python bench/mtp_overhead.py` (docs/results.md's MTP overhead) at one step of the tiny
    trunk: K=3 costs more time, FLOPs and memory than K=0, and the ratio line comes last."""
    cmd = [sys.executable, "bench/mtp_overhead.py", "--trunk", "tiny", "--steps", "1", "--batch",
           "1", "--no-checkpointing"]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    assert set(ratios) == {"step_time_ratio", "flop_ratio", "peak_mem_ratio", "layer_mem_ratio"}
    assert float(ratios["flop_ratio"]) > 1 and float(ratios["peak_mem_ratio"]) > 1


def test_self_distill_bench(tmp_path):
    """`python bench/self_distill.py run` (README's and docs/finetuning.md's self-distillation
    figures) at its smallest budget, every step the real `tandem` command: it pretrains, generates,
    fine-tunes the three variants and compares them, then refreshes the module for a fine-tuned
    trunk (--trunk-steps: its `tandem generate` on a trunk without MTP crashed), ending with the
    comparison's key=value line."""
    cmd = [sys.executable, "bench/self_distill.py", "run", "--seeds", "1", "--work",
           str(tmp_path), "--pretrain-steps", "2", "--pretrain-overrides",
           "flavor=debug data.vocab_size=512 data.seq_len=32", "--corpus-bytes", "200000",
           "--seq-len", "32", "--ft-steps", "2", "--gen-prompts", "2", "--gen-tokens", "4",
           "--prompt-chars", "60", "--trunk-steps", "2", "--eval-prompts", "2", "--prompt-len",
           "8", "--eval-tokens", "4", "--eval-bytes", "20000", "--threads", "1"]
    proc = processes.command(cmd, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    for pair in ("b_minus_a", "c_minus_a", "a_minus_before"):
        for mode in ("greedy", "T1"):
            float(summary[f"{pair}_{mode}"])
            assert summary[f"{pair}_{mode}_significant"] in ("yes", "no")
