"""`tandem export --checkpoint DIR --out OUT [--family F]`: a Tandem checkpoint as a Hugging Face directory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from .families import FAMILIES


def _tokenizer_for(cfg, step_dir: str = "") -> Optional[str]:
    """The tokenizer the run trained with, when it can be found without rebuilding anything: the copy
    the checkpoint recorded, else the run's data config's."""
    if step_dir and os.path.isfile(os.path.join(step_dir, "tokenizer.json")):
        return os.path.join(step_dir, "tokenizer.json")
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.data.source == "stdlib":
        import glob
        import sys as _sys

        ver = ".".join(map(str, _sys.version_info[:3]))
        pattern = os.path.join(os.path.expanduser(cfg.data.cache_dir),
                               f"stdlib-py{ver}-v{cfg.data.vocab_size}-cap{cfg.data.stdlib_max_bytes}-*", "train.tokenizer.json")
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    for prefix in cfg.data.paths:
        for cand in (prefix + ".tokenizer.json", os.path.join(os.path.dirname(prefix), "tokenizer.json")):
            if os.path.isfile(cand):
                return cand
    return None


def export_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem export",
                                     description="Write a Hugging Face checkpoint (config.json + safetensors) of a Tandem checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="step_<N>/ directory or a run directory (newest checkpoint)")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--family", choices=FAMILIES, default=None,
                        help="target layout; default from the model's knobs (sigmoid router/shared experts -> glm4_moe)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or HF tokenizer directory to copy (default: the run's)")
    parser.add_argument("--max-shard-mb", type=float, default=0, help="split the safetensors into shards of this size")
    args = parser.parse_args(argv)
    from ..checkpoint_dirs import resolve_checkpoint
    from ..config import load_config
    from .exporter import export_hf_checkpoint
    from .families import UnsupportedCheckpoint
    from .init_from import check_reference, read_reference

    try:
        step = resolve_checkpoint(args.checkpoint)
        cfg = load_config(os.path.join(step, "config.yaml"))
        ref = read_reference(step)
        if ref is not None:
            check_reference(ref, step)
        family = export_hf_checkpoint(step, args.out, args.family, cfg=cfg.model, mtp=cfg.mtp, overwrite=args.overwrite,
                                      tokenizer=args.tokenizer or _tokenizer_for(cfg, step),
                                      max_shard_bytes=int(args.max_shard_mb * 2**20))
    except (FileNotFoundError, FileExistsError, UnsupportedCheckpoint, ValueError) as exc:
        print(f"tandem export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps({"out": os.path.abspath(args.out), "family": family,
                      "mtp_layers": cfg.mtp.num_layers if cfg.mtp.num_steps else 0}))
    return 0
