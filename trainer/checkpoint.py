"""Crash-safe checkpoints with torch.distributed.checkpoint (DCP).

Layout: `<run.dir>/checkpoints/step_<N>/` holding DCP shards of {"model", "optim"}, the resolved
`config.yaml`, `trainer_state.json` (step, data position, guard counters) and each rank's RNG state
under `rng/`. A checkpoint is written into `.tmp_step_<N>/`, and only after every rank has finished
does rank 0 write the `COMPLETE` marker (last) and rename the directory into place; so a directory
named step_<N> with a marker is always whole, and resume ignores (and reports) anything else. Old
checkpoints are pruned only after the new one is complete. DCP reshards on load, so a checkpoint
saved under one parallel layout loads under another. Every checkpoint also records the run's
tokenizer (`tokenizer.json`, a copy). A frozen-trunk run's checkpoints hold only the MTP module (+
optimizer) and `frozen_trunk.json`, a fingerprinted reference to the `model.init_from` checkpoint
the trunk is read from (trainer/hf/init_from).
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tandem.data_pipeline.tokenizer import (
    TOKENIZER_SIDE_FILES,
    TandemTokenizer,
    copy_tokenizer,
    same_tokenizer,
    saved_tokenizer,
    tokenizer_file,
)
from tandem.models import TandemModel

from . import safe_dcp
from .checkpoint_dirs import (  # noqa: F401
    MARKER,
    STATE_FILE,
    checkpoints_root,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    prune,
    publish,
    resolve_checkpoint,
)
from .config import TandemConfig
from .config_yaml import read_yaml, read_yaml_mapping
from .files import fsync_path, naming, write_synced
from .hf.init_from import REFERENCE_FILE, check_reference, load_initial_weights, read_reference
from .parallel.sharded_params import allocate
from .recipe import load_config

TRAINABLE_PREFIX = "mtp."
"""What a frozen-trunk run trains (and its checkpoints hold): the MTP module."""
# DCP warns on every single-process save/load that it assumes a single process; that is intended
# here.
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    for kind in ("cuda", "npu"):
        mod = getattr(torch, kind, None)
        if mod is not None and hasattr(mod, "is_available") and mod.is_available():
            state[kind] = mod.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    for kind in ("cuda", "npu"):
        mod = getattr(torch, kind, None)
        # a state saved on a device this machine lacks seeds nothing here (torch has no `npu`
        # without torch_npu: an Ascend run resumed on a GPU or CPU machine failed with a traceback)
        if kind in state and mod is not None and mod.is_available():
            mod.set_rng_state(state[kind])


def save_checkpoint(run_dir: str, step: int, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer],
                    config_yaml: str, trainer_state: dict, keep_last: int = 0) -> str:
    """Collective: every rank calls it; synchronous. Returns the final directory."""
    return CheckpointWriter(run_dir, keep_last).save(step, model, optimizer, config_yaml,
                                                     trainer_state)


class CheckpointWriter:
    """Writes checkpoints synchronously or, with `async_save`, through DCP's async_save: the call
    blocks only while the state is copied to host memory, and the shards are written by a background
    thread. At most one save is in flight; it is committed (marker written last, directory renamed
    into place, old ones pruned) once written (`publish_written()`, which the loop calls every step)
    or at the latest by `finish()`, which the next `save()` and the end of training call, so an
    interrupted background write leaves only a `.tmp_step_<N>/` (committed at the resume when whole,
    checkpoint_dirs.settle_saves)."""

    def __init__(self, run_dir: str, keep_last: int = 0, async_save: bool = False,
                 reference: Optional[dict] = None, tokenizer: Optional[TandemTokenizer] = None):
        self.run_dir, self.keep_last, self.async_save = run_dir, keep_last, async_save
        # The run's tokenizer is recorded in every checkpoint (a copy of its tokenizer.json, with
        # the end-of-document token its data was made with): a fine-tune, `tandem eval` and
        # `tandem export` of the checkpoint use it (data_pipeline/dataset.py).
        self.tokenizer = tokenizer
        # Frozen trunk (train.freeze_trunk with model.init_from): save only the trainable MTP module
        # and this reference to the trunk's checkpoint (path + content fingerprint,
        # trainer/hf/init_from.py).
        self.reference = reference
        self.pending = None
        self.published = False
        """Whether the save in flight is committed already (`publish_written`)."""
        self._gloo_group = None

    def save(self, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
             config_yaml: str, trainer_state: dict) -> str:
        """Start (async) or write (sync) checkpoint `step`; returns the directory it will have."""
        self.finish()
        root = checkpoints_root(self.run_dir)
        tmp = os.path.join(root, f".tmp_step_{step}")
        if _rank() == 0:
            os.makedirs(root, exist_ok=True)
            final = os.path.join(root, f"step_{step}")
            if is_complete(tmp) and not os.path.exists(final):
                os.rename(tmp, final)  # the step's only complete copy (checkpoint_dirs._scan)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, "rng"))
        _barrier()
        if optimizer is not None:
            stepped = bool(optimizer.state)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            if not stepped:
                # torch gave an optimizer that never stepped (every update so far skipped) a
                # zero-gradient step for its template: saved or kept, the next real update would
                # take step 2's bias correction
                optimizer.state.clear()
                optim_sd["state"] = {}
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        if self.reference is not None:
            state["model"] = {k: v for k,
                              v in state["model"].items() if k.startswith(TRAINABLE_PREFIX)}
        # through bytes: torch.save's own writer reports a full disk as "unexpected pos 64 vs 0"
        rng = io.BytesIO()
        torch.save(_rng_state(), rng)
        write_synced(os.path.join(tmp, "rng", f"rank{_rank()}.pt"), rng.getvalue())
        if _rank() == 0:  # before the shards: DCP's index, written after them, then means whole
            self._write_metadata(tmp, step, config_yaml, trainer_state)
        self.pending, self.published = (self._write_shards(state, step, tmp), step, tmp), False
        if not self.async_save:
            self.finish()
        return os.path.join(root, f"step_{step}")

    def _write_shards(self, state: dict, step: int, tmp: str):
        """DCP's write of `state` into `tmp`: its future with async_save, else None once written."""
        with self._failure_named(step, tmp, background=False):
            if self.async_save:
                return dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_group())
            dcp.save(state, checkpoint_id=tmp)
        return None

    def _async_group(self):
        """The group async_save coordinates over: a gloo group of its own (torch 2.13 needs a CPU
        backend: "A CPU backend must be enabled for async save"), made once, collectively (every
        rank saves). Not the default group, even where it has a CPU backend: the save's planning
        collectives run in a background thread while the next steps' collectives run in the main
        one, and on one group the ranks paired them in different orders (gloo reported a collective
        mismatch, or hung, at a run's first save under dp=2)."""
        if not dist.is_initialized():
            return None
        if self._gloo_group is None:
            self._gloo_group = dist.new_group(backend="gloo")
        return self._gloo_group

    @contextmanager
    def _failure_named(self, step: int, tmp: str, background: bool) -> Iterator[None]:
        """DCP reports a failed write (with every rank's error) as a CheckpointException, a
        BaseException the commands' handlers miss: a traceback per rank. It leaves as one OSError
        line instead, naming the directory, the ranks, their errors and the checkpoint kept."""
        try:
            yield
        except CheckpointException as exc:
            raise OSError(_save_failure(self.run_dir, step, tmp, exc, background)) from None

    def publish_written(self) -> None:
        """Commit the save in flight if it is written, without waiting and without a collective:
        on rank 0 only, whose DCP save ends after DCP wrote its index, which it writes once every
        rank's shards are written (the other ranks' state files precede their shards). A
        checkpoint then shows as complete (to `tandem eval`, a watcher, keep_last) a few steps after
        its save began, not a checkpoint interval later. A failed write is left to `finish()`,
        which raises it on every rank."""
        if self.pending is None or self.published or _rank() != 0:
            return
        future, step, tmp = self.pending
        if future is None or not future.done() or future.exception() is not None:
            return
        self._publish(tmp, step)
        self.published = True

    def finish(self) -> Optional[str]:
        """Wait for the save in flight (if any) on every rank, then commit it. Collective."""
        if self.pending is None:
            return None
        future, step, tmp = self.pending
        self.pending = None
        if future is not None:
            with self._failure_named(step, tmp, background=True):
                future.result()
        _barrier()
        final = os.path.join(checkpoints_root(self.run_dir), f"step_{step}")
        if _rank() == 0 and not self.published:
            self._publish(tmp, step)
        _barrier()
        return final

    def _write_metadata(self, tmp: str, step: int, config_yaml: str, trainer_state: dict) -> None:
        """Beside the shards, before them: the config, the frozen trunk's reference, the tokenizer
        and last the trainer state, each synced; with DCP's index after the shards, the directory
        is whole (checkpoint_dirs.settle_saves commits it after a crash)."""
        write_synced(os.path.join(tmp, "config.yaml"), config_yaml)
        if self.reference is not None:
            write_synced(os.path.join(tmp, REFERENCE_FILE), json.dumps(self.reference, indent=1))
        with naming(os.path.join(tmp, "tokenizer.json")):  # or a side file copied with it
            _record_tokenizer(self.tokenizer, tmp)
            for name in ("tokenizer.json", *TOKENIZER_SIDE_FILES):
                if os.path.exists(os.path.join(tmp, name)):
                    fsync_path(os.path.join(tmp, name))
        # the torch that wrote it: an older one cannot read a newer one's DCP index
        write_synced(os.path.join(tmp, STATE_FILE),
                     json.dumps({"step": step, "torch": torch.__version__, **trainer_state},
                                indent=1))
        fsync_path(tmp)

    def _publish(self, tmp: str, step: int) -> None:
        """Mark the checkpoint complete and move it into place (checkpoint_dirs.publish), then
        drop the oldest beyond keep_last."""
        fsync_path(os.path.join(tmp, "rng"))
        publish(tmp, step)
        if self.keep_last > 0:
            complete, _ = list_checkpoints(self.run_dir)
            for _, old in complete[:-self.keep_last]:
                prune(old)


