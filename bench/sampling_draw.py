"""The speculative decoder's token draw (eval/sampling.py `draw`, inverse CDF) next to
`torch.multinomial`, side by side: seconds per draw of one token per row, and whether the two agree
in distribution.

    python bench/sampling_draw.py [--rows 128] [--vocab 2048 (151936: Qwen's)] [--reps 200]
        [--threads 2] [--draws 200000] [--device cpu|cuda|npu|auto]

Rows of a peaked softmax (logits ~ N(0, 3^2)), as a trained model's tempered distributions are.
Agreement: --draws (200k) of each from one row; the largest gap between their empirical frequencies
and the row's probabilities (both should be within a few 1e-3). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.eval.sampling import draw
from tandem.trainer.parallel.device import Device, resolve_device


def seconds_per_call(fn, reps: int, device: Device) -> float:
    """Mean seconds of `fn()` over `reps` calls after 5 warm-up calls, the device synchronised
    around them (bench/decode_attention.py times its layouts with it too)."""
    for _ in range(5):
        fn()
    device.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    device.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draws", type=int, default=200_000,
                    help="draws of each from row 0 for the agreement figure")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu or auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    device = dev.device
    gen = torch.Generator(device=device).manual_seed(0)
    probs = torch.softmax(3 * torch.randn(args.rows, args.vocab, generator=gen, device=device), -1)
    multinomial = seconds_per_call(lambda: torch.multinomial(probs, 1, generator=gen), args.reps,
                                   dev)
    inverse_cdf = seconds_per_call(lambda: draw(probs, gen), args.reps, dev)
    # draws from row 0, a chunk of rows at a time: both materialise [rows, vocab]
    chunk = max(1, min(args.draws, 2**24 // args.vocab))
    row = probs[:1].expand(chunk, -1)
    gaps = {}
    for name, one in (("multinomial", lambda: torch.multinomial(row, 1, generator=gen)[:, 0]),
                      ("draw", lambda: draw(row, gen))):
        tokens = torch.cat([one() for _ in range(-(-args.draws // chunk))])
        # fp64 on the host: accelerators (an NPU above all) have little or no fp64
        freq = torch.bincount(tokens.cpu(), minlength=args.vocab).double() / tokens.numel()
        gaps[name] = float((freq - probs[0].cpu().double()).abs().max())
    print(json.dumps({"rows": args.rows, "vocab": args.vocab, "device": str(device),
                      "threads": args.threads, "ms_multinomial": round(multinomial * 1e3, 3),
                      "ms_draw": round(inverse_cdf * 1e3, 3),
                      "speedup": round(multinomial / inverse_cdf, 1),
                      "max_frequency_gap": {k: round(v, 5) for k, v in gaps.items()}}))


if __name__ == "__main__":
    main()
