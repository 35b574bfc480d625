"""The embedded default corpus: the running interpreter's standard-library Python source.

Training documents are the stdlib's `.py` files outside `test/` (sorted relative paths;
site-packages and `__pycache__` skipped, and the data tables of `TABLE_DIRS`; optionally capped at
`DataConfig.stdlib_max_bytes`); validation documents are the first ~1.5 MB of the sorted `.py` files
under `test/`. Each file is one document. Files that are not UTF-8 are skipped.

`prepare_stdlib_corpus(data_cfg)` trains a byte-level BPE (`data_cfg.vocab_size`) on the training
files, writes `train` and `valid` indexed datasets and caches them under
`<data_cfg.cache_dir>/stdlib-py<X.Y.Z>-v<vocab>-cap<bytes>-<format>/`. A second call returns at
once. Concurrent callers (torchrun ranks, several runs) serialise on an `fcntl` lock file beside
that directory: one prepares, the others wait and then reuse the result.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import sys
import sysconfig
import time
from dataclasses import replace
from typing import List, Optional, Tuple

from tandem.data_pipeline.preprocess import output_paths, preprocess
from tandem.data_pipeline.tokenizer import default_eod, tokenizer_fingerprint

CACHE_FORMAT = "f2"
"""Bumped whenever the corpus selection or on-disk layout changes, so old caches are not reused."""

TABLE_DIRS = ("encodings/", "pydoc_data/", "lib2to3/tests/data/")
"""Training-split directories left out: data written as Python rather than code (the codecs'
256-entry character-map tables, 12% of the stdlib's tokens; pydoc's 750 KB of help-topic prose,
4.5%; lib2to3's deliberately odd test inputs): 16.5% of the tokens a short run would otherwise
sample go to code instead. The held-out `test/` split is unaffected."""

VALID_MAX_BYTES = 1_500_000
"""Bytes of `test/` source used for validation (keeps preprocessing fast)."""

_READY = "READY.json"


def stdlib_root() -> str:
    """The standard-library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _py_files(root: str) -> List[Tuple[str, str, int]]:
    """(relative path, absolute path, size) of every .py file under root, sorted by relative
    path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages",
                                                        "__pycache__") and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):
                    out.append((os.path.relpath(path, root).replace(os.sep, "/"), path,
                                os.path.getsize(path)))
    out.sort()
    return out


def _take(files: List[Tuple[str, str, int]], max_bytes: int) -> List[str]:
    """Sorted prefix of files whose sizes sum to at most max_bytes (at least one file; 0 = all)."""
    if not max_bytes:
        return [p for _, p, _ in files]
    taken, total = [], 0
    for _, path, size in files:
        if taken and total + size > max_bytes:
            break
        taken.append(path)
        total += size
    return taken


def stdlib_files(max_bytes: int = 0, valid_bytes: int = VALID_MAX_BYTES) -> Tuple[List[str],
                                                                                  List[str]]:
    """(training files, validation files) of the embedded corpus, deterministic for one
    interpreter."""
    files = _py_files(stdlib_root())
    train = [f for f in files if not f[0].startswith(("test/",) + TABLE_DIRS)]
    valid = [f for f in files if f[0].startswith("test/")]
    if not train or not valid:
        raise FileNotFoundError(f"no standard-library .py sources found under {stdlib_root()} "
                                f"(train {len(train)}, "
                                f"test {len(valid)} files)")
    return _take(train, max_bytes), _take(valid, valid_bytes)


def stdlib_cache_dir(data_cfg) -> str:
    """The cache directory of the embedded corpus for this interpreter, vocab size and byte cap."""
    vocab = f"v{int(data_cfg.vocab_size)}"
    # tokenized with a given tokenizer (a fine-tuned checkpoint's): its ids and its end of document,
    # which a directory's tokenizer_config.json names apart from tokenizer.json (a base model and
    # its instruct sibling share one tokenizer.json, and shared one cache that refused the second)
    if getattr(data_cfg, "tokenizer", ""):
        eod = default_eod(data_cfg.tokenizer)
        vocab = f"tok{tokenizer_fingerprint(data_cfg.tokenizer)[:16]}-eod{eod[1] if eod else ''}"
    key = (f"stdlib-py{platform.python_version()}-{vocab}-cap{int(data_cfg.stdlib_max_bytes)}"
           f"-{CACHE_FORMAT}")
    return os.path.join(os.path.abspath(os.path.expanduser(data_cfg.cache_dir)), key)


def _same_as_trained_bpe(data_cfg) -> Optional[str]:
    """The cache of the corpus's own BPE when `data.tokenizer` is exactly that BPE (a checkpoint
    trained on this corpus hands its tokenizer back): no second preparation."""
    if not getattr(data_cfg, "tokenizer", ""):
        return None

    try:
        own = stdlib_cache_dir(replace(data_cfg, tokenizer=""))
    except TypeError:  # not a dataclass (an omegaconf node): compare nothing
        return None
    tok = _result(own)[2]
    if os.path.isfile(os.path.join(own, _READY)) and os.path.isfile(tok) and \
            tokenizer_fingerprint(tok) == tokenizer_fingerprint(data_cfg.tokenizer):
        return own
    return None


def _result(cache: str) -> Tuple[str, str, str]:
    train, valid = os.path.join(cache, "train"), os.path.join(cache, "valid")
    return train, valid, output_paths(train)["tokenizer"]


def prepare_stdlib_corpus(data_cfg) -> Tuple[str, str, str]:
    """Prepare (once) and return `(train_prefix, valid_prefix, tokenizer_path)` of the embedded
    corpus.

    Safe to call from many processes at once: the first to take the lock prepares, the rest wait for
    it.
    """
    cache = _same_as_trained_bpe(data_cfg) or stdlib_cache_dir(data_cfg)
    if os.path.isfile(os.path.join(cache, _READY)):
        return _result(cache)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache + ".lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if not os.path.isfile(os.path.join(cache, _READY)):
                _prepare(data_cfg, cache)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return _result(cache)


def _prepare(data_cfg, cache: str) -> None:
    t0 = time.time()
    os.makedirs(cache, exist_ok=True)
    train_files, valid_files = stdlib_files(int(data_cfg.stdlib_max_bytes))
    given = getattr(data_cfg, "tokenizer", "") or None
    # a given tokenizer's own vocabulary, not data.vocab_size's (which only a trained BPE takes)
    tokens = f"tokenizer {given}" if given else f"vocab {data_cfg.vocab_size}"
    print(f"preparing the embedded stdlib corpus ({len(train_files)} train / {len(valid_files)} "
          f"valid files, {tokens}) in {cache}", file=sys.stderr, flush=True)
    train_prefix, valid_prefix, tok_path = _result(cache)
    # overwrite=True: anything here without READY.json is a leftover of an interrupted preparation.
    train = preprocess(train_files, train_prefix, tokenizer=given,
                       vocab_size=int(data_cfg.vocab_size),
                       tokenizer_sample_bytes=0, overwrite=True)
    valid = preprocess(valid_files, valid_prefix, tokenizer=given or tok_path, overwrite=True)
    ready = {
        "python": platform.python_version(),
        "stdlib": stdlib_root(),
        "vocab_size": train["vocab_size"],
        "eod_id": train["eod_id"],
        "train": {k: train[k] for k in ("documents", "tokens")},
        "valid": {k: valid[k] for k in ("documents", "tokens")},
        "train_files": len(train_files),
        "valid_files": len(valid_files),
        "seconds": round(time.time() - t0, 2),
    }
    tmp = os.path.join(cache, f".{_READY}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(ready, f, indent=2)
    os.replace(tmp, os.path.join(cache, _READY))
    print(f"prepared the embedded stdlib corpus: {train['tokens']} train / {valid['tokens']} valid "
          "tokens "
          f"in {ready['seconds']:.1f}s", file=sys.stderr, flush=True)
