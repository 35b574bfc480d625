"""The embedded stdlib corpus: deterministic file selection, and (slow) cached, lock-protected
preparation."""

import json
import os
import subprocess
import sys

import pytest

from tandem.data_pipeline import stdlib_corpus
from tandem.data_pipeline.stdlib_corpus import (
    VALID_MAX_BYTES,
    prepare_stdlib_corpus,
    stdlib_cache_dir,
    stdlib_files,
    stdlib_root,
)
from tandem.trainer.config import DataConfig


def test_file_selection_is_deterministic_and_split_by_test_dir():
    root = stdlib_root()
    train, valid = stdlib_files()
    assert (train, valid) == stdlib_files()
    rel = lambda ps: [os.path.relpath(p, root).replace(os.sep, "/") for p in ps]  # noqa: E731
    assert rel(train) == sorted(rel(train)) and rel(valid) == sorted(rel(valid))
    assert all(r.endswith(".py") and not r.startswith("test/") and "site-packages" not in r
               for r in rel(train))
    # data tables left out
    assert not any(r.startswith(("encodings/", "pydoc_data/")) for r in rel(train))
    assert "argparse.py" in rel(train) and "json/decoder.py" in rel(train)
    assert all(r.startswith("test/") for r in rel(valid))
    assert sum(map(os.path.getsize, valid)) <= VALID_MAX_BYTES
    capped, _ = stdlib_files(max_bytes=200_000)
    assert capped == train[: len(capped)] and 0 < sum(map(os.path.getsize, capped)) <= 200_000


def test_cache_key_depends_on_vocab_and_cap(tmp_path):
    a = stdlib_cache_dir(DataConfig(cache_dir=str(tmp_path)))
    assert a.startswith(str(tmp_path)) and "v4096" in a and "cap0" in a
    assert stdlib_cache_dir(DataConfig(cache_dir=str(tmp_path), vocab_size=512)) != a
    assert stdlib_cache_dir(DataConfig(cache_dir=str(tmp_path), stdlib_max_bytes=1000)) != a
    assert stdlib_cache_dir(DataConfig(cache_dir="~/x")).startswith(os.path.expanduser("~/x"))


def test_cache_key_tells_apart_tokenizers_that_end_documents_differently(tmp_path):
    """A base model and its instruct sibling share tokenizer.json and differ in the EOS their
    tokenizer_config.json names: the corpus tokenized for one (its EOD ending each document) shared
    a cache directory with the other, which then refused it ("made with ... eod=0, but ... eod=1")
    until the cache was deleted."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<|im_end|>", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_end|>")])
    dirs = []
    for eos in ("<|endoftext|>", "<|im_end|>"):
        d = tmp_path / eos.strip("<|>")
        d.mkdir()
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}))
        dirs.append(stdlib_cache_dir(DataConfig(cache_dir=str(tmp_path), tokenizer=str(d))))
    assert dirs[0] != dirs[1] and dirs[0].endswith("-eod0-cap0-" + dirs[0].split("-")[-1])


_WORKER = r"""
import json, sys
from tandem.data_pipeline import stdlib_corpus as sc
from tandem.trainer.config import DataConfig
real = sc._prepare
def traced(*a, **k):
    print("PREPARED", flush=True)
    return real(*a, **k)
sc._prepare = traced
cfg = DataConfig(cache_dir=sys.argv[1], vocab_size=512, stdlib_max_bytes=300_000)
print(json.dumps(sc.prepare_stdlib_corpus(cfg)))
"""


@pytest.mark.slow
def test_prepare_stdlib_corpus_concurrent_then_cached(tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, cache], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    # one process prepared, the other waited
    assert sum(out.count("PREPARED") for out, _ in outs) == 1
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0] == results[1]

    cfg = DataConfig(cache_dir=cache, vocab_size=512, stdlib_max_bytes=300_000)

    def prepared_again(*args, **kwargs):
        raise AssertionError("a third prepare of a ready cache")

    # the cached corpus is read, not prepared again
    monkeypatch.setattr(stdlib_corpus, "_prepare", prepared_again)
    train_prefix, valid_prefix, tok_path = prepare_stdlib_corpus(cfg)
    assert [train_prefix, valid_prefix, tok_path] == results[0]
    ready = json.load(open(os.path.join(stdlib_cache_dir(cfg), "READY.json")))
    assert (
        ready["vocab_size"] == 512
        and ready["train"]["tokens"] > 10_000
        and ready["valid"]["documents"] > 0
    )

    from tandem.data_pipeline.batches import get_batch
    from tandem.data_pipeline.dataset import build_datasets

    train, valid, tok = build_datasets(cfg, 64, 0, 32, 8)
    assert tok.vocab_size == 512 and len(train) >= 32 and len(valid) >= 8
    b = get_batch(valid, range(4))
    assert b["tokens"].shape == (4, 65) and int(b["tokens"].max()) < 512
    text = tok.decode(b["tokens"][0].tolist())
    assert isinstance(text, str) and len(text) > 64
