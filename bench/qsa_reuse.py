"""QSA index reuse across draft steps (`mtp.qsa_reuse_indices`): the indexer work it saves per draft
round and the acceptance it costs or buys, on one Qwen4-Exp checkpoint, side by side.

    python bench/qsa_reuse.py [--checkpoint runs/qwen4_exp_tiny] [--num-prompts 16] [--prompt-len 160] [--max-new-tokens
    64]

The same checkpoint drafts the same held-out prompts twice, with the evaluator's decoder
(`eval.decode_eval.evaluate_decoding`, the checkpoint's `eval.draft_convention`):

* `reuse`: as the design documents serve it, and as a checkpoint trained with index reuse was trained:
  MTP depth 1 runs its QSA indexer, depths 2..K attend over depth 1's selection;
* `own`: every depth runs the MTP layer's indexer for itself (the layers' `selection_share` removed).

Indexer work is counted in the MTP layers only (the trunk's indexers run in the verify forward either
way): block-scoring calls per round and their multiply-adds (queries x indexer heads x blocks x
indexer head dim), from a counter wrapped around each MTP QSA layer's `_block_scores`. Acceptance:
greedy (with distinct-4 beside it and the check that speculative output equals autoregressive
decoding) and sampled at T=1 with token-wise and block verification. Ends with one line of key=value
pairs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict

import torch


class IndexerCounter:
    """Counts the block-scoring work of the given QSA layers (calls and multiply-adds)."""

    def __init__(self, layers):
        self.calls = 0
        self.macs = 0
        for attn in layers:
            inner = attn._block_scores

            def counted(q_bsid, keys, starts_bn, inner=inner):
                b, s, i, d = q_bsid.shape
                self.calls += 1
                self.macs += b * s * i * starts_bn.shape[1] * d
                return inner(q_bsid, keys, starts_bn)

            attn._block_scores = counted


def mtp_qsa_layers(model):
    from tandem.models.qsa import IndexedAttention

    return [layer.block.self_attn for layer in model.mtp.layers
            if isinstance(getattr(layer.block, "self_attn", None), IndexedAttention)]


def decode_figures(model, prompts, cfg, eos_id, args, counter: IndexerCounter) -> Dict[str, float]:
    from tandem.eval.decode_eval import evaluate_decoding
    from tandem.eval.metrics import distinct_n

    K = cfg.mtp.num_steps
    common = dict(num_steps=K, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, eos_id=eos_id,
                  draft_convention=cfg.eval.draft_convention)
    evaluate_decoding(model, prompts[:1], **{**common, "max_new_tokens": 4})  # warm-up: first calls are slow
    counter.calls = counter.macs = 0
    greedy, spec, _ = evaluate_decoding(model, prompts, **common)

    rounds = sum(r.stats.num_rounds for r in spec)
    out = {
        "acceptance_greedy": greedy["acceptance_length"],
        "identical_to_autoregressive": float(greedy["identical_to_autoregressive"]),
        "distinct_4": distinct_n([o for r in spec for o in r.outputs], 4),
        "indexer_calls_per_round": counter.calls / max(rounds, 1),
        "indexer_macs_per_round": counter.macs / max(rounds, 1),
        "draft_ms_per_round": greedy["time_per_round/draft_ms"],
    }
    for verify in ("token", "block"):
        sampled, _, _ = evaluate_decoding(model, prompts, **common, temperature=1.0, seed=args.seed,
                                          autoregressive=False, verify=verify)
        out[f"acceptance_T1_{verify}"] = sampled["acceptance_length"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/qwen4_exp_tiny", help="run or step directory of a qwen4_exp model")
    p.add_argument("--num-prompts", type=int, default=16)
    # longer than the tiny recipe's QSA budget (64 positions): below it every visible block is selected,
    # whoever selects, and reuse cannot change a draft
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny ops: 1 is fastest)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import _tokenizer_of, _validation

    model, cfg = load_model_from_checkpoint(args.checkpoint)
    layers = mtp_qsa_layers(model)
    if not layers or cfg.mtp.num_steps < 2:
        raise SystemExit(f"{args.checkpoint}: index reuse needs QSA MTP layers and mtp.num_steps >= 2 "
                         f"(this checkpoint: model.family={cfg.model.family!r}, mtp.num_steps={cfg.mtp.num_steps})")
    tok = _tokenizer_of(cfg)
    prompts, _ = _validation(cfg, args.num_prompts, min(args.prompt_len, cfg.data.seq_len))
    counter = IndexerCounter(layers)
    share = model.mtp.selection_share
    results = {}
    with torch.inference_mode():
        for name, shared in (("reuse", share), ("own", None)):
            model.mtp.selection_share = shared
            for attn in layers:
                attn.selection_share = shared
            results[name] = decode_figures(model, prompts, cfg, tok.eod_id if tok else None, args, counter)
    model.mtp.selection_share = share
    print(f"checkpoint {args.checkpoint}: K={cfg.mtp.num_steps}, trained with mtp.qsa_reuse_indices="
          f"{cfg.mtp.qsa_reuse_indices}, {len(prompts)} prompts x {args.max_new_tokens} new tokens")
    keys = list(results["reuse"])
    print(f"{'':32s}{'reuse':>14s}{'own':>14s}")
    for key in keys:
        print(f"{key:32s}{results['reuse'][key]:14.4f}{results['own'][key]:14.4f}")
    saved = 1.0 - results["reuse"]["indexer_macs_per_round"] / max(results["own"]["indexer_macs_per_round"], 1e-12)
    print(f"indexer work saved per draft round: {100 * saved:.1f}% of the MTP's block scoring")
    line = {f"{k}_{name}": v for name in results for k, v in results[name].items()}
    line["indexer_work_saved"] = saved
    print(" ".join(f"{k}={v:.4f}" for k, v in line.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