def _record_tokenizer(tokenizer: Optional[TandemTokenizer], step_dir: str) -> None:
    if tokenizer is not None and tokenizer_file(tokenizer.path) is not None:
        copy_tokenizer(tokenizer.path, step_dir, tokenizer.eod_token)


def _save_failure(run_dir: str, step: int, tmp: str, exc: CheckpointException,
                  background: bool) -> str:
    """One line for a failed DCP write: where, which ranks failed and why, what a resume uses."""
    causes: dict = {}
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure  # (exception, its frames)
        causes.setdefault(" ".join(str(error).split()) or type(error).__name__, []).append(rank)
    why = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {cause}"
                    for cause, ranks in causes.items())
    complete = list_checkpoints(run_dir)[0]
    kept = (f"the newest complete checkpoint, {complete[-1][1]}, is kept" if complete else
            "no complete checkpoint was kept (none was saved before)")
    when = " (in the background; this is the next save)" if background else ""
    return f"the checkpoint of step {step} could not be written{when} into {tmp}: {why}; {kept}"


def check_compatible(path: str, config_yaml: str) -> None:
    """Refuse a checkpoint whose model shape differs from the current config (names the keys)."""
    saved = _saved_config(path)
    current = OmegaConf.create(read_yaml(config_yaml))
    defaults = OmegaConf.structured(TandemConfig)

    def differences(section, skip=()):
        out = []
        for key, value in OmegaConf.to_container(current[section]).items():
            if key in skip:
                continue
            # a key newer than the checkpoint was saved with counts as its default value
            old = OmegaConf.select(saved, f"{section}.{key}",
                                   default=OmegaConf.select(defaults, f"{section}.{key}"))
            if old != value:
                out.append(f"{section}.{key}: checkpoint {old!r} vs config {value!r}")
        return out

    shape = differences("model", {"init_from", *RESUMABLE_MODEL_KEYS}) + differences(
        "mtp", {"loss", "detach_trunk", "loss_chunk_tokens", "init_from_last_layer",
                 "init_from"})
    if shape:
        raise ValueError(f"checkpoint {path} has a different model shape: " + "; ".join(shape))
    tokenizer = [d for d in differences("data") if d.split(":")[0] in ("data.source",
                                                                       "data.tokenizer",
                                                                       "data.vocab_size")]
    given, recorded = current.data.tokenizer, saved_tokenizer(path)
    if given and recorded and tokenizer_file(given):
        # the checkpoint's recorded copy decides, not the path (same ids, same end-of-document
        # token): the same tokenizer at another path resumes (a fine-tune's source step pruned by
        # its run, whose newer step holds it), one rewritten in place since does not
        if same_tokenizer(recorded, os.path.expanduser(given)):
            tokenizer = [d for d in tokenizer if not d.startswith("data.tokenizer:")]
        elif not tokenizer:
            tokenizer = [f"data.tokenizer: {given} no longer holds the tokenizer the checkpoint "
                         "recorded (its tokenizer.json)"]
    if tokenizer:
        raise ValueError(f"checkpoint {path} was trained with a different tokenizer: "
                         + "; ".join(tokenizer))
    window = [d for d in differences("data") if d.split(":")[0] == "data.seq_len"]
    if window:
        # its position counts samples of the saved window (and the schedule counts them): at another
        # window the same count is other tokens in another order
        raise ValueError(f"checkpoint {path} was trained at another window ({window[0]}): its "
                         "sample stream does not continue at another data.seq_len; start a new "
                         f"stage from it with model.init_from={path} in another run.dir")


