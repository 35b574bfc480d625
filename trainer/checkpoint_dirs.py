"""Where a run's checkpoints live and which of them are complete: the directory layout alone, read
by the trainer's checkpointing (checkpoint.py) and by `model.init_from` (hf/init_from.py). A
directory marked complete must also hold DCP's index of its shards; one that lacks it is refused
(naming the file) when it would be used, rather than skipped, so a resume never silently goes back
to an older checkpoint or starts afresh."""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import List, Optional, Tuple

import torch.distributed as dist

from .files import fsync_path, write_synced

MARKER = "COMPLETE"
"""File that marks a checkpoint directory as complete: written last, holding the step."""
DCP_INDEX = ".metadata"
"""DCP's index of a checkpoint's shards: dcp.save writes it after every rank's shards, before the
marker."""
STATE_FILE = "trainer_state.json"
"""The trainer state (step, data position, guard counters): written before the shards."""
_STEP_DIR = re.compile(r"^(\.tmp_|\.stale_)?step_(\d+)$")
"""`step_<N>`, and the names a save of step N passes through (`publish`): `.tmp_step_<N>` while
written, `.stale_step_<N>` for the copy it replaces."""


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str,
                     whole_saves: bool = False) -> Tuple[List[Tuple[int, str]], List[str]]:
    """(complete checkpoints sorted by step, incomplete directories); with `whole_saves`, a save a
    crash left whole but uncommitted counts as complete (a resume commits it: `settle_saves`)."""
    return _scan(checkpoints_root(run_dir), whole_saves)


def _scan(root: str, whole_saves: bool = False) -> Tuple[List[Tuple[int, str]], List[str]]:
    """A step's complete copy: `step_<N>`, else (a kill between the two renames that replace a
    step saved again, when a halt saves the step it holds) its new `.tmp_` copy, else
    the `.stale_` one it replaced; marked complete either way. With `whole_saves`, last, a `.tmp_`
    copy that is whole but not marked."""
    best, dirs = {}, []
    if not os.path.isdir(root):
        return [], []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        match = _STEP_DIR.match(name)
        marked = match is not None and is_complete(path)
        if match and (marked or whole_saves and _whole_save(path)):
            rank = ("", ".tmp_", ".stale_").index(match.group(1) or "") + 3 * (not marked)
            step = int(match.group(2))
            if step not in best or rank < best[step][0]:
                best[step] = (rank, path)
        if os.path.isdir(path):
            dirs.append(path)
    complete = sorted((step, path) for step, (_, path) in best.items())
    chosen = {path for _, path in complete}
    return complete, sorted(p for p in dirs if p not in chosen)


def is_complete(path: str) -> bool:
    """Whether the directory `path` holds a marker with content: every save writes the step into
    it and syncs it, so an empty one is a marker whose write failed (a full disk) or never reached
    the disk (a crash), and the rest of the directory may be as incomplete."""
    try:
        return os.path.getsize(os.path.join(path, MARKER)) > 0
    except OSError:
        return False


def latest_checkpoint(run_dir: str, report: bool = True,
                      whole_saves: bool = False) -> Optional[Tuple[int, str]]:
    """The newest complete checkpoint (step, directory), or None (`whole_saves`: `list_checkpoints`'
    argument); `report` names the incomplete ones on stderr."""
    complete, incomplete = list_checkpoints(run_dir, whole_saves)
    if incomplete and report and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"checkpoint: ignoring incomplete checkpoint(s): {', '.join(incomplete)}",
              file=sys.stderr)
    if complete:
        check_index(complete[-1][1])
    return complete[-1] if complete else None


def publish(tmp: str, step: int) -> str:
    """Mark the save in `tmp` complete (the marker written last, synced) and move it into place as
    `step_<N>`. A `step_<N>` already there (the step saved again: a halt saves the step it holds)
    is moved aside to `.stale_step_<N>` first and deleted once the new copy is in place.
    Returns the final directory."""
    write_synced(os.path.join(tmp, MARKER), f"{step}\n")  # empty: not complete (is_complete)
    root = os.path.dirname(tmp)
    final, stale = os.path.join(root, f"step_{step}"), os.path.join(root, f".stale_step_{step}")
    if os.path.exists(final):
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
    os.rename(tmp, final)
    fsync_path(root)
    shutil.rmtree(stale, ignore_errors=True)
    return final


