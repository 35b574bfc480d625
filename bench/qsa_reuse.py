"""QSA index reuse across draft steps (`mtp.qsa_reuse_indices`): the indexer work it saves per draft
round and the acceptance it costs or buys, on Qwen4-Exp checkpoints of several training seeds, side
by side, each difference with its 95% interval over seeds and prompts.

    python bench/qsa_reuse.py [--seeds 3] [--steps 250] [--reuse] [key=value ...]   # trains the
        seeds first
    python bench/qsa_reuse.py --checkpoint runs/a runs/b runs/c [--num-prompts 16]
        [--prompt-len 160]

Without `--checkpoint`, `recipes/qwen4_exp_tiny.yaml` (`--recipe`) is trained `--steps` steps at
each of `--seeds` training seeds (`train.seed` = the recipe's seed + 0..N-1) into OUT/seed_<seed>/;
with it, the given checkpoints stand for the seeds. Every checkpoint drafts the same held-out
prompts (the first checkpoint's validation split) twice, with the evaluator's decoder
(`eval.decode_eval.evaluate_decoding`, the checkpoint's `eval.draft_convention`):

* `reuse`: as the design documents serve it, and as a checkpoint trained with index reuse was
  trained: MTP depth 1 runs its QSA indexer, depths 2..K attend over depth 1's selection;
* `own`: every depth runs the MTP layer's indexer for itself (the layers' `selection_share`
  removed).

Indexer work is counted in the MTP layers only (the trunk's indexers run in the verify forward
either way): block-scoring calls per round and their multiply-adds (queries x indexer heads x blocks
x indexer head dim), from a counter wrapped around each MTP QSA layer's `_block_scores`. Acceptance:
greedy (with distinct-4 beside it and the check that speculative output equals autoregressive
decoding) and sampled at T=1 with token-wise and block verification. The table holds means over
checkpoints; then reuse against own at each acceptance figure, and block against token-wise
verification under each, are compared over seeds and prompts (tandem.eval.seed_comparison: per-seed
figures, mean [lo, hi], difference [lo, hi], significant=yes|no). Ends with one line of key=value
pairs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seeded_runs import add_seed_flags, compare, decode, mean_over_seeds, seed_values, train_run  # noqa: E402


class IndexerCounter:
    """Counts the indexer work of the given QSA layers: block-scoring calls, their multiply-adds
    and the query rows they score, and the rows the indexer's projection (its queries and raw keys)
    runs on."""

    def __init__(self, layers):
        self.reset()
        for attn in layers:
            inner, project = attn._block_scores, attn.indexer.forward

            def counted(q_bsid, keys, starts_bn, inner=inner):
                b, s, i, d = q_bsid.shape
                self.calls += 1
                self.macs += b * s * i * starts_bn.shape[1] * d
                self.scored_rows += b * s
                return inner(q_bsid, keys, starts_bn)

            def projected(x_bsh, *args, project=project):
                self.projected_rows += x_bsh.shape[0] * x_bsh.shape[1]
                return project(x_bsh, *args)

            attn._block_scores, attn.indexer.forward = counted, projected

    def reset(self) -> None:
        self.calls = self.macs = self.scored_rows = self.projected_rows = 0


def mtp_qsa_layers(model):
    from tandem.models.qsa import IndexedAttention

    return [layer.block.self_attn for layer in model.mtp.layers
            if isinstance(getattr(layer.block, "self_attn", None), IndexedAttention)]


def decode_figures(model, prompts, cfg, eos_id, args, counter: IndexerCounter):
    """(figures of one checkpoint under the current selection sharing, DecodeStats per acceptance
    label)."""
    from tandem.eval.decode_eval import evaluate_decoding, merge_stats
    from tandem.eval.metrics import distinct_n

    K = cfg.mtp.num_steps
    common = dict(num_steps=K, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  eos_id=eos_id, draft_convention=cfg.eval.draft_convention)
    # warm-up: first calls are slow
    evaluate_decoding(model, prompts[:1], **{**common, "max_new_tokens": 4})
    counter.reset()
    greedy, spec, _ = evaluate_decoding(model, prompts, **common)

    rounds = sum(r.stats.num_rounds for r in spec)
    out = {
        "acceptance_greedy": greedy["acceptance_length"],
        "identical_to_autoregressive": float(greedy["identical_to_autoregressive"]),
        "distinct_4": distinct_n([o for r in spec for o in r.outputs], 4),
        "indexer_calls_per_round": counter.calls / max(rounds, 1),
        "indexer_macs_per_round": counter.macs / max(rounds, 1),
        "indexer_scored_rows_per_round": counter.scored_rows / max(rounds, 1),
        "indexer_projected_rows_per_round": counter.projected_rows / max(rounds, 1),
        "draft_ms_per_round": greedy["time_per_round/draft_ms"],
    }
    stats = {"acceptance_greedy": merge_stats([r.stats for r in spec], K)}
    for verify in ("token", "block"):
        sampled, stats[f"acceptance_T1_{verify}"], _ = decode(model, prompts, **common,
                                                              temperature=1.0,
                                                              seed=args.seed, verify=verify)
        out[f"acceptance_T1_{verify}"] = sampled["acceptance_length"]
    return out, stats


def checkpoints(args) -> List[str]:
    """--checkpoint's directories, else --seeds runs of --recipe trained for --steps here."""
    if args.checkpoint:
        return args.checkpoint
    overrides = list(args.overrides)
    return [train_run(args.recipe, os.path.join(args.out, f"seed_{s}"), args.steps,
                      [f"train.seed={s}", *overrides],
                      args.reuse) for s in seed_values(args.recipe, overrides, args.seeds)]


