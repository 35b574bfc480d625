"""The records of a JSON Lines, JSON or Parquet file, each with where it came from (`FILE:LINE`,
`FILE:record N`, `FILE:row N`): the one reader `tandem preprocess` takes its text from and the chat
data its records. Bad input is a ValueError naming the file and the line (text that is not UTF-8, a
line that is not JSON), before anything is tokenized. Only the columns asked for are read, so files
whose other fields differ in name or type still read (HF `datasets` had to build one schema from
every field of every file, and failed on a metadata column it did not need)."""

from __future__ import annotations

import gzip
import json
from typing import Iterator, List, Optional, Tuple

JSON_EXT = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
"""Files of JSON records (`json_records`)."""
PARQUET_EXT = (".parquet",)
"""Parquet files (`parquet_records`)."""


def _decoded(raw: bytes, path: str, lineno: Optional[int]) -> str:
    """`raw` as UTF-8 (a leading byte-order mark dropped); ValueError naming the line otherwise."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = lineno if lineno is not None else raw[:exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text") from None


def json_records(path: str) -> Iterator[Tuple[str, object]]:
    """`(where, record)` of a .json/.jsonl(.gz) file: JSON Lines (`where` is FILE:LINE), or a .json
    file holding one array of records (FILE:record N) or one object (FILE)."""
    whole = not path.lower().endswith((".jsonl", ".jsonl.gz"))
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4096).decode("utf-8", errors="ignore").lstrip("\ufeff").lstrip()
        f.seek(0)
        if not (whole and head.startswith("[")):
            for lineno, raw in enumerate(f, 1):
                line = _decoded(raw, path, lineno)
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    if whole and lineno == 1:  # may open one object over several lines
                        break
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                yield f"{path}:{lineno}", rec
            else:
                return
            f.seek(0)
        text = _decoded(f.read(), path, None)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    records = value if isinstance(value, list) else [value]
    yield from ((f"{path}:record {i}" if records is value else path, rec)
                for i, rec in enumerate(records, 1))


def parquet_records(path: str, columns: Optional[List[str]] = None
                    ) -> Iterator[Tuple[str, dict]]:
    """`(FILE:row N, row)` of a Parquet file, holding only `columns` (None: every column)."""
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
        for rec in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", rec


def utf8_text(where: str, text: str) -> str:
    """`text` itself; ValueError naming `where` for a lone surrogate (a JSON escape such as
    "\\ud800"), which is no UTF-8 and which the tokenizer fails on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: text with a lone surrogate ({text[exc.start]!r}) is not "
                         "UTF-8") from None
    return text