RESUMABLE_MODEL_KEYS = ("aux_loss_coef", "bias_update_rate", "z_loss_coef", "indexer_loss_coef",
                        "indexer_warmup", "indexer_warmup_steps", "init_std", "linear_kernel",
                        "qsa_form", "expert_matmul", "max_seq_len")
"""`model.*` keys a resume may change: training coefficients, warm-up schedules, kernel choices and
the positions the rotary tables cover (no weight), which leave the weights' layout as it was (a
resume refused them as 'a different model shape'; a longer window, which needs a larger
max_seq_len, then met that refusal instead of the window's, which says what to do)."""


def pinned_init_from(path: str, given: str, key: str = "model.init_from") -> str:
    """The `key` (model.init_from or mtp.init_from) that a resume from the checkpoint at `path`
    reads: the step directory the run started from (its saved config records it) when `given` names
    the run directory that holds it, whose newest checkpoint moves on as that run trains; else
    `given`."""
    saved = str(OmegaConf.select(_saved_config(path), key, default="") or "")
    inside = os.path.abspath(saved).startswith(os.path.abspath(given) + os.sep) if given else False
    return saved if inside and os.path.isdir(saved) else given


def saved_section(path: str, section: str) -> dict:
    """One section of the config a checkpoint was saved with, as a plain dict ({} if it lacks
    it)."""
    node = OmegaConf.select(_saved_config(path), section, default=None)
    return OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}


