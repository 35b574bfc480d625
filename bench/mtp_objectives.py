"""Which MTP objective (or MTP style) drafts best? The tiny recipe trained with each, over several
seeds, on the same budget, then decoded; every difference reported with its 95% interval over seeds
and prompts.

    python bench/mtp_objectives.py [--steps 300] [--seeds 3] [--objectives ce,acceptance,soft]
        [key=value ...]

Each variant trains the same recipe (same data order, steps and lambda schedule) from scratch, once
per training seed (`train.seed` = the recipe's seed + 0..N-1; a variant and the baseline share each
seed's initialisation and data order):
* `ce`: cross-entropy on the data (the default; looped MTP, `mtp.style=looped`);
* `acceptance`: `mtp.loss.objective=acceptance`, -log sum_v min(p_v, q_v) against the trunk's p;
* `acceptance_ce`: the same mixed with the data cross-entropy (`mtp.loss.acceptance_ce_weight=1`);
* `soft`: `train.distill=soft`, cross-entropy to the trunk's full distribution;
* `parallel_heads`: `mtp.style=parallel` with `mtp.num_layers` = K (one independent head per depth
  on the trunk's state, Gloeckle et al.; K times the looped module's one layer), trained with `ce`.
Then every checkpoint decodes the same held-out prompts (the corpus's validation split under the
first seed, never trained on) greedily and by speculative sampling at each `--temperatures` value
with each `--verify` rule, and reports acceptance length, per-position acceptance rates and the
teacher-forced per-depth loss and accuracy (means over seeds).

Comparisons (tandem.eval.seed_comparison): every pair of variants at each temperature (token-wise
verification), and block against token-wise verification of the same checkpoints at each temperature
above 0; each prints the per-seed figures with their intervals over prompts, the means over seeds
[lo, hi], the difference [lo, hi] and `significant=yes|no`. The last line names the variant with the
highest mean at each temperature and whether it beats every other significantly:
`best_greedy=<variant> best_greedy_significant=yes|no best_t1=... ...`, then each block-minus-token
difference. Trailing `key=value` arguments override the recipe for every run (the CI smoke test
passes tiny sizes). `--reuse` keeps finished runs (same resolved config), so a cut-short comparison
resumes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeded_runs import (  # noqa: E402
    add_seed_flags,
    compare,
    decode,
    in_repo,
    mean_over_seeds,
    seed_values,
    train_run,
)

OBJECTIVES = {
    "ce": [],
    "acceptance": ["mtp.loss.objective=acceptance"],
    "acceptance_ce": ["mtp.loss.objective=acceptance", "mtp.loss.acceptance_ce_weight=1.0"],
    "soft": ["train.distill=soft"],
    "parallel_heads": ["mtp.style=parallel"],  # + mtp.num_layers=K (variant_overrides)
}


def variant_overrides(recipe: str, objective: str, overrides) -> list:
    """The objective's overrides; parallel heads also need one layer per depth (models/mtp_config.py
    checks it)."""
    extra = list(OBJECTIVES[objective])
    if "mtp.style=parallel" in extra:
        from tandem.trainer.recipe import load_config

        steps = load_config(in_repo(recipe), list(overrides)).mtp.num_steps
        extra.append(f"mtp.num_layers={steps}")
    return extra


def label(t: float, verify: str = "token") -> str:
    return ("greedy" if t == 0 else f"t{t:g}") + ("" if t == 0 or verify == "token"
                                                  else f"_{verify}")


def evaluate(run_dir: str, prompts, batches, temperatures, verifies, max_new_tokens: int,
             seed: int):
    """(figures per decode label plus the teacher-forced losses on `batches`, DecodeStats per decode
    label)."""
    from tandem.eval.metrics import teacher_forced
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer

    model, cfg = load_model_from_checkpoint(run_dir)
    tok = load_run_tokenizer(cfg)
    figures, stats = {}, {}
    with torch.inference_mode():
        figures["teacher_forced"] = teacher_forced(model, batches)
        for t in temperatures:
            for verify in (verifies if t > 0 else ["token"]):
                m, st, _ = decode(model, prompts, num_steps=cfg.mtp.num_steps,
                                  max_new_tokens=max_new_tokens,
                                  batch_size=len(prompts), eos_id=tok.eod_id if tok else None,
                                  temperature=t, seed=seed, verify=verify)
                figures[label(t, verify)] = {
                    k: v
                    for k, v in m.items()
                    if k.startswith(("acceptance_length", "accept_rate/"))
                }
                stats[label(t, verify)] = st
    return figures, stats


def held_out(run_dir: str, num_prompts: int, prompt_len: int):
    """(prompts, teacher-forced batches) every run is scored on: the validation split as the first
    run's config draws it (the split is shuffled with train.seed, so each seed's own would differ
    and the comparison would not be paired)."""
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer, validation_prompts

    _, cfg = load_model_from_checkpoint(run_dir)
    tok = load_run_tokenizer(cfg)
    return validation_prompts(cfg, num_prompts, min(prompt_len, cfg.data.seq_len),
                       tok.eod_id if tok else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--steps", type=int, default=300,
                   help="training steps per run (the tiny recipe's 300)")
    p.add_argument("--objectives", default="ce,acceptance,soft",
                   help="comma-separated variants, the first the baseline; from "
                        f"{','.join(OBJECTIVES)}")
    p.add_argument("--temperatures", default="0,1", help="decoding temperatures (0 = greedy)")
    p.add_argument("--verify", default="token,block",
                   help="verification rules decoded at each temperature > 0")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every run)")
    p.add_argument("--out", default="runs/objectives",
                   help="OUT/<variant>/seed_<train.seed>/ per run")
    add_seed_flags(p)
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every run")
    args = p.parse_args(argv)
    objectives = args.objectives.split(",")
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        p.error(f"unknown objective {unknown[0]!r}; choose from {', '.join(OBJECTIVES)}")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    verifies = args.verify.split(",")
    seeds = seed_values(args.recipe, args.overrides, args.seeds)
    runs = {o: [train_run(args.recipe, os.path.join(args.out, o, f"seed_{s}"), args.steps,
                          [f"train.seed={s}", *variant_overrides(args.recipe, o, args.overrides),
                           *args.overrides],
                          args.reuse) for s in seeds] for o in objectives}
    prompts, batches = held_out(runs[objectives[0]][0], args.num_prompts, args.prompt_len)
    figures, stats = {}, {}
    for o in objectives:
        per_seed = [evaluate(d, prompts, batches, temperatures, verifies, args.max_new_tokens,
                             args.seed)
                    for d in runs[o]]
        figures[o] = {s: f for s, (f, _) in zip(seeds, per_seed)}
        stats[o] = {key: [st[key] for _, st in per_seed] for key in per_seed[0][1]}
    print(json.dumps({o: {str(s): f for s, f in r.items()} for o, r in figures.items()}, indent=1))
    print(f"{len(seeds)} seeds (train.seed {', '.join(map(str, seeds))}) x {len(prompts)} prompts "
          "x "
          f"{args.max_new_tokens} new tokens, {args.steps} steps; means over seeds:")

    header = f"{'objective':<16}" + "".join(f"{'T=' + format(t, 'g') + ' accept':>14}"
                                            for t in temperatures)
    header += "   per-position (greedy)   tf_acc per depth   held-out loss per depth"
    print(header)
    means = {o: {key: mean_over_seeds([f[key] for f in figures[o].values()])
                 for key in figures[o][seeds[0]]}
             for o in objectives}
    for o in objectives:
        mean = means[o]
        tf = mean["teacher_forced"]
        depths = sorted(int(k.split("_")[-1]) for k in tf if k.startswith("tf_acc/mtp_"))
        pos = mean[label(temperatures[0])]
        row = f"{o:<16}" + "".join(f"{mean[label(t)]['acceptance_length']:>14.3f}"
                                   for t in temperatures)
        row += "   " + " ".join(f"{pos.get(f'accept_rate/pos_{k}', 0.0):.2f}" for k in depths)
        row += "   " + " ".join(f"{tf[f'tf_acc/mtp_{k}']:.3f}" for k in depths)
        row += "   " + " ".join(f"{tf[f'loss/mtp_{k}']:.3f}" for k in depths)
        print(row)

    summary = {}
    for t in temperatures:
        key = label(t)
        # per variant: whether it is significantly above each other one
        wins = {o: [] for o in objectives}
        for a, b in itertools.combinations(objectives, 2):
            c = compare(a, stats[a][key], b, stats[b][key], key)
            wins[a].append(c.significant and c.diff.value > 0)
            wins[b].append(c.significant and c.diff.value < 0)
        best = max(objectives, key=lambda o: means[o][key]["acceptance_length"])
        summary[f"best_{key}"] = best
        summary[f"best_{key}_significant"] = (
            "yes" if len(objectives) > 1 and all(wins[best]) else "no"
        )
    for t in temperatures:
        if t > 0 and "block" in verifies and "token" in verifies:
            for o in objectives:
                c = compare("block", stats[o][label(t, "block")], "token", stats[o][label(t)],
                            f"{o} {label(t)}")
                summary[f"{o}.block_minus_token_{label(t)}"] = f"{c.diff.value:+.3f}"
                summary[f"{o}.block_minus_token_{label(t)}_significant"] = (
                    "yes" if c.significant else "no"
                )
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
