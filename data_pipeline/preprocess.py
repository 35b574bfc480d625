"""Text -> Megatron indexed dataset (`<prefix>.bin` / `<prefix>.idx`), what `tandem preprocess`
runs (its command line: data_pipeline/preprocess_cli.py).

Inputs (one or more paths, globs allowed):
  * `.jsonl` / `.json` / `.json.gz`: one document per record, text under `text_key`, every record
    checked first (data_pipeline/records.py; `.zst` through HF `datasets`)
  * `.parquet`: one document per row, the `text_key` column alone
  * `.txt`, `.txt.gz`: a document per file (`txt_sample_by="document"`), paragraph or line
  * a directory `datasets.Dataset.save_to_disk` wrote: one document per row, text under `text_key`
    (data_pipeline/saved_datasets.py; a `DatasetDict`'s train split)
  * any other directory: every regular file below it (sorted, hidden and `__pycache__` skipped,
    optionally filtered by `extensions`) is one document, e.g. a tree of source files
  * any other file: one document
Each document is tokenized (batched, `TandemTokenizer.encode_batch`), after the tokenizer's own BOS
where its post-processor adds one (`start_ids`) and followed by the EOD token, and written with
megatron-core's `IndexedDatasetBuilder.add_document` (uint16 when the vocabulary is below 65500,
else int32). Empty documents and files that are not UTF-8 are skipped (counted).

Outputs beside the prefix: `<prefix>.bin`, `<prefix>.idx`, `<prefix>.tokenizer.json` (the tokenizer
the data was made with; training finds it there) and `<prefix>.meta.json` (vocab size, EOD id,
dtype, document/token counts), written into a staging directory next to the prefix and renamed into
place at the end (`.idx` after `.bin`, `.meta.json` last: an interrupted run never leaves a prefix
that looks complete; data_pipeline/staging.py). An existing dataset is only replaced with
`overwrite=True`, and only once the new one is in place.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import tempfile
import time
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from tandem.data_pipeline.records import json_records, parquet_records, utf8_text
from tandem.data_pipeline.saved_datasets import is_saved_dataset, saved_texts
from tandem.data_pipeline.staging import commit, staging_dir
from tandem.data_pipeline.tokenizer import TandemTokenizer, load_tokenizer, train_bpe

META_FORMAT = "tandem-indexed-v1"
"""`format` field of `<prefix>.meta.json`."""

_JSON_EXT = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
_PARQUET_EXT = (".parquet",)
_TXT_EXT = (".txt", ".txt.gz")

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
# Reading documents


def expand_paths(inputs: Union[str, Sequence[str]], missing: str = "input not found",
                 empty: str = "no inputs given") -> List[str]:
    """Files, directories and globs -> existing paths in order: FileNotFoundError "`missing`: PATH"
    for a path that is not there and matches nothing, ValueError `empty` when nothing is given."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    out: List[str] = []
    for item in inputs:
        item = os.path.expanduser(str(item))
        if os.path.exists(item):
            out.append(item)
            continue
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else []
        if not matches:
            raise FileNotFoundError(f"{missing}: {item}")
        out.extend(matches)
    if not out:
        raise ValueError(empty)
    return out


def _kind(path: str, txt_sample_by: str) -> str:
    low = path.lower()
    if os.path.isdir(path):
        return "saved" if is_saved_dataset(path) else "dir"
    if low.endswith(_JSON_EXT):
        return "json"
    if low.endswith(_PARQUET_EXT):
        return "parquet"
    if low.endswith(_TXT_EXT) and txt_sample_by != "document":
        return "text"
    return "file"


def _walk_files(root: str, extensions: Optional[Sequence[str]]) -> List[str]:
    files: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if name.startswith(".") or (extensions and not name.endswith(tuple(extensions))):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                files.append(path)
    return files


class _Stats:
    def __init__(self) -> None:  # (without_key: the records without the text key, read as empty)
        self.skipped_empty, self.skipped_not_utf8, self.without_key = 0, [], []


