"""The acceptance figures of a decode (vLLM's definitions) and their 95% intervals over prompts.

* `acceptance_metrics`: mean acceptance length, per-position acceptance rates and the draft
  acceptance rate of a DecodeStats, each with `<key>_lo95` / `<key>_hi95` (`acceptance_intervals`: a
  bootstrap over prompts at Hesterberg's expanded percentile levels);
* `row_metrics`: one prompt's figures (for `tandem eval --output` and the logged samples);
* `resample_weights` (the bootstrap's draws, shared with eval/seed_comparison.py's paired comparison
  over seeds) and `t_quantile` (Student's t, behind the expanded levels and that comparison's
  intervals).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Iterator, Tuple

import torch

from .spec_decode import DecodeStats

INTERVAL_RESAMPLES = 2000
"""Bootstrap resamples behind each 95% interval (`acceptance_intervals`)."""
INTERVAL_SEED = 0
"""Seed of the resampling generator: the same rows give the same interval in every run and
layout."""
BOOTSTRAP_MIN_PROMPTS = 8
"""Fewest prompts the bootstrap reads an interval from. Below it a resample can reach no further
than the prompts' own range, however far the tail it is read at (2 prompts hold 3 distinct
resamples): the expanded percentiles covered a synthetic population's figure 53% of the time at 2
prompts, 86% at 4, and 96% at 8 (tests/unit/test_eval_intervals.py). Fewer prompts get Student's t
on the ratio's linearisation instead (`_few_prompt_intervals`)."""


def row_counts(stats: DecodeStats) -> torch.Tensor:
    """[B, 2+K] float64 per-row counts: rounds, accepted, accepted at positions 1..K."""
    K = stats.num_steps
    cols = [stats.rounds.view(-1, 1), stats.accepted.view(-1, 1), stats.accepted_at[:, :K]]
    return torch.cat([c.to("cpu", torch.float64) for c in cols], 1)


def ratio_figures(sums: torch.Tensor, K: int) -> dict:
    """The acceptance figures from summed counts `sums` [..., 2+K] (as `row_counts` orders them),
    each a tensor of the leading shape: one formula for the point estimate and every resample."""
    drafts, acc = sums[..., 0], sums[..., 1]
    out = {"acceptance_length": 1.0 + acc / drafts.clamp(min=1),
           "draft_acceptance_rate": acc / (drafts * K).clamp(min=1)}
    for i in range(K):
        out[f"accept_rate/pos_{i + 1}"] = sums[..., 2 + i] / drafts.clamp(min=1)
    return out


def t_quantile(df: float, level: float = 0.95) -> float:
    """Student's t quantile of a two-sided `level` interval at `df` degrees of freedom (real df >
    0, as Welch-Satterthwaite gives them), exact to 1e-10: the two-sided probability 1 -
    I_x(df/2, 1/2) at x = df / (df + t^2) solved for t by bisection (12.706 at df = 1, 4.303 at df =
    2, where a series in 1/df read 11.3 and 4.27 and called a difference significant that was
    not)."""
    def outside(t: float) -> float:  # P(|T| > t)
        return _regularized_beta(df / (df + t * t), df / 2, 0.5)

    hi = 1.0
    while outside(hi) > 1 - level:
        hi *= 2
    lo = 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if outside(mid) > 1 - level else (lo, mid)
        if hi - lo < 1e-12 * hi:
            break
    return (lo + hi) / 2


