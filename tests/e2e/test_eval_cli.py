"""`tandem eval` on a tiny checkpoint trained for 2 steps prints one JSON object with the
metrics."""

import json
import os
import sys

import pytest

from tests import processes
from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, corpus_cache):
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    root = tmp_path_factory.mktemp("evalcli")
    overrides = [f"run.dir={root / 'run'}", "train.max_steps=2", *DEBUG_MODEL, *TINY_DATA,
                 "eval.interval=0",
                 "eval.num_prompts=3", "eval.prompt_len=8", "eval.max_new_tokens=8",
                 "eval.loss_batches=1",
                 *QUIET, f"data.cache_dir={corpus_cache}"]
    train(load_config("recipes/tiny.yaml", overrides))
    return root


def _eval(args):
    proc = processes.tandem(["eval", *args], timeout=300,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    res = json.loads(lines[0])
    # each acceptance figure's 95% interval: in the JSON beside it, and one `figure [lo, hi]` line
    # on stderr (a `± half-width` around an asymmetric interval read as values outside it)
    for key in [k for k in res if f"{k}_lo95" in res]:
        lo, hi = res[f"{key}_lo95"], res[f"{key}_hi95"]
        assert lo <= res[key] <= hi, key
        line = f"{key}: {res[key]:.3f} [{lo:.3f}, {hi:.3f}] "
        # one line per figure: not again for its copy under the logged name (eval/...)
        assert proc.stderr.count(line) == (0 if key.startswith("eval/") else 1), (key, proc.stderr)
    return res


def test_eval_cli_validation_prompts_greedy(tiny_run, tmp_path):
    out_file = tmp_path / "out.jsonl"
    res = _eval(["--checkpoint", str(tiny_run / "run"), "--max-new-tokens", "6", "--batch-size",
                 "2", "--output", str(out_file)])
    for key in ["loss/main", "acceptance_length", "draft_acceptance_rate",
                "decode_tokens_per_s/spec",
                "decode_tokens_per_s/ar", "speedup", "speedup_predicted"] + [
            f"{p}_{k}" for k in (1, 2, 3) for p in ("loss/mtp", "accept_rate/pos", "tf_acc/mtp")]:
        assert key in res, key
    for key in ["acceptance_length",
                "draft_acceptance_rate"] + [f"accept_rate/pos_{k}" for k in (1, 2, 3)]:
        assert f"{key}_lo95" in res and f"{key}_hi95" in res, key
    assert not any(k.startswith(("loss/", "tf_acc/", "speedup",
                                 "decode_")) and k.endswith("95") for k in res)
    assert res["identical_to_autoregressive"] is True
    assert 1.0 <= res["acceptance_length"] <= 4.0
    # the in-loop evaluator's repetition figures, over the continuations written to --output
    from tandem.eval.metrics import distinct_n

    outputs = [json.loads(line)["output_ids"] for line in out_file.read_text().splitlines()]
    assert res["distinct_2"] == pytest.approx(distinct_n(outputs, 2))
    assert res["distinct_4"] == pytest.approx(distinct_n(outputs, 4))
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(records) == 3
    assert all(len(r["prompt_ids"]) == 8 and 1 <= len(r["output_ids"]) <= 6
               and "acceptance_length" in r
               for r in records)


def test_eval_cli_prompts_file_longer_k_and_sampling(tiny_run, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": t}) for t in ["def main():\n",
                                                                   "import os\nimport sys\n"]))
    res = _eval(["--checkpoint", str(tiny_run / "run"), "--prompts", str(prompts), "--num-steps",
                 "5", "--max-new-tokens", "5"])
    assert (
        res["num_steps"] == 5
        and "accept_rate/pos_5" in res
        and res["identical_to_autoregressive"] is True
    )
    res = _eval(["--checkpoint", str(tiny_run / "run"), "--prompts", str(prompts), "--temperature",
                 "0.8", "--top-p", "0.9", "--max-new-tokens", "5", "--seed", "3"])
    assert "identical_to_autoregressive" not in res and 1.0 <= res["acceptance_length"] <= 4.0
    assert "accept_rate/pos_3_hi95" in res  # sampled decoding's figures have intervals too


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "-1"], "--temperature -1.0 must be >= 0"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--num-steps", "-2"], "--num-steps -2 must be >= 0"),
    (["--batch-size", "-1"], "--batch-size -1 must be >= 0"),
    # the first token comes from the prompt's forward: no round to draft in, figures of nothing
    (["--max-new-tokens", "1"], "--max-new-tokens 1 leaves no round to draft in"),
])
def test_bad_flags_fail_in_one_line_before_the_checkpoint_is_read(flags, needle, tmp_path, capsys):
    """A negative temperature once decoded greedily and reported temperature -1.0; the checkpoint
    named here does not exist, so a message about it would mean the flags were checked too late."""
    from tandem.trainer.eval_cli import eval_main

    assert eval_main(["--checkpoint", str(tmp_path / "missing"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


def test_spec_decode_bench_on_the_run(tiny_run):
    """`python bench/spec_decode.py` (docs/results.md's decode-speed figures) at a tiny budget: the
    speculative tokens are the autoregressive ones, and the figures it prints agree."""
    cmd = [sys.executable, "bench/spec_decode.py", "--checkpoint", str(tiny_run / "run"),
           "--num-steps", "2", "--num-prompts", "2", "--prompt-len", "8", "--max-new-tokens", "6",
           "--repeats", "1"]
    proc = processes.command(cmd, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    figures = json.loads(proc.stdout[:proc.stdout.index("\n}") + 2])
    assert figures["identical_to_autoregressive"] is True
    assert 1.0 <= float(last["acceptance_length"]) <= 3.0  # K=2
    assert float(last["acceptance_length"]) == pytest.approx(figures["acceptance_length"],
                                                             abs=1e-4)


def test_defaults_follow_the_in_loop_evaluator():
    """K from the checkpoint's eval.num_steps (else mtp.num_steps) and the seed from train.seed, as
    the in-loop evaluator decodes: with its defaults tandem eval drafted the trained K with seed 0
    and printed other figures than the run logged at that step."""
    import types

    from tandem.trainer.eval_cli import _parser, _settings
    from tandem.trainer.recipe import load_config

    cfg = load_config(None, ["eval.num_steps=3", "mtp.num_steps=2", "train.seed=77",
                             "eval.top_p=0.5"])
    model = types.SimpleNamespace(mtp=object())
    got = _settings(_parser().parse_args(["--checkpoint", "x"]), model, cfg, None)
    assert (got["num_steps"], got["seed"], got["top_p"]) == (3, 77, 0.5)
    got = _settings(_parser().parse_args(["--checkpoint", "x", "--num-steps", "2", "--seed", "0",
                                          "--top-p", "1"]), model, cfg, None)
    assert (got["num_steps"], got["seed"], got["top_p"]) == (2, 0, 1.0)


def test_a_bf16_runs_figures_are_the_in_loop_evaluators(tmp_path, corpus_cache):
    """A run trained in bf16 and evaluated in the loop at its last step: `tandem eval` of that
    checkpoint, with its defaults, prints the figures the run logged, exactly. It evaluated in fp32
    (the in-loop evaluator runs under the training step's autocast), and its loss and greedy
    continuations differed."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    run = tmp_path / "run"
    train(load_config("recipes/tiny.yaml", [
        f"run.dir={run}", "train.max_steps=2", *DEBUG_MODEL, *TINY_DATA, "eval.interval=2",
        "eval.num_prompts=2", "eval.prompt_len=8", "eval.max_new_tokens=6", "eval.loss_batches=1",
        "eval.temperatures=[1.0]", *QUIET, f"data.cache_dir={corpus_cache}",
        "train.dtype=bf16"]))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in reversed(logged) if "eval/acceptance_length" in r)
    res = _eval(["--checkpoint", str(run)])
    for key in ("loss/main", "loss/mtp_1", "acceptance_length", "distinct_2"):
        assert res[key] == logged[f"eval/{key}"], key
    # and under the logged names (the metrics contract's), every figure the loop logged but its
    # time, the timed ones (tokens per second and speed-ups) to their own measurement
    sampled = "eval/T1/"
    figures = [k for k in logged if k.startswith("eval/") and k != "eval/seconds"
               and not k.startswith(sampled)]
    assert "eval/identical_to_autoregressive" in figures and len(figures) > 20
    for key in figures:
        timed = "tokens_per_s" in key or "speedup" in key
        assert key in res and (timed or res[key] == logged[key]), key
    # sampled: the acceptance under eval/T1/ (the other rule's under eval/T1/<rule>/ left to a
    # --verify run), the teacher-forced figures as they are, and nothing the loop does not log
    res = _eval(["--checkpoint", str(run), "--temperature", "1"])
    figures = [k for k in logged if k.startswith(sampled) and k.count("/") == 2
               or k.startswith(sampled + "accept_rate/")]
    assert "eval/T1/acceptance_length" in figures
    for key in figures + ["eval/loss/main", "eval/tf_acc/mtp_1"]:
        assert res[key] == logged[key], key
    assert {k for k in res if k.startswith("eval/")} <= set(logged)
