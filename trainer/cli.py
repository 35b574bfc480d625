"""`tandem` console script: train, preprocess, eval, generate, export, launch, report.

Each subcommand's module is imported only when it runs, so `tandem train` does not pay for
`transformers`, and `tandem --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

USAGE = """usage: tandem <command> [args]

commands:
  train RECIPE [key=value ...] [--resume]   pretrain / fine-tune from a YAML recipe
  preprocess --input PATH ... --output-prefix PREFIX [--tokenizer PATH]
                                            tokenize local text into a Megatron indexed dataset
  eval --checkpoint DIR [options]           speculative decoding + acceptance metrics
                                            (one JSON object)
  generate --checkpoint DIR --prompts FILE --out FILE [options]
                                            the trunk's own continuations of a prompt set
                                            (JSONL, resumable)
  export --checkpoint DIR --out OUT         write a Hugging Face checkpoint (trunk + MTP weights)
  launch slurm RECIPE [key=value ...] --nodes N ...
                                            render and submit an sbatch script
  report RUN_DIR [RUN_DIR ...] [--out DIR]  plot runs (overlaid): PNGs + one self-contained
                                            HTML page

run `tandem <command> --help` for a command's options
"""

# command -> (module, function taking argv)
_COMMANDS = {
    "preprocess": ("tandem.data_pipeline.preprocess_cli", "preprocess_main"),
    "eval": ("tandem.trainer.eval_cli", "eval_main"),
    "generate": ("tandem.trainer.generate", "generate_main"),
    "export": ("tandem.trainer.hf.export", "export_main"),
    "report": ("tandem.trainer.report", "report_main"),
}


def train_main(argv: List[str], whole_process: bool = False) -> int:
    """`tandem train`. `whole_process`: this call is the process's entry point (the console script),
    so the preemption signals are caught from before the run is built until the process exits."""
    if not whole_process:
        return _train(argv)
    from . import preemption

    preemption.install_preemption_handler()
    try:
        return _train(argv)
    finally:
        preemption.ignore_preemption_signals()


def _train(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem "
                                          "train",
                                     description="Train from a YAML recipe with key=value "
                                                 "overrides.")
    parser.add_argument("recipe", help="recipe YAML (e.g. recipes/tiny.yaml)")
    parser.add_argument("overrides", nargs="*",
                        help="config overrides, e.g. train.max_steps=100 parallel.tp=2")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in run.dir")
    args = parser.parse_intermixed_args(argv)  # `--resume` before, between or after overrides
    from .config_checks import ConfigError
    from .recipe import explicit_keys, load_config

    try:
        cfg = load_config(args.recipe, args.overrides)
        explicit = explicit_keys(args.recipe, args.overrides)
    except ConfigError as exc:
        print(f"tandem train: error: {exc}", file=sys.stderr)
        return 2
    from .guard import BadStepHalt
    from .loop import train
    from .preemption import RequeueRefused

    try:
        record = train(cfg, resume=args.resume, explicit=explicit)
    except BadStepHalt as exc:
        print(f"tandem train: {exc}", file=sys.stderr)
        return 3
    except RequeueRefused as exc:
        print(f"tandem train: {exc}", file=sys.stderr)
        return 4
    except (ConfigError, OSError, ValueError) as exc:
        print(f"tandem train: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if record is not None and int(os.environ.get("RANK", "0")) == 0:
        keys = ["loss/main"] + [k for k in record if k.startswith("loss/mtp_")] + [
            k for k in ("eval/acceptance_length",) if k in record]
        print(f"step {record['step']}: " + " ".join(f"{k}={record[k]:.4f}" for k in keys))
    return 0


def launch_main(argv: List[str]) -> int:
    if not argv or argv[0] != "slurm":
        print("usage: tandem launch slurm RECIPE [key=value ...] --nodes N ...", file=sys.stderr)
        return 2
    from .launch import launch_slurm_main

    return launch_slurm_main(argv[1:]) or 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command. Without `argv` this is the process's entry point (the console script,
    `python -m tandem.trainer.cli`): a rank of a multi-process launch then leaves through
    `run_as_process` (trainer/parallel/layout.py), which explains why."""
    if argv is not None:
        return run_command(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # run_as_process's single-process case,
        return run_command(sys.argv[1:], whole_process=True)  # without importing torch for --help
    from .parallel.layout import run_as_process

    return run_as_process(lambda: run_command(sys.argv[1:], whole_process=True))


def run_command(argv: List[str], whole_process: bool = False) -> int:
    """The command `argv` names, run in this process: its exit code. `whole_process` as in
    `train_main`."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train_main(rest, whole_process)
    if command == "launch":
        return launch_main(rest)
    if command in _COMMANDS:
        module, func = _COMMANDS[command]
        try:
            entry = getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as exc:
            print(f"tandem {command}: not available in this installation ({exc})", file=sys.stderr)
            return 2
        return entry(rest) or 0
    print(f"tandem: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
