"""How `tandem preprocess` (plain and `--chat`) puts a dataset in place: every file is written into
a staging directory beside the prefix (one filesystem, so each move is a rename), then renamed into
place with the meta file, the marker of a complete dataset, last.

An older dataset being replaced is moved aside into the staging directory (its marker first), not
deleted, until the new files are all in place: when a rename fails, the new files go back into the
staging directory, the older ones come back, and `CommitFailed` says where the new dataset is kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Iterator, List, Sequence, Tuple


class CommitFailed(OSError):
    """The staged dataset could not be moved into place; it is kept in its staging directory."""


@contextlib.contextmanager
def staging_dir(output_prefix: str) -> Iterator[str]:
    """A new staging directory beside `output_prefix`, removed on leaving, except after
    `CommitFailed` (then only its `hf_cache`, `datasets`' scratch space, goes)."""
    out_dir = os.path.dirname(output_prefix)
    os.makedirs(out_dir, exist_ok=True)
    staging = os.path.join(out_dir, f".{os.path.basename(output_prefix)}.staging-{os.getpid()}"
                                    f"-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    kept = False
    try:
        yield staging
    except CommitFailed:
        kept = True
        raise
    finally:
        shutil.rmtree(os.path.join(staging, "hf_cache") if kept else staging, ignore_errors=True)


def commit(moves: Sequence[Tuple[str, str]], displaced: Sequence[str], staging: str,
           prefix: str) -> None:
    """Rename each staged `(src, dst)` of `moves` in order (the marker last), after moving the
    `displaced` files that exist (an older dataset, its marker first) aside into `staging`, where
    leaving `staging_dir` deletes them. On a failed rename everything moved goes back and
    CommitFailed names `staging`."""
    aside = os.path.join(staging, "replaced")
    os.makedirs(aside, exist_ok=True)
    done: List[Tuple[str, str]] = []  # (from, to) of every rename made, to undo in reverse
    try:
        for i, path in enumerate(displaced):
            if os.path.exists(path):
                _rename(path, os.path.join(aside, f"{i}-{os.path.basename(path)}"), done)
        for src, dst in moves:
            if os.path.exists(src):
                _rename(src, dst, done)
    except OSError as exc:
        why = f"could not move the new dataset into place at {prefix} ({exc})"
        try:
            for src, dst in reversed(done):
                os.replace(dst, src)
        except OSError as undo:
            raise CommitFailed(f"{why}, nor put the earlier files back ({undo}): they are in "
                               f"{aside} (and some at {prefix}), the new ones in {staging}"
                               ) from None
        os.rmdir(aside)
        raise CommitFailed(f"{why}; the dataset there is as it was, and the new one is kept in "
                           f"{staging} (data.*)") from None


def _rename(src: str, dst: str, done: List[Tuple[str, str]]) -> None:
    os.replace(src, dst)
    done.append((src, dst))
