"""QSA's gather form, forward + backward, with its own backward (models/qsa_tokens.
GatheredAttention: each query chunk recomputed, K and V gradients accumulated in one buffer)
against the checkpoint-per-chunk path it replaced (kept here only as the baseline), side by side in
one run.

The long-context shape: a cp rank's queries (`--queries`) over the whole window's keys and values
(`--seq`), the candidates a query gathers (budget + r - 1 slots) drawn from its past, the queries
cut into `--chunks` chunks (the 256k stage cuts ~130 per layer). Per sequence length: the median
seconds of each path over `--reps` (alternating, after one warm-up), their ratio, the elements each
backward writes (tests/backward_cost.py), and the largest difference of the gradients.

    python bench/qsa_gather_backward.py [--seqs 8192,16384,32768] [--queries-div 4] [--chunks 64]
        [--heads 8] [--kv-heads 2] [--head-dim 64] [--slots 2051] [--reps 3] [--threads 1]
`--queries-div 32 --slots 259 --chunks 128` gives the 256k stage's proportions (a cp=32 rank's
queries, slots a quarter of them; docs/long_context.md has both shapes' figures).
Last line: `old_over_new=<ratio at the largest length>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.models.qsa_tokens import _attend, gather_attend  # noqa: E402
from tests.backward_cost import backward_elements  # noqa: E402


def _plain(q, idx, ok, k, v):
    """One chunk of the gather form in plain autograd ops (the path before: the same ops, whose
    gather's backward zero-fills a whole-K and whole-V gradient per chunk)."""
    return _attend(q, idx, ok, k.reshape(k.shape[0] * k.shape[1], -1),
                   v.reshape(v.shape[0] * v.shape[1], -1))


def checkpointed(q, idx, ok, k, v, chunk):
    """The path before: autograd through a checkpoint of the gather form per query chunk."""
    return torch.cat([checkpoint(_plain, *part, k, v, use_reentrant=False,
                                 preserve_rng_state=False)
                      for part in zip(q.split(chunk, 1), idx.split(chunk, 1), ok.split(chunk, 1))],
                     1)


def own(q, idx, ok, k, v, chunk):
    return gather_attend(q, idx, ok, k, v, chunk)


def case(args, s: int):
    g = torch.Generator().manual_seed(0)
    s_q = s // args.queries_div
    q = torch.randn(1, s_q, args.heads, args.head_dim, generator=g)
    k = torch.randn(1, s, args.kv_heads, args.head_dim, generator=g)
    v = torch.randn(1, s, args.kv_heads, args.head_dim, generator=g)
    last = torch.arange(s - s_q, s)[None, :, None]  # the rank's queries sit at the window's end
    idx = (torch.rand(1, s_q, args.slots, generator=g) * (last + 1)).long()
    ok = torch.ones(1, s_q, args.slots, dtype=torch.bool)
    grad = torch.randn(1, s_q, args.heads * args.head_dim, generator=g)
    return (q, k, v), idx, ok, grad, max(1, s_q // args.chunks)


def run(fn, tensors, idx, ok, grad, chunk):
    q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
    start = time.perf_counter()
    out = fn(q, idx, ok, k, v, chunk)
    out.backward(grad)
    return time.perf_counter() - start, (q.grad, k.grad, v.grad)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--queries-div", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--slots", type=int, default=2051)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = {"checkpointed": checkpointed, "own": own}
    print(f"{'seq':>7} {'queries':>7} {'chunk':>5} {'old_s':>8} {'new_s':>8} {'ratio':>6} "
          f"{'old_written':>12} {'new_written':>12} {'max_grad_diff':>13}")
    ratio = None
    for s in (int(x) for x in args.seqs.split(",")):
        tensors, idx, ok, grad, chunk = case(args, s)
        times = {name: [] for name in paths}
        grads = {}
        for rep in range(args.reps + 1):
            for name, fn in paths.items():
                seconds, grads[name] = run(fn, tensors, idx, ok, grad, chunk)
                if rep:
                    times[name].append(seconds)
        written = {}
        for name, fn in paths.items():
            q, k, v = (t.detach().clone().requires_grad_() for t in tensors)
            written[name] = backward_elements((fn(q, idx, ok, k, v, chunk) * grad).sum())
        diff = max(float((a - b).abs().max()) for a, b in zip(grads["checkpointed"], grads["own"]))
        old, new = (statistics.median(times[n]) for n in paths)
        ratio = old / new
        print(f"{s:>7} {idx.shape[1]:>7} {chunk:>5} {old:>8.3f} {new:>8.3f} {ratio:>6.2f} "
              f"{written['checkpointed']:>12} {written['own']:>12} {diff:>13.2e}")
    print(f"old_over_new={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
