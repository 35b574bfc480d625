"""Text -> Megatron indexed dataset (`<prefix>.bin` / `<prefix>.idx`), what `tandem preprocess`
runs (its command line: data_pipeline/preprocess_cli.py).

Inputs (one or more paths, globs allowed):
  * `.jsonl` / `.ndjson` / `.json` / `.json.gz`: one document per record, text under `text_key`,
    every record checked first (data_pipeline/records.py; `.zst` through HF `datasets`)
  * `.parquet`: one document per row, the `text_key` column alone
  * `.txt`, `.txt.gz`: a document per file (`txt_sample_by="document"`), paragraph or line
  * a directory `datasets.Dataset.save_to_disk` wrote: one document per row, text under `text_key`
    (data_pipeline/saved_datasets.py; a `DatasetDict`'s train split)
  * any other directory: every regular file below it (sorted, hidden and `__pycache__` skipped,
    optionally filtered by `extensions`) is one document, e.g. a tree of source files (a note says
    so when it holds JSON or parquet shards, whose records a glob such as 'DIR/*.jsonl' reads)
  * any other file: one document
Each document is tokenized (batched, `TandemTokenizer.encode_batch`), after the tokenizer's own BOS
where its post-processor adds one (`start_ids`) and followed by the EOD token, and written with
megatron-core's `IndexedDatasetBuilder.add_document` (uint16 when the vocabulary is below 65500,
else int32). Blank documents and files that are not UTF-8 are skipped (counted), a file's UTF-8 BOM
dropped, an input named twice (a file and a glob matching it) read once (data_pipeline/inputs.py).

Outputs beside the prefix: `<prefix>.bin`, `<prefix>.idx`, `<prefix>.tokenizer.json` (the tokenizer
the data was made with; training finds it there) and `<prefix>.meta.json` (vocab size, EOD id,
dtype, document/token counts), written into a staging directory next to the prefix and renamed into
place at the end (`.idx` after `.bin`, `.meta.json` last: an interrupted run never leaves a prefix
that looks complete; data_pipeline/staging.py). An existing dataset is only replaced with
`overwrite=True`, and only once the new one is in place.
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from tandem.data_pipeline.inputs import (
    InputStats,
    batched,
    expand_paths,
    input_groups,
    iter_groups,
)
from tandem.data_pipeline.staging import commit, staging_dir
from tandem.data_pipeline.tokenizer import TandemTokenizer, load_tokenizer, train_bpe

META_FORMAT = "tandem-indexed-v1"
"""`format` field of `<prefix>.meta.json`."""

UINT16_VOCAB_LIMIT = 65500
"""Vocabularies smaller than this are stored as uint16 tokens, larger ones as int32."""


def token_dtype(vocab_size: int):
    """The on-disk token dtype for a vocabulary: uint16 when vocab_size < 65500, else int32."""
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def output_paths(prefix: str) -> Dict[str, str]:
    """The files `preprocess` writes for `prefix`: keys bin, idx, tokenizer, meta."""
    return {"bin": prefix + ".bin", "idx": prefix + ".idx", "tokenizer": prefix + ".tokenizer.json",
            "meta": prefix + ".meta.json"}


def read_meta(prefix: str) -> Optional[dict]:
    """`<prefix>.meta.json` as a dict, or None when absent (e.g. a dataset not made by Tandem)."""
    path = output_paths(prefix)["meta"]
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# --------------------------------------------------------------------------------------------------
# Writing


def indexed_dataset_builder():
    from tandem.data_pipeline.megatron_import import IndexedDatasetBuilder  # lazily: seconds

    return IndexedDatasetBuilder


def existing_outputs(prefix: str) -> List[str]:
    """The dataset files (.bin, .idx, .meta.json) that already exist for `prefix`."""
    paths = output_paths(prefix)
    return [paths[k] for k in ("bin", "idx", "meta") if os.path.exists(paths[k])]


def checked_prefix(prefix: str) -> str:
    """`prefix` as an absolute path. ValueError for one that would put the files beside a directory
    rather than in it: "" (the working directory), one ending in "/", an existing directory."""
    given = os.path.expanduser(str(prefix))
    path = os.path.abspath(given)
    problem = ("is empty" if not given.strip() else
               f"ends in {given[-1]!r}" if given.endswith(("/", os.sep)) else
               "is a directory" if os.path.isdir(path) else "")
    if problem:
        raise ValueError(f"output prefix {str(prefix)!r} (--output-prefix) {problem}: the files "
                         "are named PREFIX.bin, PREFIX.idx, ...; give e.g. "
                         f"{os.path.join(given or '.', 'corpus')}")
    return path


def preprocess(inputs: Union[str, Sequence[str]], output_prefix: str,
               tokenizer: Union[None, str, TandemTokenizer] = None, vocab_size: int = 4096,
               text_key: str = "text", *, overwrite: bool = False,
               tokenizer_sample_bytes: int = 100_000_000, txt_sample_by: str = "document",
               extensions: Optional[Sequence[str]] = None, log=None) -> dict:
    """Tokenize `inputs` into the Megatron indexed dataset `output_prefix` (.bin/.idx) and return
    the summary that is also written to `<output_prefix>.meta.json`.

    `tokenizer`: a path (tokenizer.json or HF directory), a loaded `TandemTokenizer`, or None to
    train a byte-level BPE of `vocab_size` on the first `tokenizer_sample_bytes` bytes of the corpus
    (0 = all). FileExistsError if the dataset exists and `overwrite` is False (files left as they
    are). `log(line)` hears of the tokenizer training and of files skipped as not UTF-8."""
    t0 = time.time()
    output_prefix = checked_prefix(output_prefix)
    if txt_sample_by not in ("document", "paragraph", "line"):
        raise ValueError(f"txt_sample_by={txt_sample_by!r} must be document, paragraph or line")
    if not overwrite:
        refuse_existing(output_prefix)
    paths = expand_paths(inputs)  # fail on missing inputs before any work
    groups = input_groups(paths, text_key, txt_sample_by)  # and on a bad JSON record
    tokenizer, tok_source = resolve_tokenizer(tokenizer)
    with staging_dir(output_prefix) as staging:
        stats = InputStats()
        docs = iter_groups(groups, text_key, txt_sample_by, extensions,
                           os.path.join(staging, "hf_cache"), stats)
        t_tok = 0.0
        if tokenizer is None:
            tokenizer, docs, t_tok = train_bpe_on_sample(docs, paths, vocab_size,
                                                          tokenizer_sample_bytes, log)
        staged = staged_paths(staging, output_prefix)
        n_docs, n_tokens = _write_tokens(staged, tokenizer, docs)
        bad, keyless = stats.skipped_not_utf8, stats.without_key
        if bad and log:  # before a 'no documents' error, which they may explain
            log(f"skipped {len(bad)} file(s) that are not UTF-8 text: {', '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}")
        if keyless and log:  # a typo in some files' key lost their text unnoticed
            log(f"skipped {keyless} record(s) without a '{text_key}' field (first "
                f"{stats.first_without_key}); --text-key names the field")
        if n_docs == 0:
            raise ValueError(f"no documents found in {', '.join(paths)}")

        tok_json = tokenizer.to_json_str()
        if tok_json is not None:
            with open(staged["tokenizer"], "w", encoding="utf-8") as f:
                f.write(tok_json)
        meta = _meta(output_prefix, tokenizer, tok_source, tok_json is not None, paths, stats,
                     n_docs, n_tokens, t_tok, t0)
        with open(staged["meta"], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        _commit(staged, staging, overwrite, output_prefix)
    return meta


def resolve_tokenizer(tokenizer) -> Tuple[Optional[TandemTokenizer], str]:
    """(the tokenizer to encode with, None when one is to be trained; its source for the meta
    file)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tok_source = os.path.abspath(os.path.expanduser(str(tokenizer)))
        return load_tokenizer(tok_source), tok_source
    if isinstance(tokenizer, TandemTokenizer):
        return tokenizer, tokenizer.path
    return tokenizer, "trained byte-level BPE"