def _regularized_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), on the side of x where it converges fast."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _regularized_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log1p(-x)) / a
    tiny = 1e-300

    def clamp(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1.0 / clamp(1.0 - (a + b) * x / (a + 1))
    f = d
    for m in range(1, 500):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d, c = 1.0 / clamp(1.0 + even * d), clamp(1.0 + even / c)
        f *= d * c
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d, c = 1.0 / clamp(1.0 + odd * d), clamp(1.0 + odd / c)
        f *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * f


def _expanded_levels(n: int, level: float = 0.95) -> tuple:
    """The quantiles (lo, hi) of the bootstrap distribution that give a `level` interval from n
    rows.

    A plain percentile interval is too narrow for few prompts: the bootstrap spread divides by n
    where the unbiased variance divides by n - 1, and it uses normal quantiles where Student's t
    applies. Hesterberg's expanded percentile interval reads the percentiles at the normal tail
    whose quantile is sqrt(n / (n - 1)) * t_{n-1}; it tends to the plain percentiles as n grows.
    t_{n-1} comes from `t_quantile`; at few rows the tail is near 0 and the interval spans the
    resamples' range."""
    if n < 2:
        return 0.0, 1.0
    tail = NormalDist().cdf(-math.sqrt(n / (n - 1)) * t_quantile(n - 1, level))
    return tail, 1.0 - tail


def resample_weights(n: int, resamples: int = INTERVAL_RESAMPLES,
                     seed: int = INTERVAL_SEED) -> Iterator[torch.Tensor]:
    """The bootstrap over n prompts, in chunks: [r, n] float64 matrices, row j holding how often
    each prompt is drawn (with replacement, n draws) in resample j; `resamples` rows in all. A
    resample's summed counts are then one matmul with the [n, ...] per-prompt counts, and every
    statistic that multiplies the same chunks resamples the same prompts (a paired bootstrap). The
    generator is private and fixed-seed: the global RNG is untouched and a rerun draws the same
    resamples."""
    g = torch.Generator().manual_seed(seed)
    # bounds the [chunk, n] weight matrix when there are many prompts
    chunk = max(1, (1 << 22) // n)
    for start in range(0, resamples, chunk):
        r = min(chunk, resamples - start)
        idx = torch.randint(n, (r, n), generator=g)
        yield torch.zeros(r, n, dtype=torch.float64).scatter_add_(1, idx,
                                                                  torch.ones(r, n,
                                                                             dtype=torch.float64))


def acceptance_intervals(stats: DecodeStats, resamples: int = INTERVAL_RESAMPLES,
                         seed: int = INTERVAL_SEED) -> dict:
    """95% percentile-bootstrap interval of each `acceptance_metrics` figure, as `<key>_lo95` and
    `<key>_hi95`, its percentiles read at the expanded levels of `_expanded_levels`.

    The unit resampled is the row (one prompt): rows are drawn with replacement and each figure is
    recomputed as the ratio of the resample's summed counts, as the point estimate is. Rounds within
    a prompt share its text and are correlated, so resampling rounds would understate the width.
    Under data parallelism `stats` must hold every replica's rows (evaluate_decoding gathers them in
    batch order), so the interval equals one process's. The generator is private and fixed-seed: the
    global RNG is untouched and a rerun reproduces the interval."""
    counts = row_counts(stats)
    K = stats.num_steps
    if counts.shape[0] == 0 or K == 0:  # K = 0 (no MTP module) decodes autoregressively: no draft
        return {}
    # A prompt that ended at its prefill (its first token EOS) drafted nothing and adds nothing to
    # any figure; resamples of only such prompts would read 1.0 and 0.0, figures no prompt showed.
    if bool((counts[:, 0] > 0).any()):
        counts = counts[counts[:, 0] > 0]
    if float(counts[:, 0].sum()) == 0:
        # nothing drafted (every prompt ended at its prefill): no figure was measured, and a
        # zero-width interval at 1.0 / 0.0 would read as a drafter measured useless
        return {f"{key}_{end}95": bound for key in ratio_figures(counts.sum(0), K)
                for end, bound in zip(("lo", "hi"), figure_range(key, K))}
    n = counts.shape[0]
    if n < BOOTSTRAP_MIN_PROMPTS:
        return _widened(_few_prompt_intervals(counts, K), counts, K)
    figures = ratio_figures(torch.cat([w @ counts for w in resample_weights(n, resamples, seed)]),
                             K)
    q = torch.tensor(_expanded_levels(n), dtype=torch.float64)
    out = {}
    for key, values in figures.items():
        lo, hi = torch.quantile(values, q).tolist()
        out[f"{key}_lo95"], out[f"{key}_hi95"] = lo, hi
    return _widened(out, counts, K)


def _wilson(successes: float, trials: float) -> tuple:
    """The 95% Wilson score interval of a binomial proportion."""
    z2 = NormalDist().inv_cdf(0.975) ** 2
    p = successes / trials
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = (z2 / (1 + z2 / trials)) * math.sqrt(p * (1 - p) / (trials * z2) + 1 / (4 * trials ** 2))
    return max(0.0, centre - half), min(1.0, centre + half)


def pooled_binomial_variance(sums: torch.Tensor, K: int) -> dict:
    """Each figure's variance from pooled counts `sums` [..., 2+K] (as `row_counts` orders them) as
    if every round were an independent trial: Agresti-Coull's p~(1 - p~) / n~ (p~ = (x + z^2/2) /
    n~, n~ = n + z^2), so a rate seen at 0 or 1 still has a spread. A floor where prompts tie, never
    the variance where they spread (rounds within a prompt are correlated)."""
    z2 = NormalDist().inv_cdf(0.975) ** 2
    rounds = sums[..., 0]

    def variance(successes: torch.Tensor, trials: torch.Tensor) -> torch.Tensor:
        n = trials + z2
        p = (successes + z2 / 2) / n
        return p * (1 - p) / n

    out = {"draft_acceptance_rate": variance(sums[..., 1], rounds * K)}
    out["acceptance_length"] = K * K * out["draft_acceptance_rate"]
    for i in range(K):
        out[f"accept_rate/pos_{i + 1}"] = variance(sums[..., 2 + i], rounds)
    return {key: out[key] for key in ratio_figures(sums, K)}


def _widened(out: dict, counts: torch.Tensor, K: int) -> dict:
    """Each interval widened to hold at least the Wilson interval of its pooled counts: a rate's
    accepted drafts over its rounds (the draft acceptance rate's over rounds x K, and acceptance
    length 1 + K x that rate). Over prompts that tie (budget-exact counting gives prompts with as
    many rounds the same figure) or a position never accepted, the prompts' spread is 0 and so was
    the interval: 5-46% of 2-3 prompt sets, covering the true figure 54-89% of the time, and [0, 0]
    for an unseen rate. Pooling treats rounds as independent, so it is a floor only, never the
    interval where the prompts do spread."""
    sums = counts.sum(0).tolist()
    rounds, accepted = sums[0], sums[1]
    if rounds == 0:
        return out
    floors = {"draft_acceptance_rate": _wilson(accepted, rounds * K)}
    floors["acceptance_length"] = tuple(1.0 + K * r for r in floors["draft_acceptance_rate"])
    for i in range(K):
        floors[f"accept_rate/pos_{i + 1}"] = _wilson(sums[2 + i], rounds)
    for key, (lo, hi) in floors.items():
        out[f"{key}_lo95"] = min(out[f"{key}_lo95"], lo)
        out[f"{key}_hi95"] = max(out[f"{key}_hi95"], hi)
    return out


def figure_range(key: str, K: int) -> Tuple[float, float]:
    """The values acceptance figure `key` can take: acceptance length 1..K+1, rates 0..1."""
    return (1.0, K + 1.0) if key == "acceptance_length" else (0.0, 1.0)


def _few_prompt_intervals(counts: torch.Tensor, K: int) -> dict:
    """The intervals from fewer than BOOTSTRAP_MIN_PROMPTS prompts: each figure is a ratio of sums
    over prompts (F = sum y / sum x, x a prompt's drafts), so its standard error is that of the
    prompts' residuals y_i - F x_i (the delta method), and the interval F +- t_{n-1} se, clipped to
    the figure's range (acceptance length 1..K+1, rates 0..1). One prompt measures no spread: its
    interval is the whole range. Prompts with identical figures give a zero-width one, as the
    bootstrap does, which `_widened` then widens."""
    n, drafts = counts.shape[0], counts[:, 0]
    point, per_row = ratio_figures(counts.sum(0), K), ratio_figures(counts, K)
    t = t_quantile(n - 1) if n > 1 else math.inf
    out = {}
    for key, value in point.items():
        low, high = figure_range(key, K)
        if n < 2:
            half = math.inf
        else:
            residuals = drafts * (per_row[key] - value)
            se = float(residuals.pow(2).sum() * n / (n - 1)).__pow__(0.5) / float(drafts.sum())
            half = t * se
        out[f"{key}_lo95"] = max(low, float(value) - half)
        out[f"{key}_hi95"] = min(high, float(value) + half)
    return out


def acceptance_metrics(stats: DecodeStats) -> dict:
    """vLLM definitions: mean acceptance length = 1 + accepted / drafts (draft = one K-token round
    of one sequence; includes the bonus token), per-position rate = accepted at position i / drafts,
    draft acceptance rate = accepted / drafted tokens. Accepted counts are budget-exact (drafts past
    max_new_tokens or EOS do not count), so acceptance length = decoded tokens / rounds. Each figure
    is followed by its 95% interval over prompts (`acceptance_intervals`: `<key>_lo95`,
    `<key>_hi95`)."""
    point = ratio_figures(row_counts(stats).sum(0), stats.num_steps)
    intervals = acceptance_intervals(stats)
    out = {}
    for key, value in point.items():
        out[key] = float(value)
        if intervals:
            out[f"{key}_lo95"], out[f"{key}_hi95"] = intervals[f"{key}_lo95"], intervals[f"{key}"
                                                                                         "_hi95"]
    return out


def row_metrics(stats: DecodeStats, b: int) -> dict:
    """One row's acceptance (budget-exact), plus `accepted_all` / `accepted_all_at` (every accepted
    draft, also past the budget: vLLM's counters) when the decode recorded them. No interval: one
    prompt is the bootstrap's unit, not something it can resample."""
    drafts, acc, K = int(stats.rounds[b]), int(stats.accepted[b]), stats.num_steps
    out = {"acceptance_length": 1.0 + acc / max(drafts, 1), "drafts": drafts, "accepted": acc,
           "draft_acceptance_rate": acc / max(drafts * K, 1)}
    for i in range(K):
        out[f"accept_rate/pos_{i + 1}"] = int(stats.accepted_at[b, i]) / max(drafts, 1)
    if stats.accepted_all is not None:
        out["accepted_all"] = int(stats.accepted_all[b])
        out["accepted_all_at"] = [int(x) for x in stats.accepted_all_at[b]]
    return out