def _read_file_doc(path: str, stats: _Stats) -> Optional[str]:
    try:  # a whole `.txt.gz` (or any `.gz`) file is one document too, decompressed
        with (gzip.open if path.lower().endswith(".gz") else open)(path, "rb") as f:
            return f.read().decode("utf-8")
    except UnicodeDecodeError:
        stats.skipped_not_utf8.append(path)
        return None


def _hf_docs(kind: str, files: List[str], text_key: str, txt_sample_by: str,
             hf_cache: str) -> Iterator[str]:
    import datasets
    from datasets.utils import logging as ds_logging

    kwargs = {"sample_by": txt_sample_by} if kind == "text" else {}
    was_enabled, verbosity = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL)  # its own error lines would precede ours
    try:
        ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=hf_cache,
                                   **kwargs)
    except Exception as exc:  # its own message is generic; the cause says what failed
        cause = f" ({' '.join(str(exc.__cause__).split())[:300]})" if exc.__cause__ else ""
        msg = (" ".join(str(exc).split()) or type(exc).__name__) + cause
        raise ValueError(f"cannot read {kind} input {files[0] if len(files) == 1 else files}: "
                         f"{msg}") from None
    finally:
        ds_logging.set_verbosity(verbosity)
        if was_enabled:
            ds_logging.enable_progress_bar()
    key = "text" if kind == "text" else text_key
    if key not in ds.column_names:
        raise ValueError(f"{files[0]}: no '{key}' field to read text from (fields: "
                         f"{', '.join(ds.column_names)}); set --text-key")
    for batch in ds.select_columns([key]).iter(batch_size=1000):
        for text in batch[key]:
            yield "" if text is None else str(text)


def _check_json_files(files: List[str], text_key: str) -> List[str]:
    """Check every record of `files`: ValueError `FILE:LINE: ...` for a line that is not JSON or not
    UTF-8 (or holds a lone surrogate), a record that is not an object, a `text_key` neither string
    nor null, and when no record of the group has the key at all. Returns the files that hold
    documents (records whose text is not blank)."""
    kept, keyed, fields, recorded = [], False, [], []
    for path in files:
        if path.lower().endswith(".zst"):  # only `datasets` reads these
            kept.append(path)
            keyed = True  # (its own column check)
            continue
        for where, rec in json_records(path):
            recorded = recorded or [path]
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: not a JSON object")
            text = rec.get(text_key)
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{where}: '{text_key}' is not a string (found "
                                 f"{json.dumps(text)[:40]})")
            utf8_text(where, text or "")
            keyed, fields = keyed or text_key in rec, fields or list(rec)
            if (text or "").strip() and kept[-1:] != [path]:  # blank: no document (iter_documents)
                kept.append(path)
    if recorded and not keyed:
        raise ValueError(f"{recorded[0]}: no '{text_key}' field to read text from (fields: "
                         f"{', '.join(fields)}); set --text-key")
    return kept


def _json_texts(files: List[str], text_key: str, hf_cache: str, stats: _Stats) -> Iterator[str]:
    """Each record's `text_key` ("" where null or missing; a record without the key counted)."""
    for path in files:
        if path.lower().endswith(".zst"):
            yield from _hf_docs("json", [path], text_key, "document", hf_cache)
            continue
        for where, rec in json_records(path):
            if text_key not in rec:
                stats.without_key.append(where)
            yield rec.get(text_key) or ""


def _parquet_texts(files: List[str], key: str) -> Iterator[str]:
    """Each row's column `key` of every file, read alone ("" where null)."""
    import pyarrow.parquet as pq

    for path in files:
        schema = pq.ParquetFile(path).schema_arrow
        if key not in schema.names:
            raise ValueError(f"{path}: no '{key}' field to read text from (fields: "
                             f"{', '.join(schema.names)}); set --text-key")
        kind = str(schema.field(key).type)
        if kind not in ("string", "large_string", "null"):
            raise ValueError(f"{path}: column '{key}' holds {kind}, not strings")
        yield from (rec[key] or "" for _, rec in parquet_records(path, [key]))


