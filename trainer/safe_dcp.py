"""Reading torch.distributed.checkpoint directories without running code from them.

torch's FileSystemReader unpickles a checkpoint's `.metadata` with a plain `pickle.load`, and its
DefaultLoadPlanner reads each non-tensor item (the optimizer's param groups, the trainer's counters)
with `torch.load(weights_only=False)`. A crafted checkpoint directory that a user points a command
at (`model.init_from`, `mtp.init_from`, `--checkpoint`, a resumed run directory) could so run any
code while it loads. Every Tandem read of a checkpoint goes through here instead: the metadata with
an unpickler that builds only DCP's metadata classes, torch.Size, dtypes, layouts and paths, and the
items with `torch.load(weights_only=True)` (tensors, numbers, strings and their containers).
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath")}
"""What a `.metadata` pickle may build besides the metadata module's own classes and torch's
dtypes, layouts and memory formats (every name a checkpoint of torch 2.13 holds)."""


class UnsafeCheckpoint(ValueError, pickle.UnpicklingError):
    """A checkpoint file asks to build something a checkpoint does not hold (one line, naming the
    file)."""


class UnreadableIndex(ValueError):
    """A `.metadata` that is no checkpoint index this torch can read: damaged, or written by a newer
    torch (one line naming the file, this torch and the one that wrote it)."""


def _enum_member(*args):
    """`getattr` as a metadata pickle may call it: a member of one of the metadata module's enums by
    name. Some Python 3.11 releases (3.11.2, Debian 12's, among them) pickle an enum member that
    way, and every tensor's properties hold one (`_MEM_FORMAT_ENCODING`): without this, no
    checkpoint they write could be read."""
    if len(args) == 2:
        cls, name = args
        if (isinstance(cls, type) and issubclass(cls, enum.Enum)
                and cls.__module__ == _METADATA_MODULE and type(name) is str
                and name in cls.__members__):
            return cls[name]
    shown = ", ".join(getattr(a, "__name__", None) or repr(a)[:40] for a in args)
    raise pickle.UnpicklingError(f"asks for getattr({shown}), which checkpoint metadata does not "
                                 "hold: refused (it could run code)")


_SHARED = (type, enum.Enum, torch.dtype, torch.layout, torch.memory_format)
"""What `find_class` and `_enum_member` hand out is shared by the whole process: a pickle's BUILD
may not set attributes on it."""


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler, whose BUILD can be overridden (C's cannot): about 3x slower, 16 s
    against 5 s for a 25 MB index of 160k shard chunks on a busy 2-core CPU, once per file."""

    def find_class(self, module: str, name: str):
        if "." not in name:  # a dotted name would walk attributes to anything
            if (module, name) in _ALLOWED:
                return super().find_class(module, name)
            if (module, name) == ("builtins", "getattr"):
                return _enum_member
            obj = super().find_class(module, name) if module in (_METADATA_MODULE,
                                                                 "torch") else None
            if module == _METADATA_MODULE and isinstance(obj, type) and obj.__module__ == module:
                return obj
            if module == "torch" and isinstance(obj, (torch.dtype, torch.layout,
                                                      torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(f"asks for {module}.{name}, which checkpoint metadata does "
                                     "not hold: refused (it could run code)")

    def load_build(self):
        target = self.stack[-2]
        if isinstance(target, _SHARED):  # setting a class's or a singleton's attributes
            raise pickle.UnpicklingError(f"asks to set attributes of {target!r}, which checkpoint "
                                         "metadata does not: refused")
        super().load_build()

    dispatch = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build}


_LAST_METADATA: dict = {}
"""The metadata read last, keyed by its file's (real path, inode, mtime, size): a checkpoint read
piece by piece (`tandem export`, tensor by tensor) or checked before its load (the optimizer's
unstepped parameters) parses its index once, not once per read; a step saved again is a new file."""


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with the metadata read by `_MetadataUnpickler`, once per file."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)
        if key not in _LAST_METADATA:
            metadata = self._unpickle_metadata(path)
            _LAST_METADATA.clear()
            _LAST_METADATA[key] = metadata
        metadata = _LAST_METADATA[key]
        metadata.storage_meta.load_id = self.load_id  # this read's, as torch's reader sets it
        return metadata

    def _unpickle_metadata(self, path) -> Metadata:
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"checkpoint file {path} {exc}") from None
        except OSError:
            raise
        except Exception as exc:  # damaged, or a class's __setstate__ this torch does not know
            raise UnreadableIndex(f"checkpoint file {path} cannot be read by torch "
                                  f"{torch.__version__} ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:200]}){_writer_note(path)}"
                                  ) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"checkpoint file {path} holds no checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _release(version: str) -> tuple:
    """(major, minor, patch) of a torch version string: builds of one release (`+cpu`, `+cu132`)
    read each other's checkpoints."""
    return tuple(int(n) for n in re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version).groups("0"))


def _writer_note(metadata_path: str) -> str:
    """'; written by torch X, ...' from the trainer state beside a Tandem checkpoint's index (the
    torch its save recorded): a newer torch's index asks for that torch; otherwise it is damaged."""
    try:
        with open(os.path.join(os.path.dirname(metadata_path), "trainer_state.json"),
                  encoding="utf-8") as f:
            written = str(json.load(f)["torch"])
        newer = _release(written) > _release(torch.__version__)
    except Exception:  # no trainer state, none recorded, or not a version: say what may be
        return "; damaged, or written by a newer torch"
    if newer:
        return f"; it was written by torch {written}: read it with that torch or a newer one"
    return f"; it was written by torch {written}, so the file is damaged"


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner with non-tensor items read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UnsafeCheckpoint(f"checkpoint item {read_item.dest_index.fqn}: {first}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: str) -> Metadata:
    """The metadata of the checkpoint directory `path` (its `.metadata`)."""
    return SafeFileSystemReader(path).read_metadata()


def load(state: dict, path: str, allow_partial_load: bool = False) -> None:
    """`dcp.load` of `state` from the checkpoint directory `path`, safely. A file that fails to
    read is one ValueError line naming `path` and the first rank's cause (not the traceback that
    torch's CheckpointException carries)."""
    try:
        reader = SafeFileSystemReader(path)
        # first, alone: a refused .metadata stops here, before torch's load falls back to rank-local
        # metadata files (which Tandem never writes) and logs the failure as a traceback; the load
        # then reuses what this read
        reader.read_metadata()
        with warnings.catch_warnings():  # one process reads alone on purpose (export, eval)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, storage_reader=reader,
                     planner=SafeLoadPlanner(allow_partial_load=allow_partial_load))
    # CheckpointException is a BaseException
    except (Exception, CheckpointException) as exc:
        failures = getattr(exc, "failures", None) or {}
        cause = next(iter(failures.values()))[0] if failures else exc
        if isinstance(cause, (UnsafeCheckpoint, UnreadableIndex)):
            raise cause from None
        what = " ".join(str(cause).split())[:300]
        raise ValueError(f"checkpoint {path} is unreadable or corrupt ({type(cause).__name__}: "
                         f"{what})") from None
