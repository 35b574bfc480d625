"""What `tandem launch slurm` checks before it writes or submits a job: the model the job will
train (a fine-tuning recipe's is its model.init_from checkpoint's), its layout at the job's world
size, whether `--resume` could start, whether the checkpoints it reads are there, and `--check`'s
parameter and memory figures. Each check prints its one-line error and returns False."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

from tandem.data_pipeline.chat import expand_paths
from tandem.data_pipeline.dataset import check_prefix, check_vocab, data_tokenizer, parse_blend
from tandem.trainer.checkpoint import check_compatible
from tandem.trainer.checkpoint_dirs import latest_checkpoint
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.context_cost import cp_sweep, device_fit
from tandem.trainer.estimate import count_params, estimate
from tandem.trainer.hf.init_from import make_reference, resolve_init_from
from tandem.trainer.materialize import mtp_checkpoint_step
from tandem.trainer.parallel.validate import layout_dp, validate_layout
from tandem.trainer.recipe import explicit_keys, to_yaml
from tandem.trainer.run import (
    adopt_init_from,
    check_frozen_reference,
    check_ple_end_of_document,
    earlier_run_files,
    past_max_steps,
    pin_init_from,
)


def print_check(cfg, args: argparse.Namespace, world: int) -> None:
    """`--check`: the layout's parameter counts and per-rank memory, whether that fits the recipe's
    device, the node count, and for a context-parallel recipe the same at every cp size of
    context_cost.CP_SIZES."""

    counts = count_params(cfg)
    est = estimate(cfg, world, counts)
    per_node = world // args.nodes
    print(f"tandem launch slurm --check: {args.recipe} at world size {world}: layout ok; "
          f"{est.summary()}"
          f"\n  per rank: {device_fit(cfg, est.total_gib_per_rank)} on {args.nodes} nodes of "
          f"{per_node}")
    if cfg.parallel.cp > 1:
        lines = cp_sweep(cfg, per_node, lambda trial, size: estimate(trial, size, counts))
        print("  per-rank memory by parallel.cp (the other degrees as set):\n    "
              + "\n    ".join(lines))


def resumable(cfg, args: argparse.Namespace, shape_known: bool = True) -> bool:
    """The job always passes --resume: refuse now what `tandem train --resume` would refuse on the
    cluster (a newest complete checkpoint in run.dir of another model shape or tokenizer, trained on
    another frozen trunk, or past train.max_steps), a checkpoint at train.max_steps (the job would
    train nothing), and an earlier run without a complete checkpoint that no launch of this recipe
    and overrides started (--resume would start it again from step 0, over its files); False after
    printing the error. `shape_known`: `adopt_sources` took the model from its sources; a source
    not there yet leaves the shape and trunk checks to the job."""
    found = latest_checkpoint(cfg.run.dir, report=False)
    why, past = None, past_max_steps(found, cfg.train.max_steps)
    if found is not None and found[0] == cfg.train.max_steps:
        past = (f"run.dir's newest checkpoint {found[1]} is at config key 'train.max_steps'="
                f"{cfg.train.max_steps}, so the job would train nothing: raise it")
    if found is None:
        held = earlier_run_files(cfg.run.dir) if os.path.isdir(cfg.run.dir) else []
        if held and not launched_before(cfg.run.dir, args):
            why = (f"config key 'run.dir'={cfg.run.dir!r} holds an earlier run ({', '.join(held)}; "
                   "no complete checkpoint) that no launch of this recipe and overrides started, "
                   "and the job's --resume would start it again from step 0")
    elif past:
        why = past
    elif shape_known:
        try:
            check_compatible(found[1], to_yaml(cfg))
            frozen = cfg.model.init_from and cfg.train.freeze_trunk
            check_frozen_reference(found[1], make_reference(cfg.model.init_from) if frozen
                                   else None)
        except (ValueError, OSError) as exc:
            why = f"{exc} (the job runs tandem train --resume)"
    if why:
        _refuse_run_dir(why)
    return why is None


def _refuse_run_dir(why: str) -> None:
    print(f"tandem launch slurm: error: {' '.join(why.split())}; choose another run.dir; nothing "
          "submitted", file=sys.stderr)


def adopt_sources(cfg, args: argparse.Namespace) -> Tuple[bool, bool]:
    """The model a fine-tuning job trains: model.init_from's shape, tokenizer and MTP wiring (and
    mtp.init_from's wiring), which the job takes from them as it starts (run.adopt_init_from),
    read where a resume of run.dir's newest checkpoint reads them (run.pin_init_from); taken here
    too, so that the layout, resume and `--check` checks see that model, not the recipe's
    placeholder. A source that is not there yet (a stage still to run) leaves the recipe's shape,
    with a note under `--check` (`sources_exist` decides whether to submit); one that is there but
    cannot be read or trained in this layout is an error (a job queued behind another's is
    submitted with it as a note: that stage may still be writing it). Returns (go on, the model's
    shape is the one the job trains), after printing the error when not going on."""
    if not (cfg.model.init_from or cfg.mtp.init_from):
        return True, True
    missing = _missing_source(cfg)
    if missing is not None:
        if args.check:
            print(f"tandem launch slurm: the recipe's own model shape is checked ({missing})",
                  file=sys.stderr)
        return True, False
    found = latest_checkpoint(cfg.run.dir, report=False)
    try:  # run.dir's own checkpoint: no dependency mends it
        if found is not None:
            pin_init_from(cfg, found[1])
    except (ValueError, OSError) as exc:
        _refuse_run_dir(f"{exc} (the job runs tandem train --resume)")
        return False, False
    try:
        adopt_init_from(cfg, explicit_keys(args.recipe, args.overrides))
    except (ValueError, OSError) as exc:  # ConfigError, CheckpointError, another tokenizer
        after = _dependency(args)
        if after and not args.check:
            print(f"tandem launch slurm: {exc}; submitted anyway, after {after}", file=sys.stderr)
            return True, False
        print(f"tandem launch slurm: error: {exc}; nothing submitted", file=sys.stderr)
        return False, False
    return True, True


def sources_exist(cfg, args: argparse.Namespace) -> bool:
    """Whether the checkpoints model.init_from and mtp.init_from name, the data and data.tokenizer
    are there (the job reads them as it starts, on every node it was given), the data's tokenizer
    fits the model, and run.dir is free;
    False after printing the error. `--check` and `--dry-run` submit nothing, so they pass a recipe
    whose stage has yet to run; so does a job queued behind another
    (`--sbatch-arg=--dependency=afterok:<job>`: the stage or preprocessing that writes them, the run
    that holds run.dir), or one whose files only the cluster's nodes see (`--files-on-nodes`),
    which checks them as it starts."""
    missing = (_missing_source(cfg) or _missing_data(cfg) or _tokenizer_misfit(cfg)
               or _held_run_dir(cfg.run.dir))
    if missing is None:
        return True
    deferred = _deferred(args)
    if deferred:
        print(f"tandem launch slurm: {missing}; submitted anyway, {deferred}", file=sys.stderr)
        return True
    print(f"tandem launch slurm: error: {missing}; nothing submitted", file=sys.stderr)
    return False


def note_missing_data(cfg) -> None:
    """Under `--check` / `--dry-run`, which submit nothing: the data or tokenizer the job could not
    read as it starts, said as a note (they passed in silence; only a submission refused them)."""
    missing = _missing_data(cfg) or _tokenizer_misfit(cfg)
    if missing:
        print(f"tandem launch slurm: note: {missing}; a submission is refused until it is there "
              "(or with --files-on-nodes)", file=sys.stderr)


def _missing_source(cfg) -> Optional[str]:
    """Why model.init_from or mtp.init_from names no checkpoint (yet), or None."""
    try:
        if cfg.model.init_from:
            resolve_init_from(cfg.model.init_from)
        if cfg.mtp.init_from:
            mtp_checkpoint_step(cfg.mtp.init_from)
    except (FileNotFoundError, ConfigError) as exc:
        return str(exc)
    return None


def _missing_data(cfg) -> Optional[str]:
    """Why the job's data is not there (a Megatron prefix's files, a record file, data.tokenizer),
    or None; the embedded corpus is prepared by the job itself."""
    data = cfg.data
    if data.tokenizer and not os.path.exists(os.path.expanduser(data.tokenizer)):
        return f"config key 'data.tokenizer'={data.tokenizer!r}: no such file or directory"
    try:
        for key in ("paths", "valid_paths"):
            values = getattr(data, key)
            if values and data.source == "megatron":
                for prefix in parse_blend(values)[0]:
                    check_prefix(prefix)
            elif values and data.source == "jsonl":
                expand_paths(values)
    except (ValueError, OSError) as exc:
        return f"config key 'data.{key}': {exc}"
    return None


def _tokenizer_misfit(cfg) -> Optional[str]:
    """Why the data's tokenizer does not fit the model (ids past model.vocab_size, or PLE's
    end-of-document id not the tokenizer's), as the job finds once it has built its data; or
    None."""
    try:
        tokenizer = data_tokenizer(cfg.data)
        if tokenizer is not None:
            check_vocab(tokenizer.path, tokenizer.vocab_size, cfg.model.vocab_size)
            check_ple_end_of_document(cfg, tokenizer)
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def _held_run_dir(run_dir: str) -> Optional[str]:
    """Why run.dir is taken (a running run holds its lock: the job would refuse it), or None."""
    lock = os.path.join(run_dir, ".tandem.lock")
    try:
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the file closes
            except BlockingIOError:
                holder = " ".join(f.read().split()) or "another process"
                return f"config key 'run.dir'={run_dir!r} is in use by a running run ({holder})"
    except OSError:  # none yet, unreadable here, or no flock on this file system: the job decides
        pass
    return None


def _deferred(args: argparse.Namespace) -> Optional[str]:
    """Why the files the job reads are left for the job to check (after the job it waits on, or
    --files-on-nodes: they are only on the cluster's nodes), or None."""
    if args.files_on_nodes:
        return "with --files-on-nodes"
    after = _dependency(args)
    return f"after {after}" if after else None


def _dependency(args: argparse.Namespace) -> Optional[str]:
    """The job's `--sbatch-arg=--dependency=...` (the last), or None."""
    after = [a for a in args.sbatch_arg if a.startswith(("--dependency", "-d"))]
    return after[-1] if after else None


def launched_before(run_dir: str, args: argparse.Namespace) -> bool:
    """Whether a launch recorded in run_dir/slurm/ had this recipe and these overrides (a job
    relaunched, or requeued by hand, before its first checkpoint)."""
    for path in sorted(Path(run_dir, "slurm").glob("*.json")):
        try:
            seen = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        recipe = os.path.join(seen.get("cwd", ""), seen.get("recipe") or "")
        if (os.path.realpath(recipe) == os.path.realpath(args.recipe)
                and seen.get("overrides") == list(args.overrides)):
            return True
    return False


def layout_fits(cfg, args: argparse.Namespace, world: int, shape_known: bool = True) -> bool:
    """What `tandem train` checks before any work, for the world size the job will have; False after
    printing the error. A job queued behind the stage that writes its model.init_from, or one whose
    source only the nodes see (`shape_known` False), has only the recipe's own shape, which that
    checkpoint replaces: a shape check that fails is then a note, and the job checks the layout as
    it starts."""
    deferred = None if shape_known or args.check else _deferred(args)
    try:
        try:
            validate_layout(cfg, world)
        except ConfigError as exc:
            if not deferred:
                raise
            layout_dp(cfg, world)  # the degrees against the world size need no shape: an error
            print(f"tandem launch slurm: {exc} with the recipe's own model shape; submitted "
                  f"anyway, {deferred}", file=sys.stderr)
    except ConfigError as exc:
        print(f"tandem launch slurm: error: {exc} (world size {world} = --nodes {args.nodes} x "
              f"{world // args.nodes} per node); nothing submitted", file=sys.stderr)
        return False
    return True