def _groups(paths: List[str], text_key: str, txt_sample_by: str) -> List[Tuple[str, List[str]]]:
    """`(kind, files)` in order: consecutive files of one HF kind share a load_dataset call. Every
    JSON record is read and checked here, before anything is tokenized."""
    groups: List[Tuple[str, List[str]]] = []
    for p in paths:
        k = _kind(p, txt_sample_by)
        if groups and groups[-1][0] == k and k in ("json", "parquet", "text"):
            groups[-1][1].append(p)
        else:
            groups.append((k, [p]))
    groups = [(k, _check_json_files(files, text_key) if k == "json" else files)
              for k, files in groups]
    for k, files in groups:
        if k == "saved":
            saved_texts(files[0], text_key)  # its text column, before any tokenizing
    if not any(files for _, files in groups):
        raise ValueError(f"no documents found in {', '.join(paths)}")
    return [(k, files) for k, files in groups if files]


def iter_documents(inputs: Union[str, Sequence[str]], text_key: str = "text",
                   txt_sample_by: str = "document", extensions: Optional[Sequence[str]] = None,
                   hf_cache: Optional[str] = None, stats: Optional[_Stats] = None) -> Iterator[str]:
    """The documents of `inputs` in order (see the module docstring for formats). Empty documents
    and non-UTF-8 files are skipped. JSON records are checked when this is called (ValueError
    naming the file and line). `hf_cache` is where HF `datasets` may write its Arrow cache (a
    temporary directory is used and removed when None)."""
    groups = _groups(expand_paths(inputs), text_key, txt_sample_by)
    return _iter_groups(groups, text_key, txt_sample_by, extensions, hf_cache, stats or _Stats())


def _iter_groups(groups: List[Tuple[str, List[str]]], text_key: str, txt_sample_by: str,
                 extensions: Optional[Sequence[str]], hf_cache: Optional[str],
                 stats: _Stats) -> Iterator[str]:
    own_cache = hf_cache is None
    if own_cache:
        hf_cache = tempfile.mkdtemp(prefix="tandem-hf-")
    try:
        for kind, files in groups:
            if kind == "json":
                docs: Iterable[Optional[str]] = _json_texts(files, text_key, hf_cache, stats)
            elif kind == "parquet":
                docs = _parquet_texts(files, text_key)
            elif kind == "text":
                docs = _hf_docs(kind, files, text_key, txt_sample_by, hf_cache)
            elif kind == "saved":
                docs = ("" if t is None else t for t in saved_texts(files[0], text_key))
            elif kind == "dir":
                docs = (_read_file_doc(f, stats) for f in _walk_files(files[0], extensions))
            else:
                docs = (_read_file_doc(f, stats) for f in files)
            for doc in docs:
                if doc is None:
                    continue
                if not doc.strip():  # whitespace alone is no document (nor a dataset of them)
                    stats.skipped_empty += 1
                    continue
                yield doc
    finally:
        if own_cache:
            shutil.rmtree(hf_cache, ignore_errors=True)


def _batched(docs: Iterable[str], max_docs: int = 512,
             max_chars: int = 8_000_000) -> Iterator[List[str]]:
    batch: List[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if len(batch) >= max_docs or size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


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
    groups = _groups(paths, text_key, txt_sample_by)  # and on a bad JSON record
    tokenizer, tok_source = resolve_tokenizer(tokenizer)
    with staging_dir(output_prefix) as staging:
        stats = _Stats()
        docs = _iter_groups(groups, text_key, txt_sample_by, extensions,
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
            log(f"skipped {len(keyless)} record(s) without a '{text_key}' field (first "
                f"{keyless[0]}); --text-key names the field")
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
    for batch in _batched(docs):
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
          paths: List[str], stats: _Stats, n_docs: int, n_tokens: int, t_tok: float,
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
        "skipped_records_without_text_key": len(stats.without_key),
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