def _saved_config(path: str) -> DictConfig:
    """The checkpoint's config.yaml; ValueError naming the file when it is not a YAML mapping."""
    file = os.path.join(path, "config.yaml")
    return OmegaConf.create(read_yaml_mapping(file, f"checkpoint config {file}", ValueError,
                                              empty_ok=False))


def _saved_model_keys(path: str) -> set:
    meta = safe_dcp.read_metadata(path).state_dict_metadata
    return {k[len("model."):] for k in meta if k.startswith("model.")}


def _only_saved(model_sd: dict, path: str) -> dict:
    """A frozen-trunk checkpoint holds only the MTP module: restrict to it (all of it must be
    there)."""

    if read_reference(path) is None:
        return model_sd
    saved = _saved_model_keys(path)
    missing = [k for k in model_sd if k.startswith(TRAINABLE_PREFIX) and k not in saved]
    if missing:
        raise ValueError(f"checkpoint {path} lacks MTP tensors: {', '.join(sorted(missing))}")
    return {k: v for k, v in model_sd.items() if k in saved}


def _unstepped(optim_sd: dict, path: str) -> set:
    """The parameters the checkpoint holds no AdamW state for (never updated when it was saved:
    the QSA indexer-only warm-up's frozen model, an MTP layer no depth uses, a run whose every
    update was skipped), taken out of `optim_sd`'s template: torch's template gives every parameter
    a state, which the load then required."""
    saved = {k[len("optim.state."):] for k in safe_dcp.read_metadata(path).state_dict_metadata
             if k.startswith("optim.state.")}
    held = {k.rsplit(".", 1)[0] for k in saved}  # `<fqn>.<exp_avg|exp_avg_sq|step>`
    unstepped = {name for group in optim_sd["param_groups"] for name in group["params"]} - held
    optim_sd["state"] = {k: v for k, v in optim_sd["state"].items() if k not in unstepped}
    return unstepped