def staged_paths(staging: str, output_prefix: str) -> Dict[str, str]:
    """`output_paths` of the prefix `<staging>/data`."""
    return {k: os.path.join(staging,
                            "data" + os.path.basename(v)[len(os.path.basename(output_prefix)):])
            for k, v in output_paths(output_prefix).items()}


def train_bpe_on_sample(docs: Iterator[str], paths: List[str], vocab_size: int,
                         sample_bytes_limit: int,
                         log) -> Tuple[TandemTokenizer, Iterator[str], float]:
    """Train a byte-level BPE on the first `sample_bytes_limit` bytes of `docs` (0 = all). Returns
    (tokenizer, every document of `docs` in order, training seconds): the sampled documents are kept
    and encoded first, so the corpus is read once."""
    t1 = time.time()
    pending: List[str] = []
    sample_bytes = 0
    exhausted = True
    for doc in docs:
        pending.append(doc)
        sample_bytes += len(doc.encode("utf-8"))
        if sample_bytes_limit and sample_bytes >= sample_bytes_limit:
            exhausted = False
            break
    if not pending:
        raise ValueError(f"no documents found in {', '.join(paths)}")
    tokenizer = train_bpe(iter(pending), vocab_size)
    t_tok = time.time() - t1
    if log:
        log(f"trained byte-level BPE (vocab {tokenizer.vocab_size}) on {sample_bytes / 1e6:.1f} MB "
            f"in {t_tok:.1f}s")
    return tokenizer, _chain(pending, iter(()) if exhausted else docs), t_tok


