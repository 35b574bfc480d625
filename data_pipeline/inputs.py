"""The documents that `tandem preprocess`'s inputs hold (data_pipeline/preprocess.py lists the
formats): paths and globs expanded, each input read by its kind, every JSON record checked before
anything is tokenized, empty documents and files that are not UTF-8 skipped and counted."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from tandem.data_pipeline.records import (
    JSON_EXT,
    PARQUET_EXT,
    json_records,
    parquet_records,
    utf8_text,
)
from tandem.data_pipeline.saved_datasets import is_saved_dataset, saved_texts

_JSON_EXT = JSON_EXT + (".jsonl.zst", ".json.zst")  # (.zst through HF `datasets`)
_TXT_EXT = (".txt", ".txt.gz")


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
    unique = list({os.path.realpath(p): p for p in reversed(out)}.values())[::-1]
    if len(unique) < len(out):  # a file named and matched by a glob was read twice
        print(f"note: {len(out) - len(unique)} input(s) named more than once, read once",
              file=sys.stderr)
    return unique


def _kind(path: str, txt_sample_by: str) -> str:
    low = path.lower()
    if os.path.isdir(path):
        return "saved" if is_saved_dataset(path) else "dir"
    if low.endswith(_JSON_EXT):
        return "json"
    if low.endswith(PARQUET_EXT):
        return "parquet"
    if low.endswith(_TXT_EXT) and txt_sample_by != "document":
        return "text"
    return "file"


def _dir_files(root: str, extensions: Optional[Sequence[str]]) -> List[str]:
    """`_walk_files`, with a note when JSON or parquet shards are among them: most corpora ship as
    such shards, and a directory's files are each read whole, their records are not."""
    files = _walk_files(root, extensions)
    shards = [f for f in files if f.lower().endswith(_JSON_EXT + PARQUET_EXT)]
    if shards:
        print(f"note: {root} holds {len(shards)} JSON/parquet file(s) (first {shards[0]}), each "
              "read whole as one document; name them (e.g. 'DIR/*.jsonl') to read their records",
              file=sys.stderr)
    return files


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


class InputStats:
    """What reading skipped: blank documents, files that are not UTF-8, and the records without the
    text key (read as empty; counted, the first one's place kept: a corpus of millions of them held
    every place)."""

    def __init__(self) -> None:
        self.skipped_empty, self.skipped_not_utf8 = 0, []
        self.without_key, self.first_without_key = 0, ""


def _read_file_doc(path: str, stats: InputStats) -> Optional[str]:
    try:  # a whole `.txt.gz` (or any `.gz`) file is one document too, decompressed
        with (gzip.open if path.lower().endswith(".gz") else open)(path, "rb") as f:
            return f.read().decode("utf-8-sig")  # a BOM is no text
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
        if "zstd" in msg.lower() and not importlib.util.find_spec("zstandard"):
            msg += "; reading .zst files needs the zstandard package: pip install zstandard"
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
            if (text or "").strip() and kept[-1:] != [path]:  # blank: no document (iter_groups)
                kept.append(path)
    if recorded and not keyed:
        raise ValueError(f"{recorded[0]}: no '{text_key}' field to read text from (fields: "
                         f"{', '.join(fields)}); set --text-key")
    return kept


def _json_texts(files: List[str], text_key: str, hf_cache: str, stats: InputStats) -> Iterator[str]:
    """Each record's `text_key` ("" where null or missing; a record without the key counted)."""
    for path in files:
        if path.lower().endswith(".zst"):
            yield from _hf_docs("json", [path], text_key, "document", hf_cache)
            continue
        for where, rec in json_records(path):
            if text_key not in rec:
                stats.without_key += 1
                stats.first_without_key = stats.first_without_key or where
            yield rec.get(text_key) or ""


def _text_type(kind) -> bool:
    """Whether a parquet column of arrow type `kind` holds text (or nothing): string, large_string,
    string_view (newer writers), null, or a dictionary of strings (a pandas categorical)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or pa.types.is_string_view(kind))


def _parquet_texts(files: List[str], key: str) -> Iterator[str]:
    """Each row's column `key` of every file, read alone ("" where null)."""
    import pyarrow.parquet as pq

    for path in files:
        schema = pq.ParquetFile(path).schema_arrow
        if key not in schema.names:
            raise ValueError(f"{path}: no '{key}' field to read text from (fields: "
                             f"{', '.join(schema.names)}); set --text-key")
        kind = schema.field(key).type
        if not _text_type(kind):
            raise ValueError(f"{path}: column '{key}' holds {kind}, not strings")
        yield from (rec[key] or "" for _, rec in parquet_records(path, [key]))


def input_groups(paths: List[str], text_key: str,
                 txt_sample_by: str) -> List[Tuple[str, List[str]]]:
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


def iter_groups(groups: List[Tuple[str, List[str]]], text_key: str, txt_sample_by: str,
                extensions: Optional[Sequence[str]], hf_cache: Optional[str],
                stats: InputStats) -> Iterator[str]:
    """The documents of `input_groups`' groups in order, blank ones and files that are not UTF-8
    skipped and counted in `stats`; `hf_cache` is where HF `datasets` may write its Arrow cache (a
    temporary directory, removed after, when None)."""
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
                docs = (_read_file_doc(f, stats) for f in _dir_files(files[0], extensions))
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


def batched(docs: Iterable[str], max_docs: int = 512,
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