def measure(ckpt: str, prompts, args):
    """{reuse, own}: (figures, DecodeStats per acceptance label) of one checkpoint, and its
    config."""
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer

    model, cfg = load_model_from_checkpoint(ckpt)
    layers = mtp_qsa_layers(model)
    if not layers or cfg.mtp.num_steps < 2:
        raise SystemExit(f"{ckpt}: index reuse needs QSA MTP layers and mtp.num_steps >= 2 "
                         f"(this checkpoint: model.family={cfg.model.family!r}, "
                         f"mtp.num_steps={cfg.mtp.num_steps})")
    tok = load_run_tokenizer(cfg)
    counter = IndexerCounter(layers)
    share = model.mtp.selection_share
    results = {}
    with torch.inference_mode():
        for name, shared in (("reuse", share), ("own", None)):
            model.mtp.selection_share = shared
            for attn in layers:
                attn.selection_share = shared
            results[name] = decode_figures(model, prompts, cfg, tok.eod_id if tok else None, args,
                                           counter)
    model.mtp.selection_share = share
    return results, cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", nargs="*", default=[],
                   help="run or step directories of qwen4_exp models, one per training seed "
                        "(default: train them)")
    p.add_argument("--recipe", default="recipes/qwen4_exp_tiny.yaml",
                   help="what is trained without --checkpoint")
    p.add_argument("--steps", type=int, default=250,
                   help="training steps per seed without --checkpoint")
    p.add_argument("--out", default="runs/qsa_reuse", help="OUT/seed_<train.seed>/ per trained run")
    add_seed_flags(p)
    p.add_argument("--num-prompts", type=int, default=16)
    # longer than the tiny recipe's QSA budget (64 positions): below it every visible block is
    # selected, whoever selects, and reuse cannot change a draft
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (tiny ops: 1 is fastest)")
    p.add_argument("overrides", nargs="*", help="recipe overrides for the trained runs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer, validation_prompts

    ckpts = checkpoints(args)
    _, cfg = load_model_from_checkpoint(ckpts[0])
    # one prompt set for every checkpoint (the validation split is shuffled with train.seed): paired
    tok = load_run_tokenizer(cfg)
    prompts, _ = validation_prompts(cfg, args.num_prompts, min(args.prompt_len, cfg.data.seq_len),
                             tok.eod_id if tok else None)
    per_seed = [measure(c, prompts, args)[0] for c in ckpts]
    names = ("reuse", "own")
    results = {n: mean_over_seeds([r[n][0] for r in per_seed]) for n in names}
    stats = {n: {k: [r[n][1][k] for r in per_seed] for k in per_seed[0][n][1]} for n in names}
    print(f"{len(ckpts)} checkpoint(s) ({', '.join(ckpts)}): K={cfg.mtp.num_steps}, trained with "
          f"mtp.qsa_reuse_indices={cfg.mtp.qsa_reuse_indices}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new "
          "tokens; means over checkpoints:")
    print(f"{'':32s}{'reuse':>14s}{'own':>14s}")
    for key in results["reuse"]:
        print(f"{key:32s}{results['reuse'][key]:14.4f}{results['own'][key]:14.4f}")
    saved = 1.0 - results["reuse"]["indexer_macs_per_round"] / max(
        results["own"]["indexer_macs_per_round"], 1e-12
    )
    print(f"indexer work saved per draft round: {100 * saved:.1f}% of the MTP's block scoring")
    line = {f"{k}_{name}": f"{v:.4f}" for name in names for k, v in results[name].items()}
    line["indexer_work_saved"] = f"{saved:.4f}"
    for key in stats["reuse"]:
        c = compare("reuse", stats["reuse"][key], "own", stats["own"][key], key)
        line[f"reuse_minus_own_{key}"] = f"{c.diff.value:+.4f}"
        line[f"reuse_minus_own_{key}_significant"] = "yes" if c.significant else "no"
    for name in names:
        c = compare("block", stats[name]["acceptance_T1_block"], "token",
                    stats[name]["acceptance_T1_token"], name)
        line[f"block_minus_token_T1_{name}"] = f"{c.diff.value:+.4f}"
        line[f"block_minus_token_T1_{name}_significant"] = "yes" if c.significant else "no"
    print(" ".join(f"{k}={v}" for k, v in line.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
