"""`tandem generate` on a tiny checkpoint (2 training steps), in this process through the console
entry point.

Greedy records are the trunk's autoregressive tokens; sampled ones repeat for a seed; a killed run
(a torn last line, a batch cut short) resumes to the uninterrupted run's file; a rerun with other
settings (OUT.meta.json) refuses; bad input is one line naming FILE:LINE before the model loads;
chat prompts use the checkpoint's chat template; a parquet column reads like the JSONL.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY_OVERRIDES

pytestmark = [pytest.mark.slow]

PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Foo:", "x = 1\n"]
BUDGET = ["--max-new-tokens", "6", "--batch-size", "2"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, corpus_cache):
    """A tiny run directory (K=2 MTP) and a prompts file."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    root = tmp_path_factory.mktemp("generate")
    train(load_config("recipes/tiny.yaml", TINY_OVERRIDES + [
        f"run.dir={root / 'run'}", "train.max_steps=2", f"data.cache_dir={corpus_cache}"]))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS))
    return root


def generate(argv, capsys):
    """(exit status, records, settings sidecar, stderr) of `tandem generate ARGV`."""
    from tandem.trainer.cli import main

    capsys.readouterr()
    rc = main(["generate", *argv])
    err = capsys.readouterr().err
    out = argv[argv.index("--out") + 1]
    if rc != 0:
        return rc, [], None, err
    with open(f"{out}.meta.json") as f:
        meta = json.load(f)
    return rc, [json.loads(x) for x in open(out).read().splitlines()], meta, err


def test_greedy_records_are_the_trunks_autoregressive_tokens(ckpt, tmp_path, capsys):
    from tandem.eval.spec_decode import generate as decode
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    out = tmp_path / "gen.jsonl"
    rc, records, header, err = generate(["--checkpoint", str(ckpt / "run"), "--prompts",
                                         str(ckpt / "prompts.jsonl"),
                                         "--out", str(out), *BUDGET], capsys)
    assert rc == 0, err
    assert "tok/s=" in err and "acc_len=" in err  # the progress bar
    assert (
        header["num_steps"] == 2
        and header["temperature"] == 0.0
        and len(header["checkpoint_fingerprint"]) >= 64
    )
    assert [(r["prompt_index"],
             r["sample_index"]) for r in records] == [(i, 0) for i in range(len(PROMPTS))]
    model, _ = load_model_from_checkpoint(str(ckpt / "run"))
    for r in records:
        assert r["prompt"] == PROMPTS[r["prompt_index"]]
        ar = decode(model, [r["prompt_ids"]], 6, 0, eos_id=header["eos_id"]).outputs[0]
        assert r["response_ids"] == ar and 1 <= len(ar) <= 6


