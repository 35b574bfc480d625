"""Speculative (MTP drafts) vs plain autoregressive decode speed of one checkpoint, side by side.

    python bench/spec_decode.py [--checkpoint DIR] [--num-steps 3] [--repeats 5] [--suite humaneval,mt_bench]

Greedy decoding of the same prompts with K MTP drafts and without: the checkpoint's validation split
(held out), or with `--suite` each public prompt set (eval/suites.py) decoded and timed on its own, so
each gets its own measured and predicted speedup (a suite's acceptance sets its speedup). The two are
interleaved batch by batch and repetition by repetition and the medians compared. Prints the
measured decode tokens/s of both, the measured speedup, the predicted speedup A*T/(D+V+O) from the
measured per-round draft (D), verify (V) and overhead (O) times and the AR per-token time T, the
ceiling T/(V+O) that speedup/acceptance could reach if drafting were free (it is below 1 wherever a
forward over K+1 tokens costs more than one over a single token), and ends with one line
`acceptance_length=<a> speedup=<s> speedup_over_acceptance=<s/a>` (with --suite, one such line per
suite, each key prefixed `<suite>/`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/tiny", help="run or step directory (default: the tiny recipe's)")
    p.add_argument("--num-steps", type=int, default=3, help="draft length K")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--suite", default="", help="public prompt sets, comma-separated (eval/suites.py: humaneval, "
                   "mt_bench): each decoded and timed on its own; --num-prompts of each")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (tiny ops: 1 is fastest)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import _tokenizer_of

    model, cfg = load_model_from_checkpoint(args.checkpoint)
    tok = _tokenizer_of(cfg)
    sources = _prompt_sources(args, model, cfg, tok)
    summary = []
    for name, prompts in sources.items():
        if len(sources) > 1 or name != "held_out":
            print(f"== {name}: {len(prompts)} prompts")
        summary.append(_measure(args, model, tok, prompts, "" if name == "held_out" else f"{name}/"))
    print(" ".join(summary))
    return 0


def _prompt_sources(args, model, cfg, tok) -> dict:
    """{source name: prompt token ids}: the validation split, or each --suite's prompts (their last
    --prompt-len tokens; a chat suite through the checkpoint's template when it has one)."""
    from tandem.trainer.eval_cli import _validation

    if not args.suite:
        prompts, _ = _validation(cfg, args.num_prompts, min(args.prompt_len, cfg.data.seq_len))
        return {"held_out": prompts}
    from tandem.data_pipeline.prompts import chat_template_in
    from tandem.eval.spec_decode import prompt_limit
    from tandem.eval.suites import load_suites, parse_suites, tokenize_suite
    from tandem.trainer.checkpoint import resolve_checkpoint

    if tok is None:
        raise SystemExit("bench/spec_decode.py: --suite needs the checkpoint's tokenizer")
    tok_path = cfg.data.tokenizer or ""
    chat = chat_template_in([resolve_checkpoint(args.checkpoint),
                             tok_path if os.path.isdir(tok_path) else os.path.dirname(tok_path)])
    keep = min(args.prompt_len, prompt_limit(model.cfg.max_seq_len, args.max_new_tokens, args.num_steps))
    return {name: tokenize_suite(load_suites(name, args.num_prompts), tok, chat, keep)[0]
            for name in parse_suites(args.suite)}


def _measure(args, model, tok, prompts, prefix: str) -> str:
    """Decode `prompts` both ways, print the figures, return the summary's key=value pairs."""
    from tandem.eval.decode_eval import evaluate_decoding

    with torch.inference_mode():
        m, _, _ = evaluate_decoding(model, prompts, num_steps=args.num_steps, max_new_tokens=args.max_new_tokens,
                                    batch_size=args.batch_size, eos_id=tok.eod_id if tok else None, warmup=True,
                                    repeats=args.repeats)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}, indent=1))
    a, s = m["acceptance_length"], m["speedup"]
    print(f"tokens/s spec={m['decode_tokens_per_s/spec']:.1f} ar={m['decode_tokens_per_s/ar']:.1f} "
          f"speedup={s:.3f} predicted={m['speedup_predicted']:.3f} (K={args.num_steps}, "
          f"acceptance {a:.3f} [{m['acceptance_length_lo95']:.3f}, {m['acceptance_length_hi95']:.3f}], "
          f"identical_to_autoregressive={m['identical_to_autoregressive']})")
    T, V, O = m["time_per_token/ar_ms"], m["time_per_round/verify_ms"], m["time_per_round/overhead_ms"]  # noqa: E741
    print(f"verify of {args.num_steps + 1} tokens = {V / T:.3f} x one AR token: speedup/acceptance ceiling with free "
          f"drafts T/(V+O) = {T / (V + O):.3f}; the {args.num_steps} draft steps take "
          f"{m['time_per_round/draft_ms']:.2f} ms "
          f"= {m['time_per_round/draft_ms'] / T:.2f} AR tokens")
    return (f"{prefix}acceptance_length={a:.4f} {prefix}speedup={s:.4f} "
            f"{prefix}speedup_predicted={m['speedup_predicted']:.4f} {prefix}speedup_over_acceptance={s / a:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
