"""Directories Hugging Face `datasets.Dataset.save_to_disk` writes (`state.json`,
`dataset_info.json`, `data-*.arrow`; a `DatasetDict` adds `dataset_dict.json` over one such
directory per split), read the one way for every input that takes them: `tandem preprocess` (the
text under `--text-key`) and chat records (`data.source=jsonl`, `tandem preprocess --chat`).
"""

from __future__ import annotations

import os
from typing import Iterator, Optional, Tuple

_MARKERS = (("dataset_dict.json",), ("state.json", "dataset_info.json"))
"""Files that make a directory a saved `DatasetDict`, or a saved `Dataset`."""


def is_saved_dataset(path: str) -> bool:
    """Whether the directory `path` is what `save_to_disk` wrote (not a tree of text files)."""
    return any(all(os.path.isfile(os.path.join(path, n)) for n in names) for names in _MARKERS)


def load_saved_dataset(path: str):
    """The rows of the saved dataset `path` (a `DatasetDict`'s `train` split), memory-mapped.
    ValueError naming `path` when it is not one or has no train split."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises FileNotFoundError for a directory it did not write
        raise ValueError(
            f"{path}: not a `datasets` directory ({str(exc).splitlines()[0]})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a train split (splits: "
                             f"{', '.join(ds)})")
        ds = ds["train"]
    return ds


def saved_records(path: str) -> Iterator[Tuple[str, object]]:
    """`(FILE:row N, record)` of every row of the saved dataset `path`."""
    for row, rec in enumerate(load_saved_dataset(path), 1):
        yield f"{path}:row {row}", rec


def saved_texts(path: str, key: str) -> Iterator[Optional[str]]:
    """The `key` column of the saved dataset `path`, checked when called (not when iterated):
    ValueError naming `path` for a missing column (the fields are listed) or one not of strings."""
    ds = load_saved_dataset(path)
    if key not in ds.column_names:
        raise ValueError(f"{path}: no '{key}' field to read text from (fields: "
                         f"{', '.join(ds.column_names)}); set --text-key")
    dtype = getattr(ds.features[key], "dtype", None)
    if dtype not in ("string", "large_string", "null"):
        raise ValueError(f"{path}: column '{key}' holds {dtype}, not strings")
    return (text for batch in ds.select_columns([key]).iter(batch_size=1000)
            for text in batch[key])
