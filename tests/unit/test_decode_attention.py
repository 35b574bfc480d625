"""`models.layers.cached_attention`, decoding's attention over a cache prefix, in both of its
layouts (query heads folded into the query length, or the kernel's own `enable_gqa`) against
attention written out in float64: every query head reads its own key head (h // groups), keys past
a query's mask never count, rows of one batch at different depths of the cache."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tandem.models.layers import cached_attention, folds_query_heads
from tests import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _by_hand(q, k, v, mask):
    """softmax(q k^T / sqrt(d) masked) v per query head, each on key head h // groups, in
    float64."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("dtype, rows, queries, folded", [
    (torch.float32, 3, 4, True),  # a verify forward's K + 1 queries
    (torch.float32, 3, 1, False),  # fp32's one-query kernel is kept
    (torch.bfloat16, 3, 1, True),
    (torch.bfloat16, 1, 4, False),  # one row: the kernel's own grouping
])
def test_cached_attention_is_attention_written_out(dtype, rows, queries, folded):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, cached, dim = 6, 2, 20, 8
    q = torch.randn(rows, heads, queries, dim, generator=g).to(dtype)
    k = torch.randn(rows, kv_heads, cached, dim, generator=g).to(dtype)
    v = torch.randn(rows, kv_heads, cached, dim, generator=g).to(dtype)
    newest = torch.tensor([19, 11, 6][:rows])  # each row at its own depth of the cache
    positions = (newest - queries + 1)[:, None] + torch.arange(queries)
    mask = torch.arange(cached)[None, None, :] <= positions[..., None]
    assert folds_query_heads(q, k) is folded
    out = cached_attention(q, k, v, mask)
    ref = _by_hand(q, k, v, mask)
    assert out.dtype == dtype and out.shape == ref.shape
    # fp32: rounding only; bf16: a few of its ulps on values of order 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - ref).abs().max() <= tol
    # a key past every query's mask changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 100.0, 100.0
    if rows > 1:  # the first row's newest query reads the last key; only the others are checked
        assert torch.equal(cached_attention(q, k2, v2, mask)[1:], out[1:])


def test_the_decode_attention_bench_runs():
    """bench/decode_attention.py at a small size: both layouts timed, their outputs equal within
    fp32 rounding, and the layout cached_attention picks named for each shape."""
    proc = processes.command([sys.executable, "bench/decode_attention.py", "--rows", "4",
                              "--cached", "16", "--reps", "2", "--threads", "1", "--dtype", "fp32"],
                             timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    picked = {(s["rows"], s["queries_per_row"]): s["cached_attention_runs"] for s in out["shapes"]}
    assert picked == {(4, 4): "folded", (4, 1): "enable_gqa", (1, 4): "enable_gqa",
                      (1, 1): "enable_gqa"}
    assert all(s["ms_folded"] > 0 and s["max_abs_diff"] < 1e-5 for s in out["shapes"])
