"""Run tracking: metrics.jsonl in the run directory, wandb with the same keys, a progress bar, and
the evaluator's decoded samples (eval_samples.jsonl beside metrics.jsonl, a wandb table
`eval/samples`).

Only global rank 0 writes. wandb runs offline when no API key is available (and prints the
`wandb sync` hint); its run id is kept in the run directory so a resumed job continues the same
wandb run. The API key is never written anywhere: configs are logged from the typed config tree,
which has no field for it.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import re
import shlex
import sys
import uuid
from typing import Optional
from urllib.parse import urlsplit

from .config import TandemConfig
from .files import naming, write_replacing
from .recipe import as_dict

WANDB_ID_FILE = "wandb_run_id.txt"
SAMPLES_FILE = "eval_samples.jsonl"
"""One record per logged prompt and evaluation: step, prompt, continuation (greedy),
acceptance_length, then `T<t>/continuation`, `T<t>/acceptance_length` per sampled temperature, and
the token ids of each (`prompt_ids`, `output_ids`, `T<t>/output_ids`)."""


def _wandb_has_credentials() -> bool:
    """Whether wandb finds an API key without asking: WANDB_API_KEY, or a netrc entry ($NETRC, else
    ~/.netrc) for the server it talks to (WANDB_BASE_URL, else the one `wandb login --host` set,
    else its default, which wandb 0.31 moved off api.wandb.ai: a `wandb login` went unseen and the
    run went offline)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import wandb

    base = os.environ.get("WANDB_BASE_URL") or _login_host()
    if not base:
        try:
            base = wandb.Settings().base_url
        except Exception:  # an invalid WANDB_* setting: wandb.init names it
            base = ""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(host) for host in {urlsplit(base).netloc, "api.wandb.ai"}
               if host)


def _login_host() -> str:
    """The server `wandb login --host` recorded (wandb's global settings file), or ""."""
    import configparser

    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.expanduser("~/.config/wandb")
    settings = configparser.ConfigParser()
    try:
        settings.read(os.path.join(config_dir, "settings"))
    except configparser.Error:
        return ""
    return settings.get("default", "base_url", fallback="")


def _record_step(line: bytes) -> Optional[int]:
    """A record line's step, None for a line that is no record (torn by a crash mid-write, not
    UTF-8, not a JSON object with an integer step)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop records past `last_step` (written after the checkpoint a resume starts from), and the
    lines that are no record, with a note naming the file, atomically."""
    if not os.path.exists(path):
        return
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            step = _record_step(line)
            dropped += step is None and bool(line.strip())
            if step is not None and step <= last_step:
                kept.append(line.decode("utf-8").rstrip("\n") + "\n")
    if dropped:
        print(f"note: {path}: dropped {dropped} line(s) that are no JSON record with an integer "
              "step (torn by a crash, or edited)", file=sys.stderr)
    write_replacing(path, lambda f: f.writelines(kept))


def _recorded_run_id(path: str) -> str:
    """The wandb run id a run directory recorded, "" when there is none or it is no id wandb takes
    (empty after a crash or a full disk; wandb refused it, and every resume crashed): the run then
    starts a new wandb run, with a note."""
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        text = f.read(256).decode("utf-8", "replace").strip()
    if re.fullmatch(r"[A-Za-z0-9_-]{1,128}", text):
        return text
    print(f"note: {path} holds no wandb run id ({text[:40]!r}); this run logs to a new wandb "
          "run", file=sys.stderr)
    return ""


