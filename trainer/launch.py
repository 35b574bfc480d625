"""`tandem launch slurm`: render an sbatch script for a recipe and submit it.

    tandem launch slurm RECIPE [key=value ...] --nodes N (--gpus-per-node G | --procs-per-node P)
        [--partition P] [--time T] [--account A] [--job-name NAME] [--cpus-per-task C]
        [--signal-seconds S] [--env-dir DIR] [--sbatch-arg ARG ...] [--dry-run] [--check]

The recipe and overrides are validated with `load_config` first, then the parallel layout and batch
against the job's world size (nodes x processes per node) exactly as `tandem train` checks them: a
ConfigError prints one line and exits 2, before anything is written or submitted. The job always
resumes, so a newest checkpoint in run.dir that `tandem train --resume` would refuse (another model
shape or tokenizer) is refused here too, and run.dir must be writable. `--check` also
builds the model on the meta device (trainer/estimate.py) and prints parameter counts and per-rank
memory, then stops. The script is rendered from `slurm/train.sbatch.tmpl` (see its header for how
the pre-timeout SIGUSR1 reaches every trainer rank), written to
`<run.dir>/slurm/launch_<timestamp>.sbatch` with the trainer's exact argv beside it
(`launch_<timestamp>.json`), and submitted with `sbatch --parsable`; the job id is printed.
`--dry-run` prints the script and writes and submits nothing.

Quoting: every value that reaches the shell is `shlex.quote`d, so a recipe path or override
containing `$(...)`, backticks, quotes, `;` or newlines arrives literally in the trainer's argv.
`#SBATCH` lines are not shell code (sbatch parses them itself), so values placed there are
restricted to a safe character set and anything else is rejected before rendering.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import tandem.slurm as tandem_slurm
from tandem.trainer.config_checks import ConfigError
from tandem.trainer.launch_checks import (
    adopt_sources,
    layout_fits,
    note_missing_data,
    print_check,
    resumable,
    sources_exist,
)
from tandem.trainer.recipe import load_config
from tandem.trainer.run import prepare_run_dir

SLURM_DIR = Path(tandem_slurm.__file__).resolve().parent
"""Templates and env.d: the package data of `tandem.slurm` (the repository's slurm/); override with
TANDEM_SLURM_DIR."""

DEFAULT_SIGNAL_SECONDS = 120
GPU_CPUS_PER_TASK = 8
"""Default CPUs per GPU rank when --cpus-per-task is not given (CPU-only runs get one per rank)."""

# Values that go on `#SBATCH` lines: sbatch parses these itself (no shell), and splits on
# whitespace.
_DIRECTIVE_SAFE = re.compile(r"[A-Za-z0-9_@%:/.,=+\-~\[\]]+")
"""Matched whole (`fullmatch`): `$` also matches before a final newline, which then ended the
#SBATCH block, and sbatch silently dropped every directive after it (--signal, --requeue)."""


class LaunchError(ValueError):
    """A launcher argument is unusable; the message is one line."""


def _slurm_dir() -> Path:
    return Path(os.environ.get("TANDEM_SLURM_DIR", SLURM_DIR))


def _directive_value(name: str, value: str, allow_percent: bool = True) -> str:
    value = str(value)
    if not value or not _DIRECTIVE_SAFE.fullmatch(value) or (not allow_percent and "%" in value):
        raise LaunchError(
            f"{name}={value!r} cannot go on an #SBATCH line: use letters, digits and _@:/.,=+-~[] "
            "only"
            + ("" if allow_percent else " (no %, Slurm expands it in file names)")
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem launch slurm",
        description="Render an sbatch script for a recipe (torchrun per node, requeue on "
                    "pre-timeout signal) and "
                    "submit it.",
    )
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides passed to `tandem train`")
    p.add_argument("--nodes", type=int, required=True, help="nodes (one torchrun per node)")
    per_node = p.add_mutually_exclusive_group(required=True)
    per_node.add_argument("--gpus-per-node", type=int,
                          help="accelerators per node: requests gres=<gres-name>:G and starts G "
                               "ranks per node")
    per_node.add_argument("--procs-per-node", type=int, help="CPU-only: ranks per node, no gres")
    p.add_argument("--gres-name", default=None,
                        help="generic resource to request per node (default: npu for device=npu "
                             "recipes, else gpu)")
    p.add_argument("--cpus-per-task", type=int,
                   help=f"CPUs for each node's task (default: P, or {GPU_CPUS_PER_TASK} per GPU)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time", help="time limit (Slurm syntax, e.g. 04:00:00 or 2-00:00:00)")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--job-name", help="job name (default: tandem-<basename of run.dir>)")
    p.add_argument(
        "--signal-seconds", type=int, default=DEFAULT_SIGNAL_SECONDS,
        help="send SIGUSR1 to the trainer this many seconds before the time limit (default "
             f"{DEFAULT_SIGNAL_SECONDS})",
    )
    p.add_argument("--env-dir",
                   help="directory of *.sh files sourced before launch (default: slurm/env.d)")
    p.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="ARG",
        help="extra sbatch option written as an #SBATCH line; use the = form, e.g. "
             "--sbatch-arg=--exclusive "
             "(repeatable)",
    )
    p.add_argument("--files-on-nodes", action="store_true",
                   help="the checkpoints, data and tokenizer the job reads (and run.dir) are only "
                        "on the cluster's nodes: a check that finds one missing here is a note, "
                        "and the job checks it as it starts")
    p.add_argument("--dry-run", action="store_true",
                   help="print the script; write and submit nothing")
    p.add_argument("--check", action="store_true",
                   help="validate, build the model on the meta device and print parameter counts "
                        "and per-rank "
                        "memory for this world size; write and submit nothing")
    return p


