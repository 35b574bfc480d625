"""The in-loop evaluator's prompts and teacher-forced batches come from the held-out split, never
the training split, as the trainer wires it (data.source=megatron and stdlib); plus the distinct-n
figure and the temperature labels on hand-computed cases, and the eval config keys' checks."""

import json
import random

import numpy as np
import pytest

from tandem.eval.metrics import distinct_n, temperature_label
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.recipe import load_config

TRAIN_WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()
VALID_WORDS = "QUUX ZORP BLIX FNORD GRAULT WALDO".split()


def _tokens(trainer):
    ev = trainer.evaluator
    prompts = [t for p in ev.prompts for t in p]
    batches = [t for b in ev.loss_batches for t in b["tokens"].flatten().tolist()]
    return ev, prompts, batches


def test_megatron_split_eval_reads_validation_documents_only(tmp_path, tiny_base):
    from tandem.data_pipeline.preprocess import preprocess
    from tandem.data_pipeline.tokenizer import load_tokenizer, train_bpe
    from tandem.trainer.run import build_run

    rng = random.Random(0)
    doc = lambda words: " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))  # noqa: E731
    # split 80,20: megatron gives the first 80% of documents to training, the rest to validation
    docs = [doc(TRAIN_WORDS) for _ in range(80)] + [doc(VALID_WORDS) for _ in range(20)]
    tok_path = str(tmp_path / "tok.json")
    train_bpe(iter(docs), 300, tok_path)
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    preprocess([str(src)], str(tmp_path / "c"), tokenizer=tok_path)
    tok = load_tokenizer(tok_path)
    train_ids = {t for d in docs[:80] for t in tok.encode(d)}
    valid_ids = {t for d in docs[80:] for t in tok.encode(d)} - train_ids
    assert len(valid_ids) > 5  # the two splits are told apart by their tokens
    overrides = tiny_base + [f"run.dir={tmp_path / 'run'}", "data.source=megatron",
                             f"data.paths=[{tmp_path / 'c'}]",
                             "data.split=80,20,0", f"data.tokenizer={tok_path}",
                             f"data.cache_dir={tmp_path / 'cache'}",
                             "eval.interval=1", "eval.num_prompts=4", "eval.prompt_len=16",
                             "eval.max_new_tokens=8", "eval.loss_batches=2", "train.max_steps=1"]
    ev, prompts, batches = _tokens(build_run(load_config("recipes/tiny.yaml", overrides)))
    assert len(ev.prompts) == 4 and len(ev.loss_batches) == 2
    seen = set(prompts) | set(batches)
    assert not seen & (train_ids - {tok.eod_id})  # not one training-only token
    assert set(prompts) & valid_ids and set(batches) & valid_ids


def _stream(indexed):
    return np.concatenate([np.asarray(indexed[i])
                           for i in range(len(indexed))]).astype(np.int32).tobytes()


def _pieces(window, eod):
    """The EOD-free runs of a window (GPTDataset windows span shuffled documents)."""
    out, cur = [], []
    for t in window + [eod]:
        if t == eod:
            if cur:
                out.append(np.asarray(cur, dtype=np.int32).tobytes())
            cur = []
        else:
            cur.append(t)
    return out


def test_stdlib_eval_reads_the_test_split(tmp_path, tiny_base):
    from tandem.trainer.run import build_run

    overrides = tiny_base + [f"run.dir={tmp_path / 'run'}", "eval.interval=1", "eval.num_prompts=4",
                             "eval.prompt_len=16", "eval.max_new_tokens=8", "eval.loss_batches=2",
                             "train.max_steps=1"]
    trainer = build_run(load_config("recipes/tiny.yaml", overrides))
    ev = trainer.evaluator
    eod = trainer.tokenizer.eod_id
    train, valid = _stream(trainer.train_ds.dataset), _stream(trainer.valid_ds.dataset)
    windows = [list(p) for p in ev.prompts] + [row.tolist() for b in ev.loss_batches
                                               for row in b["tokens"]]
    long_pieces = [p for w in windows for p in _pieces(w, eod) if len(p) >= 4 * 12]
    assert len(long_pieces) >= 4
    # every piece is text of the held-out test/ files; (nearly) none is also training text
    assert all(valid.find(p) >= 0 for p in long_pieces)
    assert sum(train.find(p) >= 0 for p in long_pieces) <= len(long_pieces) // 4


def test_distinct_n_hand_computed():
    # [1,2,1,2,1]: 2-grams (1,2),(2,1),(1,2),(2,1) -> 2 of 4; [5,6,7]: 2 of 2; [9]: no 2-gram, left
    # out
    assert distinct_n([[1, 2, 1, 2, 1], [5, 6, 7], [9]], 2) == pytest.approx((0.5 + 1.0) / 2)
    # 4-grams of [3,3,3,3,3,3]: three, all (3,3,3,3) -> 1/3
    assert distinct_n([[3] * 6], 4) == pytest.approx(1 / 3)
    assert distinct_n([[1, 2, 3]], 4) is None


def test_temperature_labels():
    assert [temperature_label(t) for t in (1.0, 0.7, 2, 0.25)] == ["T1", "T0.7", "T2", "T0.25"]


@pytest.mark.parametrize("bad", ["[0.0]", "[1.0,2.5]", "[-1]"])
def test_temperatures_outside_range_name_the_key(bad):
    with pytest.raises(ConfigError, match=r"eval\.temperatures.*\(0, 2\]"):
        load_config(None, [f"eval.temperatures={bad}"])


def test_retired_eval_temperature():
    # old run configs still load
    assert load_config(None, ["eval.temperature=0"]).eval.temperatures == [1.0]
    with pytest.raises(ConfigError, match=r"eval\.temperature'=.*eval\.temperatures"):
        load_config(None, ["eval.temperature=0.7"])


def test_retired_eod_mask_loss():
    """Megatron's mask of a target whose input is an EOD is a subset of the model's own mask of
    every target across a document boundary: either value of the retired key loads, dropped."""
    for value in ("true", "false"):
        assert not hasattr(load_config(None, [f"data.eod_mask_loss={value}"]).data,
                           "eod_mask_loss")
    with pytest.raises(ConfigError, match=r"data\.eod_mask_loss'='maybe'.*never trained"):
        load_config(None, ["data.eod_mask_loss=maybe"])


def test_saved_config_with_retired_key_loads(tmp_path):
    """config.yaml of a run saved before eval.temperatures holds `eval.temperature: 0.0`."""
    path = tmp_path / "config.yaml"
    path.write_text("eval:\n  temperature: 0.0\n  num_prompts: 3\n")
    cfg = load_config(str(path))
    assert cfg.eval.num_prompts == 3 and cfg.eval.temperatures == [1.0]
    path.write_text("eval:\n  temperature: 0.8\n")
    with pytest.raises(ConfigError, match="eval.temperatures"):
        load_config(str(path))