def test_a_trunk_without_an_mtp_module_generates_autoregressively(ckpt, tmp_path, capsys,
                                                                 corpus_cache):
    """A checkpoint trained with mtp.num_steps=0 (bench/self_distill.py's refreshed trunk) decodes
    with no drafts: the acceptance intervals divided by its zero drafted tokens and generate
    crashed."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    train(load_config("recipes/tiny.yaml", TINY_OVERRIDES + [
        f"run.dir={tmp_path / 'run'}", "train.max_steps=1", "mtp.num_steps=0",
        f"data.cache_dir={corpus_cache}"]))
    rc, records, header, err = generate(["--checkpoint", str(tmp_path / "run"), "--prompts",
                                         str(ckpt / "prompts.jsonl"), "--out",
                                         str(tmp_path / "gen.jsonl"), *BUDGET], capsys)
    assert rc == 0, err
    assert header["num_steps"] == 0 and len(records) == len(PROMPTS)
    assert all(r["acceptance_length"] == 1.0 and 1 <= len(r["response_ids"]) <= 6
               for r in records)


def test_killed_run_resumes_to_the_uninterrupted_file(ckpt, tmp_path, capsys):
    """Sampled (T=0.9, top-k 50, 2 samples a prompt: 4 batches of 2 rows). A kill mid-batch leaves
    batch 0, half of batch 1 and a torn line: the rerun keeps batch 0, decodes 1..3 with their own
    seeds, and the file equals the uninterrupted one (nothing duplicated, nothing lost)."""
    args = ["--checkpoint", str(ckpt / "run"), "--prompts", str(ckpt / "prompts.jsonl"), *BUDGET,
            "--temperature", "0.9", "--top-k", "50", "--samples-per-prompt", "2", "--seed", "5"]
    full, again = tmp_path / "full.jsonl", tmp_path / "again.jsonl"
    assert generate(args + ["--out", str(full)], capsys)[0] == 0
    assert generate(args + ["--out", str(again)], capsys)[0] == 0
    assert full.read_text() == again.read_text()  # the seed fixes the samples
    lines = full.read_text().splitlines(keepends=True)
    assert len(lines) == 2 * len(PROMPTS)
    killed = tmp_path / "killed.jsonl"
    (tmp_path
     / "killed.jsonl.meta.json").write_text((tmp_path / "full.jsonl.meta.json").read_text())
    killed.write_text("".join(lines[:3]) + lines[3][:40])
    rc, records, _, err = generate(args + ["--out", str(killed)], capsys)
    assert rc == 0 and "resuming" in err and "2 rows written, 6 to go" in err, err
    assert killed.read_text() == full.read_text()
    other_seed = tmp_path / "seed6.jsonl"
    rc, records6, _, _ = generate([a if a != "5" else "6"
                                   for a in args] + ["--out", str(other_seed)], capsys)
    assert rc == 0 and [r["response_ids"] for r in records6] != [r["response_ids"] for r in records]


def test_rerun_with_other_settings_refuses(ckpt, tmp_path, capsys):
    args = ["--checkpoint", str(ckpt / "run"), "--prompts", str(ckpt / "prompts.jsonl"), "--out",
            str(tmp_path / "g.jsonl"), "--batch-size", "2"]
    assert generate(args + ["--max-new-tokens", "3"], capsys)[0] == 0
    before = (tmp_path / "g.jsonl").read_text()
    rc, _, _, err = generate(args + ["--max-new-tokens", "4"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "max_new_tokens differ" in err, err
    assert (tmp_path / "g.jsonl").read_text() == before


def test_seeds_share_no_draws(ckpt, tmp_path, capsys):
    """Two samples of a prompt, a batch each (`--batch-size 1`): batch b was seeded `seed + b`, so
    `--seed 6`'s sample 0 of a prompt drew as `--seed 5`'s sample 1, and two runs that differed only
    in the seed wrote the same samples."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in PROMPTS[:2]))
    responses = []
    for seed in ("5", "6"):
        rc, records, _, err = generate(["--checkpoint", str(ckpt / "run"), "--prompts",
                                        str(prompts), "--out", str(tmp_path / f"s{seed}.jsonl"),
                                        "--max-new-tokens", "6", "--batch-size", "1",
                                        "--temperature", "1.0", "--samples-per-prompt", "2",
                                        "--seed", seed], capsys)
        assert rc == 0, err
        responses.append({(r["prompt_index"], tuple(r["response_ids"])) for r in records})
    assert len(responses[0]) == len(responses[1]) == 4 and not responses[0] & responses[1]
    # a sampled file begun on another kind of device is not resumed here: its draws differ
    out = tmp_path / "s5.jsonl"
    meta = json.loads((tmp_path / "s5.jsonl.meta.json").read_text())
    assert meta["sampling_device"] == "cpu"
    (tmp_path / "s5.jsonl.meta.json").write_text(json.dumps({**meta, "sampling_device": "cuda"}))
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    rc, _, _, err = generate(["--checkpoint", str(ckpt / "run"), "--prompts", str(prompts),
                              "--out", str(out), "--max-new-tokens", "6", "--batch-size", "1",
                              "--temperature", "1.0", "--samples-per-prompt", "2", "--seed", "5"],
                             capsys)
    assert rc == 2 and "sampling_device differ" in err, err


