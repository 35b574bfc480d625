"""What the comparison benches share (mtp_objectives.py, qsa_reuse.py, self_distill.py): one recipe
trained at several `train.seed` values, every model decoding the same prompts, and each pair of
settings compared over seeds and prompts (tandem.eval.seed_comparison: per-seed figures, mean [lo,
hi] over seeds, the paired difference [lo, hi] and whether it is significant).

A claim that one setting drafts better needs more than one seed: two runs of one setting with
different seeds differ by as much as two settings often do.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_SEEDS = 3
"""Training seeds per setting: the fewest from which Student's t gives a finite interval over seeds
with room to spare (2 degrees of freedom)."""


def add_seed_flags(parser, reuse: bool = True) -> None:
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                        help="training seeds per setting: train.seed = the recipe's seed + 0..N-1 "
                             "(1: no interval "
                             "over seeds, prompts only)")
    if reuse:
        parser.add_argument("--reuse", action="store_true",
                            help="keep a run directory that already holds this run's final "
                                 "checkpoint under the "
                                 "same resolved config (resume a cut-short comparison without "
                                 "retraining)")


def in_repo(path: str) -> str:
    """`path` as given, or under the repository when it names nothing here (a default such as
    `recipes/tiny.yaml` from another working directory)."""
    return path if os.path.exists(path) else os.path.join(ROOT, path)


def seed_values(recipe: str, overrides: Sequence[str], n: int) -> List[int]:
    """The `train.seed` of each of n runs: the recipe's own first, so seed 0 reproduces a one-seed
    run."""
    from tandem.trainer.recipe import load_config

    if n < 1:
        raise SystemExit(f"--seeds must be at least 1, got {n}")
    base = load_config(in_repo(recipe), list(overrides)).train.seed
    return [base + i for i in range(n)]


def _finished(run_dir: str, steps: int, cfg) -> bool:
    """Whether run_dir holds the final checkpoint of a run under exactly `cfg`."""
    from tandem.trainer.recipe import load_config, to_yaml

    saved = os.path.join(run_dir, "checkpoints", f"step_{steps}", "config.yaml")
    return os.path.isfile(saved) and to_yaml(load_config(saved)) == to_yaml(cfg)


def train_run(recipe: str, run_dir: str, steps: int, overrides: Sequence[str],
              reuse: bool = False) -> str:
    """Train `recipe` for `steps` steps into run_dir (no evaluator, one final checkpoint), in this
    process; with `reuse`, a finished run of the same resolved config is kept instead."""
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import explicit_keys, load_config

    args = [f"train.max_steps={steps}", f"run.dir={run_dir}", "logging.wandb=false",
            "logging.progress=false", "eval.interval=0", "checkpoint.interval=0",
            "checkpoint.save_final=true", *overrides]
    recipe = in_repo(recipe)
    cfg = load_config(recipe, args)
    if reuse and _finished(run_dir, steps, cfg):
        print(f"reusing {run_dir} (finished, same config)", flush=True)
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)  # this bench's own run, trained afresh
    train(cfg, explicit=explicit_keys(recipe, args))  # as `tandem train` runs it
    return run_dir


def decode(model, prompts, **settings) -> Tuple[dict, object, list]:
    """The speculative side of `evaluate_decoding` (no autoregressive decode): (acceptance figures
    with their intervals over prompts, the DecodeStats of every prompt's row, the per-batch
    results)."""
    from tandem.eval.decode_eval import evaluate_decoding, merge_stats

    metrics, spec, _ = evaluate_decoding(model, prompts, autoregressive=False, **settings)
    return metrics, merge_stats([r.stats for r in spec], settings["num_steps"]), spec


def compare(name_a: str, a: Sequence, name_b: str, b: Sequence, label: str,
            key: str = "acceptance_length"):
    """Print the comparison of A and B's `key` (one DecodeStats per seed each, the same prompts)
    under a heading `label`; returns the SeedComparison."""
    from tandem.eval.seed_comparison import compare_over_seeds

    c = compare_over_seeds(list(a), list(b))[key]
    lines = c.report(name_a, name_b)
    print(f"[{label}] " + lines[0] + "\n" + "\n".join(lines[1:]), flush=True)
    return c


def mean_over_seeds(figures: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """The mean of each numeric figure over seeds (the keys of the first)."""
    return {k: sum(float(f[k]) for f in figures) / len(figures) for k in figures[0]
            if isinstance(figures[0][k], (int, float, bool))}
