"""Which MTP objective drafts best? The tiny recipe trained with each on the same budget, then decoded.

    python bench/mtp_objectives.py [--steps 300] [--objectives ce,acceptance,soft] [key=value ...]

Each objective trains the same recipe (same seed, data order, steps and lambda schedule) from scratch:
* `ce`: cross-entropy on the data (the default);
* `acceptance`: `mtp.loss.objective=acceptance`, -log sum_v min(p_v, q_v) against the trunk's p;
* `acceptance_ce`: the same mixed with the data cross-entropy (`mtp.loss.acceptance_ce_weight=1`);
* `soft`: `train.distill=soft`, cross-entropy to the trunk's full distribution.
Then every checkpoint decodes the same held-out prompts (the corpus's validation split, never trained on)
greedily and by speculative sampling at each `--temperatures` value, and reports the acceptance
length, the per-position acceptance rates and the teacher-forced per-depth loss and accuracy. The
last line names the winner at each temperature: `best_greedy=<objective> best_t1=<objective>`.
Trailing `key=value` arguments override the recipe for every objective (the CI smoke test passes tiny
sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

OBJECTIVES = {
    "ce": [],
    "acceptance": ["mtp.loss.objective=acceptance"],
    "acceptance_ce": ["mtp.loss.objective=acceptance", "mtp.loss.acceptance_ce_weight=1.0"],
    "soft": ["train.distill=soft"],
}


def train_one(recipe: str, objective: str, steps: int, out: str, overrides):
    from tandem.trainer.loop import train
    from tandem.trainer.recipe import load_config

    run_dir = os.path.join(out, objective)
    cfg = load_config(recipe, [f"train.max_steps={steps}", f"run.dir={run_dir}", "logging.wandb=false",
                               "logging.progress=false", "eval.interval=0", "checkpoint.interval=0",
                               "checkpoint.save_final=true"] + OBJECTIVES[objective] + list(overrides))
    train(cfg)
    return run_dir


def evaluate(run_dir: str, temperatures, num_prompts: int, prompt_len: int, max_new_tokens: int, seed: int):
    from tandem.eval.decode_eval import evaluate_decoding
    from tandem.eval.metrics import teacher_forced
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import _tokenizer_of, _validation

    model, cfg = load_model_from_checkpoint(run_dir)
    tok = _tokenizer_of(cfg)
    prompts, batches = _validation(cfg, num_prompts, min(prompt_len, cfg.data.seq_len))
    out = {}
    with torch.inference_mode():
        out["teacher_forced"] = teacher_forced(model, batches)
        for t in temperatures:
            m, _, _ = evaluate_decoding(model, prompts, num_steps=cfg.mtp.num_steps, max_new_tokens=max_new_tokens,
                                        batch_size=num_prompts, eos_id=tok.eod_id if tok else None, temperature=t,
                                        seed=seed)
            out[t] = {k: v for k, v in m.items() if k == "acceptance_length" or k.startswith("accept_rate/")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--steps", type=int, default=300, help="training steps per objective (the tiny recipe's 300)")
    p.add_argument("--objectives", default="ce,acceptance,soft", help=f"comma-separated, from {','.join(OBJECTIVES)}")
    p.add_argument("--temperatures", default="0,1", help="decoding temperatures (0 = greedy)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for every objective)")
    p.add_argument("--out", default="runs/objectives", help="one run directory per objective under this")
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every objective")
    args = p.parse_args(argv)
    objectives = args.objectives.split(",")
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        p.error(f"unknown objective {unknown[0]!r}; choose from {', '.join(OBJECTIVES)}")
    temperatures = [float(t) for t in args.temperatures.split(",")]
    results = {}
    for objective in objectives:
        run_dir = train_one(args.recipe, objective, args.steps, args.out, args.overrides)
        results[objective] = evaluate(run_dir, temperatures, args.num_prompts, args.prompt_len, args.max_new_tokens,
                                      args.seed)
    print(json.dumps({o: {str(k): v for k, v in r.items()} for o, r in results.items()}, indent=1))
    header = f"{'objective':<14}" + "".join(f"{'T=' + format(t, 'g') + ' accept':>14}" for t in temperatures)
    header += "   per-position (greedy)   tf_acc per depth   held-out loss per depth"
    print(header)
    for objective, r in results.items():
        tf = r["teacher_forced"]
        depths = sorted(int(k.split("_")[-1]) for k in tf if k.startswith("tf_acc/mtp_"))
        pos = r[temperatures[0]]
        row = f"{objective:<14}" + "".join(f"{r[t]['acceptance_length']:>14.3f}" for t in temperatures)
        row += "   " + " ".join(f"{pos.get(f'accept_rate/pos_{k}', 0.0):.2f}" for k in depths)
        row += "   " + " ".join(f"{tf[f'tf_acc/mtp_{k}']:.3f}" for k in depths)
        row += "   " + " ".join(f"{tf[f'loss/mtp_{k}']:.3f}" for k in depths)
        print(row)
    best = {t: max(results, key=lambda o: results[o][t]["acceptance_length"]) for t in temperatures}
    print(" ".join(f"best_{'greedy' if t == 0 else 't' + format(t, 'g')}={best[t]}" for t in temperatures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