def test_a_draft_length_the_module_cannot_run_fails_before_anything_is_written(
        ckpt, tmp_path, capsys, monkeypatch):
    """A parallel-style module (independent heads) drafts at most its heads: `--num-steps` past
    them was found in decoding, after OUT.meta.json was written, and that sidecar refused the
    corrected rerun ("num_steps differ") though OUT held no record."""
    from tandem.trainer import generate as gen

    real = gen._checkpoint_source

    def parallel_heads(args):
        src = real(args)
        src.cfg.mtp.style = "parallel"
        return src

    monkeypatch.setattr(gen, "_checkpoint_source", parallel_heads)
    monkeypatch.setattr(gen, "load_one_process",
                        lambda *a: pytest.fail("the model loaded before the check"))
    args = ["--checkpoint", str(ckpt / "run"), "--prompts", str(ckpt / "prompts.jsonl"), "--out",
            str(tmp_path / "o.jsonl"), *BUDGET]
    rc, _, _, err = generate(args + ["--num-steps", "3"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "exceeds the 1 independent heads" in err, err
    assert not list(tmp_path.iterdir())


def test_a_sidecar_without_records_is_replaced(ckpt, tmp_path, capsys):
    """A first run that failed after writing its settings (out of memory at the first batch) left
    OUT.meta.json beside an empty OUT: the rerun with other settings writes, since nothing written
    depends on the old ones."""
    out = tmp_path / "o.jsonl"
    args = ["--checkpoint", str(ckpt / "run"), "--prompts", str(ckpt / "prompts.jsonl"), "--out",
            str(out), "--batch-size", "2"]
    assert generate(args + ["--max-new-tokens", "3"], capsys)[0] == 0
    out.write_text("")
    rc, records, meta, err = generate(args + ["--max-new-tokens", "4"], capsys)
    assert rc == 0 and meta["max_new_tokens"] == 4 and len(records) == len(PROMPTS), err


@pytest.mark.parametrize("line,message", [
    ('{"text": "ok"}\n{"text": "a", \n', ":2: not valid JSON"),
    ('{"text": "ok"}\n\n{"prompt": "a"}\n', ":3: neither"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', ":1: a chat prompt"),
    ('{"text": "ok"}\n' + json.dumps({"text": "x = 1\n" * 200}) + "\n", ":2: prompt is"),
], ids=["invalid_json", "neither_form", "chat_without_template", "too_long"])
def test_bad_input_is_one_line_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch, line,
                                                      message):
    from tandem.trainer import generate as gen

    monkeypatch.setattr(gen, "load_one_process",
                        lambda *a: pytest.fail("the model loaded before the check"))
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(line)
    rc, _, _, err = generate(["--checkpoint", str(ckpt / "run"), "--prompts", str(prompts), "--out",
                              str(tmp_path / "o.jsonl"), *BUDGET], capsys)
    assert rc == 2 and err.count("\n") == 1 and f"{prompts}{message}" in err, err
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.meta.json").exists()


@pytest.mark.parametrize("flags,message", [
    (["--column", "question"], "--column question: a JSONL prompt file's prompts are its records'"),
    # the prompts were blamed ("prompt is 5 tokens; 1 to -145 fit")
    (["--num-steps", "50"], "the draft margin 4K+5=205 (K=50, --num-steps) leave no room"),
])
def test_flags_that_no_prompt_could_meet(ckpt, tmp_path, capsys, flags, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "ok"}\n')
    rc, _, _, err = generate(["--checkpoint", str(ckpt / "run"), "--prompts", str(prompts),
                              "--out", str(tmp_path / "o.jsonl"), *BUDGET, *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


@pytest.mark.parametrize("flags", [["--num-steps", "-1"], ["--tp", "0"]])
def test_bad_flags_fail_before_anything_is_written(tmp_path, capsys, flags):
    """`--num-steps -1` once wrote its settings beside --out, then failed in decoding (a
    RuntimeError), and the settings left behind refused every later run into that --out."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "ok"}\n')
    rc, _, _, err = generate(["--checkpoint", str(tmp_path / "missing"), "--prompts", str(prompts),
                              "--out", str(tmp_path / "o.jsonl"), *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and "--num-steps must be >= 0" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_chat_template_and_parquet_column(ckpt, tmp_path, capsys):
    """Messages render with tokenizer_config.json's template (its bos_token, the end-of-document
    token, becomes that one special id); a parquet column gives the JSONL's records."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    shutil.copytree(ckpt / "run", run)
    step = next(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    (step / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                            "bos_token": "<|endoftext|>"}))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Write a loop."}]}) + "\n")
    rc, records, header, err = generate(["--checkpoint", str(run), "--prompts", str(chat), "--out",
                                         str(tmp_path / "c.jsonl"), *BUDGET], capsys)
    assert rc == 0, err
    assert records[0]["prompt"] == "<|endoftext|>user: Write a loop.\nassistant:"
    assert (
        records[0]["prompt_ids"][0] == header["eos_id"][0]
        and records[0]["prompt_ids"][1] != header["eos_id"][0]
    )
    table = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"question": PROMPTS}), table)
    common = ["--checkpoint", str(ckpt / "run"), *BUDGET]
    rc, from_table, _, err = generate(common + ["--prompts", str(table), "--column", "question",
                                                "--out",
                                                str(tmp_path / "t.jsonl")], capsys)
    assert rc == 0, err
    _, from_jsonl, _, _ = generate(common + ["--prompts", str(ckpt / "prompts.jsonl"), "--out",
                                             str(tmp_path / "j.jsonl")], capsys)
    assert from_table == from_jsonl
    rc, _, _, err = generate(common + ["--prompts", str(table), "--out", str(tmp_path / "n.jsonl")],
                             capsys)
    assert rc == 2 and "no column 'text'" in err, err


@pytest.mark.parametrize("trained, pp", [
    (["train.micro_batch_size=1", "train.grad_accum_steps=1"], 2),
    (["parallel.pp=2", "parallel.pp_microbatches=2", "train.grad_accum_steps=2",
      "model.num_layers=4"], 4),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
      "train.grad_accum_steps=2", "model.num_layers=4"], 3),
], ids=["one_sequence_a_step", "pp_microbatches_below_pp", "interleaved_stages_left_empty"])
def test_decoding_on_another_pipeline_depth_passes_the_layout_checks(trained, pp):
    """`tandem generate --pp N` decodes a checkpoint on N stages whatever its training schedule: the
    layout checks of the training batch refused it (a step of one sequence cannot fill 2 stages;
    pp_microbatches=2 is below 4; 2 x 3 interleaved stages for 4 layers leave one empty)."""
    from tandem.trainer.generate import decoding_layout
    from tandem.trainer.parallel.validate import validate_layout
    from tandem.trainer.recipe import load_config

    cfg = load_config("recipes/tiny.yaml", TINY_OVERRIDES + trained)
    decoding_layout(cfg, 1, pp, 1)
    assert validate_layout(cfg, pp) == 1
