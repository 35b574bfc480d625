"""Token choice for the speculative decoder: the tempered top-k / nucleus distribution, a
`TokenChooser` that draws from it (or takes the argmax at temperature 0), and the token-wise
speculative-sampling rule. Block verification, the other rule, is eval/block_verify.py."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float,
                      top_k: int = 0) -> torch.Tensor:
    """Softmax(logits / T) restricted to the `top_k` largest logits (0: all; ties with the k-th are
    kept) and then to the top-p nucleus, renormalised (fp32)."""
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = p.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p, 0.0)
        p = torch.zeros_like(p).scatter_(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, taken on fp32 logits: the same token (the conversion is
    exact and both take the first of tied maxima), but bf16's CPU argmax is several times slower
    than the cast and fp32's together."""
    return logits.float().argmax(-1)


def draw(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One draw per row of `probs` [..., V] (non-negative weights, any positive total) -> [...], by
    inverse CDF in two levels: a block of about sqrt(V) tokens by the blocks' cumulative weights,
    then a token inside it by the block's own cumulative weights, each with its own uniform.

    The same distribution as `torch.multinomial(probs, 1)`, which is many times slower on CPU at
    the evaluator's batch and vocabulary (bench/sampling_draw.py measures both side by side). Two
    levels because one fp32 cumsum over a 152k vocabulary resolves a token only to one ulp of the
    running total (6e-8 near 1): after a token of weight 0.99 a tail token of 1e-7 gets either 0
    or 6e-8, about 1e-3 of total variation at that vocabulary, and a uniform has no finer steps
    either. Each level here sums a few hundred weights, so the error is that of a few hundred.
    A token of weight 0 is never drawn: each uniform stays below its total, and the first
    cumulative weight above it is where the weight jumps."""
    vocab = probs.shape[-1]
    width = max(1, math.isqrt(vocab - 1) + 1)
    blocks = F.pad(probs.float(), (0, -vocab % width)).unflatten(-1, (-1, width))
    block = _inverse_cdf(blocks.sum(-1).cumsum(-1), generator)
    inside = blocks.gather(-2, block[..., None, None].expand(*block.shape, 1, width)).squeeze(-2)
    token = block * width + _inverse_cdf(inside.cumsum(-1), generator)
    # a row of NaN (a diverged model) would index past the vocabulary: its token is then the last
    # one, without the host sync a check would cost every draw
    return token.clamp_(max=vocab - 1)


def _inverse_cdf(cdf: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The first index of `cdf` [..., n] whose value exceeds a uniform on [0, cdf[..., -1])."""
    total = cdf[..., -1:]
    u = torch.rand(total.shape, generator=generator, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u * total may round up
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


class TokenChooser:
    """How a decode picks a token from logits: greedy at temperature 0, else a draw from the
    tempered top-k / top-p distribution with the decode's generator. The trunk's tokens and the
    drafts are chosen alike (so temperature, top-k and top-p apply identically to the target p and
    the draft q, and speculative sampling is exact for that distribution)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0,
                 generator: Optional[torch.Generator] = None, top_k: int = 0):
        self.temperature, self.top_p, self.generator = float(temperature), float(top_p), generator
        self.top_k = int(top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from (sampling only)."""
        return probs_from_logits(logits, self.temperature, self.top_p, self.top_k)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw per row of `probs` [B, V] (non-negative, any positive total) -> [B]."""
        return draw(probs, self.generator)

    def choose(self, logits: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(token [B], probs [B,V] or None when greedy) from logits [B,V]."""
        if self.greedy:
            return greedy_tokens(logits), None
        probs = self.probs(logits)
        return self.sample(probs), probs


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor):
    """The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023).

    p [B,K+1,V] target probabilities at the verify positions, q [B,K,V] the draft probabilities the
    drafts [B,K] were sampled from, u [B,K] uniforms. Draft i is accepted with min(1, p/q) while all
    before it were. Returns (n [B] accepted drafts, dist [B,V] to sample the next token from: the
    residual norm(max(p_n - q_n, 0)) after a rejection, p_K after all K were accepted).
    """
    k = drafts.shape[1]
    pd = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = u * qd < pd
    n = accept.long().cumprod(1).sum(1)
    p_n = p.gather(1, n.view(-1, 1, 1).expand(-1, 1, p.shape[-1])).squeeze(1)
    q_n = q.gather(1, n.clamp(max=k - 1).view(-1, 1, 1).expand(-1, 1, q.shape[-1])).squeeze(1)
    resid = (p_n - q_n).clamp(min=0.0)
    total = resid.sum(-1, keepdim=True)
    use_resid = (n < k).unsqueeze(-1) & (total > 0)
    dist = torch.where(use_resid, resid / total.clamp(min=1e-30), p_n)
    return n, dist