def trainer_argv(recipe: str, overrides: Sequence[str]) -> List[str]:
    """The command each rank runs: always --resume, so a requeued job continues in run.dir."""
    return ["tandem", "train", recipe, *overrides, "--resume"]


def _render(template: str, values: Dict[str, str]) -> str:
    def sub(m: "re.Match[str]") -> str:
        return values[m.group(1)]

    out = re.sub(r"\{\{(\w+)\}\}", sub, template)
    return out


def render_sbatch(args: argparse.Namespace, run_dir: str, workdir: Optional[str] = None) -> str:
    """The batch script for parsed launcher args and the resolved run.dir. Raises LaunchError."""
    gpus, nproc, cpus = _task_sizes(args)
    workdir = os.path.abspath(workdir or os.getcwd())
    log_dir = _directive_value("run.dir",
                               os.path.join(os.path.abspath(os.path.join(workdir, run_dir)),
                                            "slurm"),
                               allow_percent=False)
    job_name = args.job_name or "tandem-" + re.sub(r"[^A-Za-z0-9_.\-]", "_",
                                                   os.path.basename(os.path.normpath(run_dir))
                                                   or "run")
    directives = _sbatch_directives(args, job_name, gpus, cpus, log_dir)
    if args.env_dir and not os.path.isdir(args.env_dir):
        # the script skips a missing directory: the job would run without the site's settings
        raise LaunchError(f"--env-dir {args.env_dir} is not a directory")
    env_d = args.env_dir or str(_slurm_dir() / "env.d")
    template = (_slurm_dir() / "train.sbatch.tmpl").read_text()
    return _render(
        template,
        {
            "sbatch_directives": "\n".join(f"#SBATCH {x}" for x in directives),
            "workdir": shlex.quote(workdir),
            "env_d": shlex.quote(os.path.abspath(env_d)),
            "nproc_per_node": str(int(nproc)),
            "train_argv": " ".join(shlex.quote(a) for a in trainer_argv(args.recipe,
                                                                        args.overrides)),
        },
    )


def _task_sizes(args: argparse.Namespace) -> Tuple[Optional[int], int, int]:
    """(GPUs per node or None, processes per node, CPUs of the node's one task), checked."""
    if args.nodes < 1:
        raise LaunchError("--nodes must be >= 1")
    gpus = args.gpus_per_node
    nproc = gpus if gpus is not None else args.procs_per_node
    if nproc is None or nproc < 1:
        raise LaunchError("--gpus-per-node / --procs-per-node must be >= 1")
    cpus = args.cpus_per_task if args.cpus_per_task is not None else (nproc * GPU_CPUS_PER_TASK
                                                                      if gpus else nproc)
    if cpus < 1:
        raise LaunchError("--cpus-per-task must be >= 1")
    if args.signal_seconds < 0:
        raise LaunchError("--signal-seconds must be >= 0")
    limit = _time_limit_seconds(args.time) if args.time else None
    if limit is not None and args.signal_seconds >= limit:
        raise LaunchError(f"--signal-seconds {args.signal_seconds} is not below --time "
                          f"{args.time} ({limit} s): the checkpoint signal would come at once")
    return gpus, nproc, cpus