def load_checkpoint(path: str, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """Collective: load model (+ optimizer) shards in place, restore this rank's RNG; return trainer
    state. A frozen-trunk checkpoint loads the MTP module only (the trunk came from
    model.init_from)."""
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        unstepped = _unstepped(optim_sd, path)
        # this rank's parameter names, in its optimizer's order: the load below replaces the
        # template's lists with the saved ones (another layout's, e.g. one pipeline rank's), which
        # are put back. torch maps a loaded state onto the optimizer by those lists; it splits
        # foreign ones by name, but not when this rank loads no state (a pipeline rank holding only
        # frozen or unstepped parameters), and then refused their sizes
        names = [list(group["params"]) for group in optim_sd["param_groups"]]
        state = {"model": _only_saved(model_sd, path), "optim": optim_sd}
        safe_dcp.load(state, path)
        for group, group_names in zip(state["optim"]["param_groups"], names):
            group["params"] = group_names
        set_model_state_dict(model, state["model"],
                             options=StateDictOptions(strict=len(state["model"]) == len(model_sd)))
        set_optimizer_state_dict(model, optimizer, state["optim"],
                                 options=StateDictOptions(strict=not unstepped))
        for group, group_names in zip(optimizer.param_groups, names):
            for p, name in zip(group["params"], group_names):
                if name in unstepped:  # as in the saved run: its first update is step 1
                    optimizer.state.pop(p, None)
    else:
        model_sd = get_model_state_dict(model)
        state = {"model": _only_saved(model_sd, path)}
        safe_dcp.load(state, path)
        set_model_state_dict(model, state["model"],
                             options=StateDictOptions(strict=len(state["model"]) == len(model_sd)))
    rng_path = os.path.join(path, "rng", f"rank{_rank()}.pt")
    if os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=True))
    return read_trainer_state(path)


def read_trainer_state(path: str) -> dict:
    """A checkpoint's trainer state: `step`, the data position (`consumed_samples`,
    `consumed_tokens`, the `global_batch` it ran with, `schedule_global_batch`, `skipped_samples`:
    DataPosition.state()) and the bad-step guard's counters. Read without loading any tensor;
    ValueError naming the file (and line) when it is not a JSON object with an integer step."""
    file = os.path.join(path, STATE_FILE)
    with open(file, encoding="utf-8") as f:
        try:
            state = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except UnicodeDecodeError:
            raise ValueError(f"{file}: not UTF-8 text") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file}: not a JSON object with an integer 'step'")
    return state


def load_model_from_checkpoint(path: str, device: torch.device | str = "cpu"):
    """Single-process: rebuild the model a checkpoint was trained with and load its weights.

    `path` is a step directory or a run directory (its newest complete checkpoint). The model is
    built on the meta device and its storage filled straight from the checkpoint (no random init, no
    second copy); a frozen-trunk checkpoint's trunk is read from its (fingerprint-checked)
    reference. Returns (model in eval mode, TandemConfig).
    """

    path = resolve_checkpoint(path)
    cfg = load_config(os.path.join(path, "config.yaml"))
    ref = read_reference(path)
    if ref is not None:
        check_reference(ref, path)
    with torch.device("meta"):
        model = TandemModel(cfg.model, cfg.mtp)
    allocate(model, torch.device(device))
    if ref is not None:
        load_initial_weights(model, ref["path"], mtp_init_from_last_layer=False)
    model_sd = get_model_state_dict(model)
    state = {"model": _only_saved(model_sd, path)}
    safe_dcp.load(state, path)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=ref is None))
    return model.eval(), cfg

