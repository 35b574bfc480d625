"""bench/default_job_quality.py on a checkpoint trained for 3 steps: its bits per byte equal a hand
computation (log-softmax of the model's own logits over every window, bytes from the decoded text),
its greedy distinct-4 equals one recomputed from a plain autoregressive decode, and its last line
holds every key=value figure."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from tests import processes

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, PLEN, NEW = 32, 8, 8

# Two files of ASCII code (so decoded text's length is its byte count), about 10 windows together:
# the end-of-document token after the first lands inside a scored window.
SOURCES = {"a.py": "".join(f"def f{i}(x, y={i}):\n    return [x * y + {i} for _ in range(y)]\n\n"
                           for i in range(30)),
           "b.py": "".join(f"class C{i}:\n    value = {i * 7}\n\n" for i in range(30))}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_base):
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    root = tmp_path_factory.mktemp("quality")
    overrides = tiny_base + [f"run.dir={root / 'run'}", "train.max_steps=3",
                                  f"data.seq_len={SEQ}", f"eval.prompt_len={PLEN}",
                             f"eval.max_new_tokens={NEW}"]
    train(load_config("recipes/tiny.yaml", overrides))
    second = root / "code"
    second.mkdir()
    for name, text in SOURCES.items():
        (second / name).write_text(text)
    return root


def _hand_bits_per_byte(model, tok, stream):
    """Every window of SEQ+1 tokens (overlap 1): nats from log_softmax of the trunk's logits, bytes
    of the predicted tokens' decoded text (EOD stands for no bytes)."""
    nwin = (len(stream) - 1) // SEQ
    nats, text = 0.0, ""
    with torch.no_grad():
        for j in range(nwin):
            w = torch.tensor([stream[j * SEQ : j * SEQ + SEQ + 1]])
            h = model.trunk(w[:, :SEQ], torch.arange(SEQ).unsqueeze(0))
            logp = torch.log_softmax(model.logits(0, h).double(), -1)
            nats -= float(logp[0, torch.arange(SEQ), w[0, 1:]].sum())
            text += tok.decode([t for t in w[0, 1:].tolist() if t != tok.eod_id])
    return nats / math.log(2) / len(text.encode("utf-8"))


def _distinct4(outputs):
    ratios = []
    for out in outputs:
        grams = [tuple(out[i : i + 4]) for i in range(len(out) - 3)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios)


def test_quality_bench_matches_hand_computation(checkpoint):
    from tandem.eval.spec_decode import generate
    from tandem.trainer.checkpoint import load_model_from_checkpoint, resolve_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer

    cmd = [sys.executable, "bench/default_job_quality.py", "--checkpoint", str(checkpoint / "run"),
           "--windows", "100",
           "--prompts", "3", "--batch-size", "2", "--second-dir", str(checkpoint / "code")]
    proc = processes.command(cmd, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    figures = {k: float(v) for k, v in figures.items()}
    assert {"bits_per_byte", "distinct_4", "acceptance_greedy", "acceptance_t1", "greedy_pos_1",
            "greedy_pos_2",
            "bits_per_byte_pip", "distinct_4_pip", "acceptance_greedy_pip",
            "acceptance_t1_pip"} <= set(figures)

    step = resolve_checkpoint(str(checkpoint / "run"))
    model, cfg = load_model_from_checkpoint(step)
    tok = load_run_tokenizer(cfg, step)
    stream = [t for name in sorted(SOURCES) for t in tok.encode(SOURCES[name]) + [tok.eod_id]]
    nwin = (len(stream) - 1) // SEQ
    # every window scored, one EOD among them
    assert nwin < 100 and tok.eod_id in stream[1 : nwin * SEQ + 1]
    # the bench prints 4 decimals
    assert figures["bits_per_byte_pip"] == pytest.approx(_hand_bits_per_byte(model, tok, stream),
                                                         abs=1e-4)

    # the prompts are the first PLEN tokens of 3 evenly spaced windows; greedy speculative output
    # equals plain greedy decoding, so distinct-4 recomputed from an autoregressive decode must
    # agree
    prompts = [stream[j * SEQ : j * SEQ + PLEN] for j in (i * nwin // 3 for i in range(3))]
    with torch.inference_mode():
        ar = generate(model, prompts, NEW, 0, eos_id=tok.eod_id)
    assert figures["distinct_4_pip"] == pytest.approx(_distinct4(ar.outputs), abs=1e-4)
    K = cfg.mtp.num_steps
    for key in ("acceptance_greedy", "acceptance_t1", "acceptance_greedy_pip", "acceptance_t1_pip"):
        assert 1.0 <= figures[key] <= K + 1
    # draft 2 is accepted only after draft 1
    assert figures["greedy_pos_1"] >= figures["greedy_pos_2"]
    assert 0 < figures["bits_per_byte"] < 20