def _sbatch_directives(args: argparse.Namespace, job_name: str, gpus: Optional[int], cpus: int,
                       log_dir: str) -> List[str]:
    """The #SBATCH options: one task per node (torchrun starts the ranks), requeue on USR1."""
    d = [
        f"--job-name={_directive_value('--job-name', job_name)}",
        f"--nodes={args.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus}",
    ]
    if gpus:
        d.append(f"--gres={_directive_value('--gres-name', args.gres_name or 'gpu')}:{gpus}")
    if args.time:
        d.append(f"--time={_directive_value('--time', args.time)}")
    if args.partition:
        d.append(f"--partition={_directive_value('--partition', args.partition)}")
    if args.account:
        d.append(f"--account={_directive_value('--account', args.account)}")
    d += [
        f"--output={log_dir}/%j.out",
        f"--error={log_dir}/%j.err",
        f"--signal=USR1@{args.signal_seconds}",
        "--requeue",
        "--open-mode=append",
    ]
    return d + [_checked_sbatch_arg(extra, d) for extra in args.sbatch_arg]


SCRIPT_OPTIONS = {
    "--job-name": (("-J",), "--job-name"), "--nodes": (("-N",), "--nodes"),
    "--ntasks-per-node": (("--ntasks", "-n"), None),
    "--cpus-per-task": (("-c",), "--cpus-per-task"),
    "--gres": (("--gpus", "-G", "--gpus-per-node", "--gpus-per-task"),
               "--gpus-per-node and --gres-name"),
    "--time": (("-t",), "--time"), "--partition": (("-p",), "--partition"),
    "--account": (("-A",), "--account"), "--output": (("-o",), None), "--error": (("-e",), None),
    "--signal": ((), "--signal-seconds"), "--requeue": (("--no-requeue",), None),
    "--open-mode": ((), None),
}
"""Each sbatch option the script may write: (its other spellings and the options that contradict it,
the launcher flag that sets it or None when the launcher fixes it). One the script writes may not be
repeated by --sbatch-arg: it would contradict what was checked."""

SHORT_FLAGS = set("HhOQsVvW")
"""sbatch's short options that take no value: in a bundle such as `-Qp gpu` the next letter is
another option."""


def _checked_sbatch_arg(extra: str, written: List[str]) -> str:
    """One --sbatch-arg: a single option that contradicts none of the `written` directives (long
    options also as getopt's abbreviations, short ones also inside a bundle)."""
    if not extra.startswith("-") or any(c.isspace() for c in extra):
        raise LaunchError(f"--sbatch-arg {extra!r} must be one sbatch option (starting with -, "
                          "no whitespace)")
    if any(c in extra for c in "'\"\\#"):
        # sbatch's #SBATCH parser drops quotes and backslashes and ends the line at #: it would
        # read another option than the one checked here (`--"output"=x` is --output)
        raise LaunchError(f"--sbatch-arg {extra!r} holds a quote, backslash or #, which sbatch "
                          "reads differently in the script; write the option plainly")
    if extra.startswith("--"):
        given = [extra.split("=")[0]]
    else:
        given = []
        for letter in extra[1:]:
            given.append(f"-{letter}")
            if letter not in SHORT_FLAGS:  # the rest is its value
                break
    options = {d.split("=")[0] for d in written}
    # the time limit always comes through --time, which the checkpoint signal is checked against
    # (one given here let USR1@120 arrive at once in a 1-minute job: a step, a requeue, again)
    for option in (options | {"--time"}) & SCRIPT_OPTIONS.keys():
        spellings, flag = SCRIPT_OPTIONS[option]
        for name in given:
            if any(s == name or (name.startswith("--") and s.startswith(name))
                   for s in (option, *spellings)):
                how = f"use {flag}" if flag else "the launcher needs its own value"
                what = ("which the script already sets" if option in options else
                        "which the launcher checks --signal-seconds against")
                raise LaunchError(f"--sbatch-arg {extra!r} contradicts {option}, {what} ({how})")
    return extra


SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def _time_limit_seconds(time: str) -> Optional[int]:
    """Seconds in a Slurm --time value (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S), None for no limit
    (UNLIMITED, INFINITE, or 0 as sbatch reads it); raises LaunchError for anything else."""
    if time.lower() in ("unlimited", "infinite"):
        return None
    match = SLURM_TIME.fullmatch(time)
    if not match:
        raise LaunchError(f"--time {time!r} is not a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M "
                          "or D-H:M:S)")
    days, first, second, third = (int(g) if g else 0 for g in match.groups())
    if match.group(1) is not None:  # D-H[:M[:S]]
        seconds = ((days * 24 + first) * 60 + second) * 60 + third
    elif match.group(4) is not None:  # H:M:S
        seconds = (first * 60 + second) * 60 + third
    else:  # M or M:S
        seconds = first * 60 + second
    return seconds or None