def settled_path(path: str) -> str:
    """Where `settle_saves` puts the checkpoint at `path`: a `.tmp_` or `.stale_` copy's
    `step_<N>`."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return os.path.join(os.path.dirname(path), f"step_{match.group(2)}") if match else path


def settle_saves(run_dir: str) -> List[str]:
    """Before a resume looks for its checkpoint, finish the saves a crash interrupted once they
    were whole: a `.tmp_step_<N>` holding DCP's index (written after every rank's shards) and the
    trainer state (written before them) is published, as is one marked complete whose publish was
    killed between its renames (the `.stale_` copy it replaced is then deleted). An async save is
    committed only at the next save or the run's end, so a crash in between threw away a written
    checkpoint and went back one more interval. A `.stale_step_<N>` beside a complete `step_<N>`
    (a kill after the renames) is deleted: it held a checkpoint's space forever; one alone goes
    back into place. Returns the directories published. Only the launch's rank 0, holding the
    run's lock, calls this."""
    root = checkpoints_root(run_dir)
    published = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match, path = _STEP_DIR.match(name), os.path.join(root, name)
        if match and match.group(1) == ".tmp_" and (is_complete(path) or _whole_save(path)):
            published.append(publish(path, int(match.group(2))))
    for name in os.listdir(root) if os.path.isdir(root) else []:
        match, stale = _STEP_DIR.match(name), os.path.join(root, name)
        if not (match and match.group(1) == ".stale_"):
            continue
        final = os.path.join(root, f"step_{match.group(2)}")
        if is_complete(final):
            shutil.rmtree(stale, ignore_errors=True)
        elif is_complete(stale) and not os.path.exists(final):  # its new copy never marked
            os.rename(stale, final)
            published.append(final)
    if published:
        print(f"checkpoint: committed the whole save(s) a crash left uncommitted: "
              f"{', '.join(published)}", file=sys.stderr)
    return published


def _whole_save(path: str) -> bool:
    """Whether the `.tmp_step_<N>` at `path` holds every file of its save: DCP's index (written
    after every rank's shards) and the trainer state (written before them)."""
    return os.path.basename(path).startswith(".tmp_") and all(
        os.path.isfile(os.path.join(path, name)) for name in (DCP_INDEX, STATE_FILE))


def prune(step_dir: str) -> None:
    """Delete an old checkpoint: first renamed out of the steps (`.pruned_step_<N>`, one atomic
    rename), then removed, so a kill or an undeletable file mid-removal leaves no half-deleted
    `step_<N>` that every resume lists as incomplete and nothing ever removes (the next launch's
    `remove_unfinished_saves` takes the rest)."""
    pruned = os.path.join(os.path.dirname(step_dir), ".pruned_" + os.path.basename(step_dir))
    os.replace(step_dir, pruned)
    shutil.rmtree(pruned, ignore_errors=True)


def remove_unfinished_saves(run_dir: str) -> None:
    """Delete the `.tmp_step_<N>` directories of saves that never completed (no marker: a crash or a
    full disk mid-save) and what an interrupted prune left (`.pruned_step_<N>`), saying so: nothing
    reads them, and they hold the space a new save needs. Only the launch's rank 0, holding the
    run's lock, calls this."""
    gone = [path for path in list_checkpoints(run_dir)[1]
            if re.fullmatch(r"\.tmp_step_\d+", os.path.basename(path)) and not is_complete(path)
            or re.fullmatch(r"\.pruned_step_\d+", os.path.basename(path))]
    for path in gone:
        try:
            shutil.rmtree(path)
        except OSError as exc:  # e.g. NFS's .nfs files of a shard a dead rank held: left as is
            print(f"checkpoint: note: could not remove the unfinished save {path}: {exc}",
                  file=sys.stderr)
    if gone:
        print(f"checkpoint: removed the unfinished save(s) {', '.join(gone)}", file=sys.stderr)


def resolve_checkpoint(path: str) -> str:
    """A step directory, or a run directory's newest complete checkpoint."""
    if is_complete(path):
        check_index(path)
        return path
    found = latest_checkpoint(path, report=False)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {path} (expected a step_<N>/ with "
                                f"{MARKER}, or a run "
                                "directory holding one)")
    return found[1]


def check_index(path: str) -> None:
    """Refuse the checkpoint `path`, marked complete, when DCP's index of its shards is missing
    (DCP would fail only after the model is built): ValueError naming the file and the newest older
    complete checkpoint, if there is one."""
    path = os.path.normpath(path)
    index = os.path.join(path, DCP_INDEX)
    if os.path.isfile(index):
        return
    match = _STEP_DIR.match(os.path.basename(path))
    older = [p for step, p in _scan(os.path.dirname(path))[0]
             if match and step < int(match.group(2)) and os.path.isfile(os.path.join(p, DCP_INDEX))]
    hint = (f"the newest older complete checkpoint is {os.path.basename(older[-1])}: move "
            f"{os.path.basename(path)} out of {os.path.dirname(path)} to use it" if older else
            "no older complete checkpoint exists")
    raise ValueError(f"checkpoint {path} is marked {MARKER} but lacks its {DCP_INDEX} (DCP's "
                     f"index of its shards); {hint}")
