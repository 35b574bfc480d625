"""Decoding's attention over the KV cache in its two layouts, side by side: `models/layers.py`
`folded_attention` (the query heads that share a key head folded into the query length) against
`scaled_dot_product_attention(enable_gqa=True)` on the same tensors; milliseconds per call, their
ratio, the largest difference between the outputs, and which one `cached_attention` runs there.

    python bench/decode_attention.py [--rows 128] [--heads 4] [--kv-heads 2] [--head-dim 32]
        [--cached 180] [--reps 50] [--threads 2] [--dtype bf16|fp32|both]
        [--device cpu|cuda|npu|auto]

The default shapes are the tiny recipe's evaluator: 128 prompts in one batch, 4 query and 2 key
heads of 32 channels, about 180 cached positions midway through a decode; a verify forward reads
K + 1 = 4 new queries per row, an autoregressive step 1; batch 1 is timed as well. Prints one JSON
object per dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from tandem.models.layers import folded_attention, folds_query_heads
from tandem.trainer.parallel.device import Device, resolve_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sampling_draw import seconds_per_call  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _compare(args, dtype: torch.dtype, B: int, queries: int, dev: Device) -> dict:
    """Both layouts on one shape: their times, ratio, largest output difference, and the one
    `cached_attention` picks."""
    g = torch.Generator(device=dev.device).manual_seed(0)
    S = args.cached

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev.device).to(dtype)

    q = randn(B, args.heads, queries, args.head_dim)
    k, v = randn(B, args.kv_heads, S, args.head_dim), randn(B, args.kv_heads, S, args.head_dim)
    # each row's newest queries at a different depth of its cache, as rows of a batch are
    at = torch.randint(S // 2, S - queries + 1, (B, 1), generator=g, device=dev.device)
    positions = at + torch.arange(queries, device=dev.device)
    mask = torch.arange(S, device=dev.device)[None, None, :] <= positions[..., None]

    def folded():
        return folded_attention(q, k, v, mask)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)

    ms_gqa, ms_folded = (1e3 * seconds_per_call(fn, args.reps, dev) for fn in (gqa, folded))
    return {"rows": B, "queries_per_row": queries, "ms_enable_gqa": round(ms_gqa, 3),
            "ms_folded": round(ms_folded, 3), "speedup": round(ms_gqa / ms_folded, 2),
            "max_abs_diff": float((folded().float() - gqa().float()).abs().max()),
            "cached_attention_runs": "folded" if folds_query_heads(q, k) else "enable_gqa"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--cached", type=int, default=180)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32", "both"), default="both")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu or auto")
    args = ap.parse_args()
    if args.heads % args.kv_heads or args.cached < 4:
        ap.error("--heads must be a multiple of --kv-heads, and --cached at least 4")
    torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    for name in ("bf16", "fp32") if args.dtype == "both" else (args.dtype,):
        shapes = [_compare(args, DTYPES[name], b, n, dev) for b in (args.rows, 1) for n in (4, 1)]
        print(json.dumps({"dtype": name, "device": str(dev.device), "threads": args.threads,
                          "heads": args.heads, "kv_heads": args.kv_heads, "cached": args.cached,
                          "shapes": shapes}))


if __name__ == "__main__":
    main()