def _timestamped(dir_: Path) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name, n = f"launch_{stamp}", 1
    while (dir_ / f"{name}.sbatch").exists():
        n += 1
        name = f"launch_{stamp}-{n}"
    return name


def launch_slurm_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point for `tandem launch slurm ...` (argv is what follows `slurm`). Returns an exit
    code."""
    parser = build_parser()
    args = parser.parse_intermixed_args(list(argv) if argv is not None else None)
    try:
        _task_sizes(args)  # the job's sizes, before the recipe's layout is checked against them
    except LaunchError as exc:
        print(f"tandem launch slurm: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:  # one line even when a path in the message holds a newline
        print(f"tandem launch slurm: {str(exc).replace(chr(10), chr(92) + 'n')}", file=sys.stderr)
        return 2
    # e.g. a YAML scanner error from an override value; keep it to one line
    except Exception as exc:
        print(f"tandem launch slurm: invalid recipe or override: {' '.join(str(exc).split())}",
              file=sys.stderr)
        return 2
    world = args.nodes * (args.gpus_per_node if args.gpus_per_node is not None
                          else args.procs_per_node)
    try:
        cfg.eval.check_decoding_fits(cfg)  # as the job's first check
    except ConfigError as exc:
        print(f"tandem launch slurm: error: {exc}; nothing submitted", file=sys.stderr)
        return 2
    if cfg.device in ("cuda", "npu") and args.gpus_per_node is None:
        print(f"tandem launch slurm: device={cfg.device} with --procs-per-node requests no "
              "accelerators (no --gres line): the job sees them only where the cluster does not "
              "confine devices; --gpus-per-node asks for them", file=sys.stderr)
    go_on, shape_known = adopt_sources(cfg, args)
    if not go_on:
        return 2
    if not layout_fits(cfg, args, world, shape_known):
        return 2
    run_dir = cfg.run.dir
    if not resumable(cfg, args, shape_known):
        return 2
    if args.check or args.dry_run:
        note_missing_data(cfg)
    if args.check:
        print_check(cfg, args, world)
        return 0
    try:
        if args.gres_name is None and cfg.device == "npu":
            args.gres_name = "npu"  # Ascend clusters schedule NPUs as gres/npu
        script = render_sbatch(args, run_dir)
    except LaunchError as exc:
        print(f"tandem launch slurm: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    if not sources_exist(cfg, args):
        return 2
    try:  # the check `tandem train` makes first; the script and its logs go under run.dir too
        prepare_run_dir(run_dir)
    except ConfigError as exc:
        print(f"tandem launch slurm: error: {exc}; nothing submitted", file=sys.stderr)
        return 2
    script_path, provenance = _write_script(args, argv, run_dir, script)
    return _submit(script_path, provenance)


def _write_script(args: argparse.Namespace, argv: Optional[Sequence[str]], run_dir: str,
                  script: str) -> Tuple[Path, dict]:
    """Write `<run.dir>/slurm/launch_<timestamp>.sbatch` and its provenance `.json` beside it;
    returns (script path, provenance)."""
    out_dir = Path(os.path.abspath(run_dir)) / "slurm"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = _timestamped(out_dir)
    script_path = out_dir / f"{name}.sbatch"
    script_path.write_text(script)
    script_path.chmod(0o755)
    provenance = {
        "trainer_argv": trainer_argv(args.recipe, args.overrides),
        "recipe": args.recipe,
        "overrides": list(args.overrides),
        "launcher_argv": list(argv) if argv is not None else sys.argv[1:],
        "cwd": os.getcwd(),
        "run_dir": run_dir,
        "sbatch_script": str(script_path),
    }
    (out_dir / f"{name}.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return script_path, provenance


def _submit(script_path: Path, provenance: dict) -> int:
    """`sbatch --parsable` the script, record the job id in its provenance `.json` and print it;
    returns the exit code."""
    out_dir = script_path.parent
    try:
        res = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True,
                             text=True)
    except FileNotFoundError:
        print("tandem launch slurm: sbatch not found on PATH (script written to " f"{script_path})",
              file=sys.stderr)
        return 1
    if res.returncode != 0:
        msg = " ".join(res.stderr.split()) or f"exit code {res.returncode}"
        print(f"tandem launch slurm: sbatch failed: {msg} (script: {script_path})", file=sys.stderr)
        return 1
    job_id = res.stdout.strip().split(";")[0]  # --parsable prints "jobid[;cluster]"
    provenance["job_id"] = job_id
    script_path.with_suffix(".json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(job_id)
    print(f"tandem launch slurm: submitted job {job_id}; script {script_path}; logs "
          f"{out_dir}/{job_id}.out", file=sys.stderr)
    return 0

