"""`eval.sampling.draw`, the decoder's token draw (inverse CDF), against the distribution it is
given: frequencies over many draws within binomial error of the probabilities, weights of zero never
drawn, unnormalised weights (speculative sampling's residuals) drawn as their normalisation."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tandem.eval.sampling import TokenChooser, draw
from tests import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("scale", [1.0, 0.037])  # a distribution, and residual-like weights
def test_draw_frequencies_match_the_weights_and_zeros_are_never_drawn(scale):
    weights = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0, 1e-3]) * scale
    probs = (weights / weights.sum()).double()
    n = 400_000
    tokens = draw(weights.expand(n, -1), torch.Generator().manual_seed(0))
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    freq = _frequencies(tokens, weights.numel())
    assert freq[weights == 0].sum() == 0
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)


def test_draw_keeps_leading_dimensions_and_follows_each_row():
    """Rows [B, K, V] drawn independently: a one-hot row always gives its token."""
    weights = torch.zeros(3, 2, 5)
    weights[0, 0, 4] = weights[0, 1, 0] = weights[1, 0, 2] = weights[1, 1, 3] = 1.0
    weights[2, :, 1] = weights[2, :, 2] = 0.5
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([draw(weights, gen) for _ in range(200)])
    assert draws.shape == (200, 3, 2)
    assert (draws[:, :2] == torch.tensor([[4, 0], [2, 3]])).all()
    assert set(draws[:, 2].flatten().tolist()) == {1, 2}


def test_a_row_of_nan_draws_a_token_inside_the_vocabulary():
    weights = torch.tensor([[0.2, 0.8, 0.0], [float("nan")] * 3])
    tokens = draw(weights, torch.Generator().manual_seed(3))
    assert tokens[0] in (0, 1) and 0 <= int(tokens[1]) < 3


def _two_level_fp64(probs: torch.Tensor, u_block: torch.Tensor, u_token: torch.Tensor):
    """The two-level inverse CDF written plainly in fp64: the block of ceil(sqrt(V)) tokens whose
    cumulative weight first exceeds u_block x total, then the token inside it likewise."""
    vocab = probs.shape[-1]
    width = 1
    while width * width < vocab:
        width += 1
    tokens = []
    for row, u1, u2 in zip(probs.double(), u_block.double(), u_token.double()):
        blocks = [row[i:i + width] for i in range(0, vocab, width)]
        cum, target, b = 0.0, float(u1) * float(row.sum()), 0
        for b, part in enumerate(blocks):
            cum += float(part.sum())
            if cum > target:
                break
        inside = torch.searchsorted(blocks[b].cumsum(0), u2 * blocks[b].sum(), right=True)
        tokens.append(b * width + int(inside))
    return torch.tensor(tokens)


def test_draw_at_a_large_vocabulary_is_the_fp64_two_level_draw_of_its_uniforms():
    """At Qwen's 151,936 tokens, peaked rows: each token drawn is the one the exact (fp64) rule
    picks for the same two uniforms. One fp32 cumsum over the whole vocabulary resolves a token
    only to an ulp of the running total (about 1e-3 of total variation there); the two levels' short
    sums leave about 5e-6, so 64 rows agree."""
    vocab, rows = 151_936, 64
    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(rows, vocab, generator=gen)
    logits[:, 7] += 12.0  # one token of most of the mass, ahead of a long tail
    probs = torch.softmax(logits, -1)
    tokens = draw(probs, torch.Generator().manual_seed(11))
    uniforms = torch.Generator().manual_seed(11)  # the draw's two uniforms per row, in its order
    u_block = torch.rand(rows, 1, generator=uniforms).squeeze(-1)
    u_token = torch.rand(rows, 1, generator=uniforms).squeeze(-1)
    assert torch.equal(tokens, _two_level_fp64(probs, u_block, u_token))


def test_a_sampling_chooser_draws_from_its_tempered_distribution():
    """TokenChooser at T=2 over fixed logits: the draws' frequencies are softmax(logits / 2)'s."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0]]).expand(200_000, -1)
    chooser = TokenChooser(temperature=2.0, generator=torch.Generator().manual_seed(2))
    tokens, probs = chooser.choose(logits)
    expected = torch.softmax(torch.tensor([2.0, 0.0, -1.0, 1.0], dtype=torch.float64) / 2, -1)
    assert torch.allclose(probs[0].double(), expected, atol=1e-6)
    sigma = (expected * (1 - expected) / tokens.numel()).sqrt()
    assert ((_frequencies(tokens, 4) - expected).abs() <= 5 * sigma).all()


def test_the_draw_bench_runs():
    """bench/sampling_draw.py at a small size: both draws are timed and agree with the row."""
    proc = processes.command([sys.executable, "bench/sampling_draw.py", "--rows", "4", "--vocab",
                           "64", "--reps", "2", "--threads", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ms_multinomial"] > 0 and out["ms_draw"] > 0
    assert max(out["max_frequency_gap"].values()) < 0.01
