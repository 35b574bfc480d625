"""eval/seed_comparison.py: two settings compared over training seeds and prompts. A hand-computed
case (no prompt noise: Student's t over 3 seeds), a planted difference found, and equal settings
called significant in at most 10% of synthetic trials (nominal 5%) when the prompts dominate the
noise and when the seeds do."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.eval.acceptance import acceptance_metrics, t_quantile
from tandem.eval.seed_comparison import compare_over_seeds
from tandem.eval.spec_decode import DecodeStats

K = 3


def stats_of(accepted_at: torch.Tensor, rounds: int) -> DecodeStats:
    """[P, K] accepted drafts per position, `rounds` rounds per prompt."""
    r = torch.full((accepted_at.shape[0],), float(rounds), dtype=torch.float64)
    return DecodeStats(r, accepted_at.sum(1), accepted_at, K)


def uniform(accepted: int, prompts: int = 8, rounds: int = 10) -> DecodeStats:
    """Every prompt alike: `accepted` drafts accepted at position 1 in `rounds` rounds (no prompt
    noise)."""
    at = torch.zeros(prompts, K, dtype=torch.float64)
    at[:, 0] = accepted
    return stats_of(at, rounds)


def population(g: torch.Generator, prompt_effect: torch.Tensor, shift: float, seed_sd: float,
               noise_sd: float, seeds: int = 3, rounds: int = 16):
    """One setting's decodes over `seeds` seeds of a synthetic population: per-draft acceptance
    sigmoid(0.5 + shift + seed effect + prompt effect + seed x prompt noise), position i accepted
    with probability q^i in each round. The prompt effect is shared by every seed and both settings
    (the same prompts)."""
    out = []
    for _ in range(seeds):
        logit = 0.5 + shift + float(torch.randn((), generator=g)) * seed_sd + prompt_effect \
            + torch.randn(prompt_effect.shape, generator=g) * noise_sd
        q = torch.sigmoid(logit).double()
        r = torch.full(prompt_effect.shape, float(rounds), dtype=torch.float64)
        out.append(stats_of(torch.stack([torch.binomial(r, q ** (i + 1), generator=g)
                                         for i in range(K)], 1), rounds))
    return out


def test_t_quantiles_are_students():
    """Two-sided 95% (and 99%) quantiles of Student's t against the tables (scipy.stats.t.ppf for
    the fractional degrees of freedom Welch-Satterthwaite gives): a series in 1/df read 11.30 at
    df = 1 and 4.27 at df = 2, narrow enough to call a difference with p = 0.053 significant."""
    table = {(1, 0.95): 12.7062047, (2, 0.95): 4.30265273, (3, 0.95): 3.18244631,
             (10, 0.95): 2.22813885, (1.5, 0.95): 6.01666310, (2, 0.99): 9.92484320,
             (1e4, 0.95): 1.96020124}
    for (df, level), t in table.items():
        assert t_quantile(df, level) == pytest.approx(t, rel=1e-8), (df, level)


def _pooled_variance(accepted: int, rounds: int) -> float:
    """Acceptance length's variance from one seed's pooled counts, written out: Agresti-Coull's
    p~(1 - p~) / n~ of the draft acceptance rate over rounds x K trials, times K^2."""
    z2 = 1.959963984540054 ** 2
    n = rounds * K + z2
    p = (accepted + z2 / 2) / n
    return K * K * p * (1 - p) / n


def test_hand_computed_seed_interval():
    """No prompt varies, so the prompt bootstrap has no spread and the prompts' variance is its
    floor, each seed's pooled counts as independent rounds (8 prompts x 10 rounds): the interval
    is mean +- t_df * sqrt(var_seeds / 3 + sum floor_s / 9), df Welch-Satterthwaite's. A:
    acceptance length 1.0, 1.5, 2.0 (mean 1.5, sd 0.5); B: 1.1, 1.2, 1.3, so A - B = -0.1, 0.3, 0.7
    (mean 0.3, sd 0.4)."""
    a = [uniform(0), uniform(5), uniform(10)]
    b = [uniform(1), uniform(2), uniform(3)]
    c = compare_over_seeds(a, b, resamples=200)["acceptance_length"]
    assert t_quantile(2) == pytest.approx(4.303, rel=0.01)  # Student's t, 2 degrees of freedom
    assert [x.value for x in c.seeds_a] == pytest.approx([1.0, 1.5, 2.0])
    # no prompt noise within a seed: each seed's own interval is only its pooled counts' Wilson
    # floor (eval/acceptance.py `_widened`)
    assert all(x.lo < x.value < x.hi for x in c.seeds_a[1:])
    assert c.mean_a.value == pytest.approx(1.5) and c.mean_b.value == pytest.approx(1.2)

    def interval(value, sd, accepted):
        v_seed, floor = sd ** 2 / 3, sum(_pooled_variance(8 * x, 80) for x in accepted) / 9
        df = (v_seed + floor) ** 2 / (v_seed ** 2 / 2 + floor ** 2 / 7)
        return value - t_quantile(df) * math.sqrt(v_seed + floor), df

    lo_a, _ = interval(1.5, 0.5, (0, 5, 10))
    assert c.mean_a.hi - c.mean_a.value == pytest.approx(c.mean_a.value - lo_a)
    # 1.5 - 1.26 and 1.2 - 0.25 are below the least acceptance length there is: the bounds stop
    # at 1 (the difference's interval is not clipped, below)
    assert lo_a < 1.0 and c.mean_a.lo == c.mean_b.lo == 1.0
    lo, df = interval(0.3, 0.4, (0, 5, 10, 1, 2, 3))
    assert c.diff.value == pytest.approx(0.3) and c.df == pytest.approx(df)
    assert (c.diff.lo, c.diff.hi) == pytest.approx((lo, 0.6 - lo))
    assert 2 < df < 3 and not c.significant  # 0.3 +- 1.0 spans 0
    # A seed-constant gap has no seed variance, only the rounds' binomial floor (df = 8 - 1)
    same = compare_over_seeds([uniform(6), uniform(7), uniform(8)],
                              [uniform(2), uniform(3), uniform(4)],
                              resamples=200)["acceptance_length"]
    lo, df = interval(0.4, 0.0, (6, 7, 8, 2, 3, 4))
    assert same.diff.value == pytest.approx(0.4) and same.df == pytest.approx(7)
    assert (same.diff.lo, same.diff.hi) == pytest.approx((lo, 0.8 - lo)) and same.significant
    assert "significant=yes" in same.report("x", "y")[-1]


def test_per_seed_rows_are_the_evaluators_figures():
    g = torch.Generator().manual_seed(1)
    pe = torch.randn(16, generator=g) * 0.5
    a, b = population(g, pe, 0.0, 0.1, 0.3), population(g, pe, 0.0, 0.1, 0.3)
    c = compare_over_seeds(a, b)
    for key in ("acceptance_length", "draft_acceptance_rate", "accept_rate/pos_3"):
        for stats, row in zip(a, c[key].seeds_a):
            m = acceptance_metrics(stats)
            assert (row.value, row.lo,
                    row.hi) == pytest.approx((m[key], m[f"{key}_lo95"], m[f"{key}_hi95"]))
        assert c[key].mean_a.value == pytest.approx(sum(acceptance_metrics(s)[key] for s in a) / 3)


@pytest.mark.parametrize("seed_sd,noise_sd", [(0.1, 0.3), (0.5, 0.05)],
                         ids=["prompts-dominate", "seeds-dominate"])
def test_equal_settings_rarely_significant(seed_sd, noise_sd):
    g = torch.Generator().manual_seed(0)
    trials, hits = 60, 0
    for _ in range(trials):
        pe = torch.randn(24, generator=g) * 0.6
        a, b = population(g, pe, 0.0, seed_sd, noise_sd), population(g, pe, 0.0, seed_sd, noise_sd)
        hits += compare_over_seeds(a, b, resamples=200)["acceptance_length"].significant
    assert hits <= 0.10 * trials, hits


def expected_gap(shift: float, sd: float) -> float:
    """The population's gap in expected acceptance length, 1 + sum_i E[q^i], between logits 0.5 +
    shift + z and 0.5 + z, z ~ N(0, sd^2) (prompt, seed and noise effects together), by
    quadrature."""
    x = torch.linspace(-8, 8, 16001, dtype=torch.float64)
    w = torch.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi) * (16 / 16000)
    a, b = torch.sigmoid(0.5 + shift + sd * x), torch.sigmoid(0.5 + sd * x)
    return float(sum(((a ** i - b ** i) * w).sum() for i in range(1, K + 1)))


def test_planted_difference_found():
    """A drafts with a per-draft logit 1.0 higher (+0.70 acceptance length): significant in at
    least 90% of trials, and the difference's 95% interval holds the population's gap in at least
    85% of them (measured: 29 of 30)."""
    gap = expected_gap(1.0, math.sqrt(0.6 ** 2 + 0.15 ** 2 + 0.3 ** 2))
    assert gap == pytest.approx(0.702, abs=1e-3)
    g = torch.Generator().manual_seed(0)
    trials, hits, covered = 30, 0, 0
    for _ in range(trials):
        pe = torch.randn(24, generator=g) * 0.6
        c = compare_over_seeds(population(g, pe, 1.0, 0.15, 0.3), population(g, pe, 0.0, 0.15, 0.3),
                               resamples=200)["acceptance_length"]
        hits += c.significant and c.diff.lo > 0
        covered += c.diff.lo <= gap <= c.diff.hi
    assert hits >= 0.9 * trials, hits
    assert covered >= 0.85 * trials, covered


def test_one_seed_is_over_prompts_only_and_mismatches_fail():
    g = torch.Generator().manual_seed(2)
    pe = torch.randn(16, generator=g) * 0.5
    c = compare_over_seeds(population(g, pe, 0.0, 0.1, 0.3, seeds=1),
                           population(g, pe, 0.0, 0.1, 0.3, seeds=1),
                           resamples=200)["acceptance_length"]
    assert (
        c.df > 2
        and c.diff.lo < c.diff.value < c.diff.hi
        and "over prompts only" in c.report("a", "b")[0]
    )
    with pytest.raises(ValueError, match="same seeds"):
        compare_over_seeds([uniform(1)], [uniform(1), uniform(2)])
    with pytest.raises(ValueError, match="same prompts"):
        compare_over_seeds([uniform(1, prompts=8)], [uniform(1, prompts=9)])


def test_tied_prompts_keep_the_pooled_binomial_width():
    """Prompts that tie (budget-exact counting: as many rounds, the same figure) resample to no
    spread. One seed, 6 prompts of 16 rounds, 31 drafts accepted in each under A and 30 under B:
    the difference's interval is t_5 * sqrt of the two settings' pooled-count variances, not the
    zero-width interval that called 0.0625 significant."""
    def tied(accepted: int) -> DecodeStats:
        at = torch.zeros(6, K, dtype=torch.float64)
        at[:, 0], at[:, 1] = 16, accepted - 16
        return stats_of(at, 16)

    c = compare_over_seeds([tied(31)], [tied(30)], resamples=200)["acceptance_length"]
    half = t_quantile(5) * math.sqrt(_pooled_variance(6 * 31, 6 * 16)
                                     + _pooled_variance(6 * 30, 6 * 16))
    assert c.diff.value == pytest.approx(1 / 16)
    assert (c.diff.lo, c.diff.hi) == pytest.approx((1 / 16 - half, 1 / 16 + half))
    assert not c.significant and c.df == pytest.approx(5)
