"""Speculative (MTP drafts) vs plain autoregressive decode speed of one checkpoint, side by side.

    python bench/spec_decode.py [--checkpoint DIR] [--num-steps 3] [--repeats 5]

Greedy decoding of the same validation prompts with K MTP drafts and without; the two are
interleaved batch by batch and repetition by repetition and the medians compared. Prints the
measured decode tokens/s of both, the measured speedup, the predicted speedup A*T/(D+V+O) from the
measured per-round draft (D), verify (V) and overhead (O) times and the AR per-token time T, the
ceiling T/(V+O) that speedup/acceptance could reach if drafting were free (it is below 1 wherever a
forward over K+1 tokens costs more than one over a single token), and ends with one line
`acceptance_length=<a> speedup=<s> speedup_over_acceptance=<s/a>`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default="runs/tiny",
                   help="run or step directory (default: the tiny recipe's)")
    p.add_argument("--num-steps", type=int, default=3, help="draft length K")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (tiny ops: 1 is fastest)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from tandem.eval.decode_eval import evaluate_decoding
    from tandem.trainer.checkpoint import load_model_from_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer, validation_prompts

    model, cfg = load_model_from_checkpoint(args.checkpoint)
    tok = load_run_tokenizer(cfg)
    prompts, _ = validation_prompts(cfg, args.num_prompts, min(args.prompt_len, cfg.data.seq_len),
                             tok.eod_id if tok else None)
    with torch.inference_mode():
        m, _, _ = evaluate_decoding(model, prompts, num_steps=args.num_steps,
                                    max_new_tokens=args.max_new_tokens,
                                    batch_size=args.batch_size, eos_id=tok.eod_id if tok else None,
                                    warmup=True, repeats=args.repeats)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()},
                     indent=1))
    a, s = m["acceptance_length"], m["speedup"]
    print(f"tokens/s spec={m['decode_tokens_per_s/spec']:.1f} ar={m['decode_tokens_per_s/ar']:.1f} "
          f"speedup={s:.3f} predicted={m['speedup_predicted']:.3f} (K={args.num_steps}, "
          f"identical_to_autoregressive={m['identical_to_autoregressive']})")
    T, V, O = (  # noqa: E741
        m["time_per_token/ar_ms"],
        m["time_per_round/verify_ms"],
        m["time_per_round/overhead_ms"],
    )
    print(f"verify of {args.num_steps + 1} tokens = {V / T:.3f} x one AR token: speedup/acceptance "
          "ceiling with free "
          f"drafts T/(V+O) = {T / (V + O):.3f}; the {args.num_steps} draft steps take "
          f"{m['time_per_round/draft_ms']:.2f} ms "
          f"= {m['time_per_round/draft_ms'] / T:.2f} AR tokens")
    print(f"acceptance_length={a:.4f} speedup={s:.4f} speedup_over_acceptance={s / a:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