def _write_tokens(staged: Dict[str, str], tokenizer: TandemTokenizer,
                  docs: Iterable[str]) -> Tuple[int, int]:
    """Encode `docs`, each started as the tokenizer starts a text and followed by EOD, into the
    staged .bin/.idx; returns (documents, tokens)."""
    dtype = token_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod_id
    builder = indexed_dataset_builder()(staged["bin"], dtype=dtype)
    n_docs = n_tokens = 0
    for batch in batched(docs):
        for ids in tokenizer.encode_batch(batch, start=True):
            arr = np.empty(len(ids) + 1, dtype=dtype)
            arr[:-1] = ids
            arr[-1] = eod
            builder.add_document(arr, [arr.size])
            n_docs += 1
            n_tokens += arr.size
    builder.finalize(staged["idx"])
    return n_docs, n_tokens


def _meta(output_prefix: str, tokenizer: TandemTokenizer, tok_source: str, tok_file_written: bool,
          paths: List[str], stats: InputStats, n_docs: int, n_tokens: int, t_tok: float,
          t0: float) -> dict:
    """The contents of `<output_prefix>.meta.json`, also what `preprocess` returns."""
    return {
        "format": META_FORMAT,
        "prefix": output_prefix,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "eod_token": tokenizer.eod_token,
        "dtype": np.dtype(token_dtype(tokenizer.vocab_size)).name,
        "documents": n_docs,
        "tokens": n_tokens,
        "tokenizer": os.path.basename(output_paths(output_prefix)["tokenizer"]) if tok_file_written
        else None, "tokenizer_source": tok_source,
        "skipped_empty_documents": stats.skipped_empty,
        "skipped_not_utf8_files": len(stats.skipped_not_utf8),
        "skipped_records_without_text_key": stats.without_key,
        "inputs": ([os.path.abspath(x) for x in paths[:32]]
                   + ([f"... {len(paths) - 32} more"] if len(paths) > 32 else [])),
        "tokenizer_seconds": round(t_tok, 3),
        "seconds": round(time.time() - t0, 3),
    }


def _chain(first: List[str], rest: Iterable[str]) -> Iterator[str]:
    yield from first
    yield from rest


def refuse_existing(prefix: str) -> None:
    existing = existing_outputs(prefix)
    if existing:
        raise FileExistsError(f"dataset {prefix} already exists "
                              f"({', '.join(os.path.basename(p) for p in existing)}); "
                              "pass overwrite=True (--overwrite) to replace it")


def _commit(staged: Dict[str, str], staging: str, overwrite: bool, prefix: str) -> None:
    """Move the staged dataset into place; with `overwrite` the old one, and a loss-mask channel
    `--chat` wrote (which would mask the new tokens), is replaced."""
    if not overwrite:
        refuse_existing(prefix)  # another process may have finished meanwhile
    final = output_paths(prefix)
    old = ([final[k] for k in ("meta", "idx", "bin", "tokenizer")]
           + [prefix + "_loss_mask.bin", prefix + "_loss_mask.idx"]) if overwrite else []
    commit([(staged[k], final[k]) for k in ("tokenizer", "bin", "idx", "meta")], old, staging,
           prefix)