class MetricsLogger:
    def __init__(self, cfg: TandemConfig, is_main: bool, start_step: int, total_steps: int):
        self.cfg, self.is_main = cfg, is_main
        self.path = os.path.join(cfg.run.dir, "metrics.jsonl")
        self.wandb_run = None
        self.pending_table = None
        self.bar = None
        if not is_main:
            return
        self.samples_path = os.path.join(cfg.run.dir, SAMPLES_FILE)
        self._truncate(start_step)
        if cfg.logging.wandb:
            self.wandb_run = self._init_wandb()
        if cfg.logging.progress:
            from tqdm import tqdm

            # redrawn at most every 0.1 s on a terminal, every minute into a file (a Slurm log took
            # each step's redraw, ~120 bytes, on one line that never ends)
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr,
                            mininterval=0.1 if sys.stderr.isatty() else 60.0)

    def _truncate(self, last_step: int) -> None:
        """Drop the records and samples past `last_step` and append from there: the steps a
        resume or a rewind replays are logged once, with the values of the run that continues."""
        truncate_metrics(self.path, last_step)
        truncate_metrics(self.samples_path, last_step)
        self.file = self._open(self.path)

    @staticmethod
    def _open(path: str):
        """Unbuffered: a record a full disk refused is not kept to fail again, nameless, when the
        loop closes the file (that second error replaced the one naming metrics.jsonl)."""
        return open(path, "ab", buffering=0)

    def rewind(self, last_step: int) -> None:
        """The run went back to its checkpoint of `last_step` (the bad-step guard's `rewind`).
        wandb keeps a step's first values: it ignores the replayed steps up to the bad one."""
        if self.is_main:
            self.file.close()
            self._truncate(last_step)

    def _init_wandb(self):
        import wandb

        run_dir = self.cfg.run.dir
        id_path = os.path.join(run_dir, WANDB_ID_FILE)
        recorded = _recorded_run_id(id_path)
        run_id = recorded or uuid.uuid4().hex[:8]
        # a WANDB_MODE the user set (offline, disabled, dryrun, online) is theirs
        chosen = os.environ.get("WANDB_MODE")
        mode = chosen or ("online" if _wandb_has_credentials() else "offline")
        lg = self.cfg.logging
        init = dict(project=lg.project, entity=lg.entity or None, group=lg.group or None,
                    tags=list(lg.tags) or None, id=run_id, resume="allow", dir=run_dir,
                    name=self.cfg.run.name or os.path.basename(os.path.abspath(run_dir)),
                    config=as_dict(self.cfg), settings=wandb.Settings(silent=True, console="off"))
        try:
            run = wandb.init(mode=mode, **init)
        except Exception as exc:  # a key but no network (a compute node): offline, not a crash
            if chosen or mode != "online":
                raise
            print(f"wandb: cannot reach the server ({' '.join(str(exc).split())[:160]}); logging "
                  "offline", file=sys.stderr)
            mode = "offline"
            run = wandb.init(mode=mode, **init)
        offline = mode in ("offline", "dryrun")
        if run_id != recorded:
            write_replacing(id_path, lambda f: f.write(run_id))
        if offline:  # every attempt's folder of this run, oldest first (the glob sorts by time)
            root = shlex.quote(os.path.dirname(run.dir.rsplit("/files", 1)[0]))
            print(f"wandb: offline run; upload later with: wandb sync "
                  f"{root}/offline-run-*-{run_id}", file=sys.stderr)
        return run

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        # JSON has no NaN: a skipped step's non-finite figures are null (wandb gets them as is)
        line = json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                           for k, v in record.items()}, allow_nan=False)
        with naming(self.path):
            self.file.write((line + "\n").encode("utf-8"))
        if self.wandb_run is not None:
            row = {k: v for k, v in record.items() if k != "step"}
            if self.pending_table is not None and self.pending_table[0] == record["step"]:
                row["eval/samples"] = self.pending_table[1]
            self.pending_table = None
            self.wandb_run.log(row, step=record["step"])

    def log_samples(self, step: int, samples: list) -> None:
        """Append the evaluator's decoded samples (MetricsLogger writes them on rank 0 only) and log
        them as the wandb table `eval/samples` (one row per prompt, text columns where decoded)."""
        if not self.is_main or not samples:
            return
        with naming(self.samples_path), open(self.samples_path, "a") as f:
            for rec in samples:
                f.write(json.dumps({"step": step,
                                    **{k: v for k, v in rec.items() if k != "step"}}) + "\n")
        if self.wandb_run is not None:
            import wandb

            columns = ["step"] + [k for k in samples[0] if k != "step" and not k.endswith("_ids")]
            rows = [[step] + [rec.get(c) for c in columns[1:]] for rec in samples]
            # logged with the step's metrics (one wandb history row per step)
            self.pending_table = (step, wandb.Table(columns=columns, data=rows))

    def progress(self, step: int, record: Optional[dict]) -> None:
        if self.bar is None:
            return
        if record:
            post = {"loss": f"{record['loss']:.3f}", "main": f"{record['loss/main']:.3f}"}
            k = 1
            while f"loss/mtp_{k}" in record:
                post[f"mtp{k}"] = f"{record[f'loss/mtp_{k}']:.3f}"
                k += 1
            if "eval/acceptance_length" in record:
                post["acc_len"] = f"{record['eval/acceptance_length']:.2f}"
            self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)  # (tqdm's mininterval: no redraw per step)

    def close(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
        try:
            with naming(self.path):
                self.file.close()
        finally:  # wandb shut down whatever the file did
            if self.wandb_run is not None:
                import wandb

                self.wandb_run.finish()
                # finish() can return before the offline run file holds the last steps (seen after
                # a logged table); teardown waits for wandb's service to write everything
                wandb.teardown()
