"""Writes whose failure names the file. An OSError from write(), flush() or close() (a full disk's
ENOSPC) carries no file name, and the commands print an OSError as their one error line: without
the name that line says only "No space left on device"."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import IO, Callable, Iterator, Optional, Union


@contextmanager
def naming(path: str) -> Iterator[None]:
    """Re-raise an OSError raised inside without a file name as the same error naming `path`."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, path) from None


@contextmanager
def _synced(path: str, opened_as: str, binary: bool) -> Iterator[IO]:
    """`path` opened for writing (UTF-8 text whatever the locale, or bytes), flushed and synced to
    disk on leaving; an OSError naming no file names `opened_as`."""
    with naming(opened_as), open(path, "wb" if binary else "w",
                                 encoding=None if binary else "utf-8") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_synced(path: str, data: Union[str, bytes]) -> None:
    """`data` (text or bytes) into `path`, on disk when this returns; an OSError names `path`."""
    with _synced(path, path, isinstance(data, bytes)) as f:
        f.write(data)


def write_replacing(path: str, write: Callable[[IO], None], binary: bool = False) -> None:
    """`write(f)` into `path`.tmp (text, or bytes when `binary`), synced, then renamed over `path`
    (a link at `path` is replaced, not written through): a write that fails part-way (a full disk)
    leaves the earlier file whole and no temporary behind, and an OSError from the writes that
    names no file names `path`; a kill leaves the old file or the new one, never a part."""
    tmp = path + ".tmp"
    try:
        with _synced(tmp, path, binary) as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fsync_path(path: str) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parent_problem(path: str) -> Optional[str]:
    """Why `path` cannot be created (its nearest existing ancestor is a file, or a directory this
    process cannot write), None when it can: a command says so before its work, not with an
    `[Errno 17] File exists` naming another file after it."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None
