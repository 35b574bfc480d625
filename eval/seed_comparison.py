"""Two settings compared over training seeds and prompts: which one drafts better, and is the
difference more than noise?

`compare_over_seeds(a, b)` takes, for each of S training seeds, the decode of one fixed prompt set
by a model trained under setting A and one trained under setting B with that seed (`train.seed`),
and returns per figure (acceptance length, draft acceptance rate, per-position rates):

* each seed's figure with its 95% interval over prompts (`acceptance_intervals`);
* the mean over seeds of A, of B and of the paired difference A - B, each with a 95% interval that
  covers both sources of noise: which seeds were trained and which prompts were drawn;
* `significant`: whether the difference's interval excludes 0.

The interval. The mean over seeds m = (1/S) sum_s f_s, f_s a seed's figure on the P prompts, has two
sources of variance, estimated apart and added:

* seeds: the sample variance of the S per-seed figures over S (for the difference, of the per-seed
  differences: the pairing by seed removes what a seed does to both settings alike);
* prompts: the variance of m over a bootstrap over prompts (`acceptance.resample_weights`, the same
  resampler as the per-seed intervals) in which one resample of the prompt indices is applied to
  every seed and to both settings. The prompts are shared, not drawn anew per seed (crossed, not
  nested), so a prompt that is easy for one seed's model is easy for the others': resampling prompts
  within each seed independently would average that away and understate the width. Pairing A and B
  on the same resample removes what a prompt does to both alike. Its floor is the variance of the
  seeds' pooled counts as independent rounds (`acceptance.pooled_binomial_variance`): prompts that
  tie resample to no spread, which would make any gap certain.

Both estimates contain the seed x prompt interaction, so their sum errs wide (conservative). The
interval is m +- t * sqrt(v_seed + v_prompt) with Student's t at the Welch-Satterthwaite degrees of
freedom (v_seed + v_prompt)^2 / (v_seed^2 / (S - 1) + v_prompt^2 / (P - 1)): S - 1 when the seeds
dominate, many when the prompts do. Why not a bootstrap over seeds as well: with 3 seeds a resample
holds at most 3 distinct values, so its percentiles cannot reach past the smallest and largest seed,
and the range of 3 draws covers their mean only 75% of the time (1 - 2 / 2^3); Student's t at 2
degrees of freedom (4.30, not 1.96) is what a 95% interval from 3 draws needs. With one seed the
interval is over prompts alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from .acceptance import (
    INTERVAL_RESAMPLES,
    INTERVAL_SEED,
    acceptance_intervals,
    figure_range,
    pooled_binomial_variance,
    ratio_figures,
    resample_weights,
    row_counts,
    t_quantile,
)
from .spec_decode import DecodeStats


@dataclass(frozen=True)
class Interval:
    """A figure and its 95% interval."""

    value: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


@dataclass(frozen=True)
class SeedComparison:
    """One figure of settings A and B over the same seeds and prompts."""

    key: str
    seeds_a: List[Interval]
    """Each seed's figure under A with its 95% interval over prompts (seed order as given)."""
    seeds_b: List[Interval]
    mean_a: Interval
    """Mean over seeds of A's figure, with its interval over seeds and prompts."""
    mean_b: Interval
    diff: Interval
    """Mean over seeds of A - B (paired by seed and prompt), with its interval over seeds and
    prompts."""
    df: float
    """Degrees of freedom of the difference's t quantile (Welch-Satterthwaite)."""
    num_prompts: int

    @property
    def significant(self) -> bool:
        """The difference's 95% interval excludes 0."""
        return self.diff.lo > 0 or self.diff.hi < 0

    def report(self, name_a: str, name_b: str) -> List[str]:
        """The lines a bench prints: per-seed figures, the means, the difference and its verdict."""
        fmt = ", ".join
        scope = (
            f"{len(self.seeds_a)} seeds x {self.num_prompts} prompts"
            if len(self.seeds_a) > 1
            else f"1 seed x {self.num_prompts} prompts: over prompts only"
        )
        return [f"{self.key}: {name_a} vs {name_b} ({scope})",
                f"  per seed {name_a}: {fmt(str(x) for x in self.seeds_a)}",
                f"  per seed {name_b}: {fmt(str(x) for x in self.seeds_b)}",
                f"  mean {name_a} {self.mean_a}  mean {name_b} {self.mean_b}",
                f"  difference {name_a} - {name_b} = {self.diff}  "
                f"significant={'yes' if self.significant else 'no'}"]


def _interval(value: float, v_seed: float, v_prompt: float, seeds: int, prompts: int,
              level: float, bounds: Tuple[float, float] = (-math.inf, math.inf)) -> tuple:
    """(value +- t * sqrt(v_seed + v_prompt) clipped to `bounds`, t's degrees of freedom):
    Welch-Satterthwaite's."""
    total = v_seed + v_prompt
    parts = (v_seed ** 2 / (seeds - 1) if seeds > 1 else 0.0) + (v_prompt ** 2 / (prompts - 1)
                                                                 if prompts > 1 else 0.0)
    if total <= 0 or parts <= 0:  # no spread at all: the figures are identical however resampled
        return Interval(value, value, value), math.inf
    df = total ** 2 / parts
    half = t_quantile(df, level) * math.sqrt(total)
    return Interval(value, max(bounds[0], value - half), min(bounds[1], value + half)), df


def compare_over_seeds(a: Sequence[DecodeStats], b: Sequence[DecodeStats], level: float = 0.95,
                       resamples: int = INTERVAL_RESAMPLES,
                       seed: int = INTERVAL_SEED) -> Dict[str, SeedComparison]:
    """Setting A against setting B: `a[s]` and `b[s]` are the decodes of the same prompts, in the
    same row order, by the models trained with seed s under each setting. One SeedComparison per
    acceptance figure (`acceptance_metrics`' keys); the method is the module docstring's."""
    if len(a) != len(b) or not a:
        raise ValueError(f"compare_over_seeds needs the same seeds on both sides, got {len(a)} and "
                         f"{len(b)} decodes")
    K = a[0].num_steps
    counts = [torch.stack([row_counts(s) for s in side]) for side in (a, b)]  # 2 x [S, P, 2+K]
    if any(s.num_steps != K for s in (*a, *b)) or counts[0].shape != counts[1].shape:
        raise ValueError("compare_over_seeds: every decode must hold the same prompts (rows) and "
                         "K; got "
                         f"{tuple(counts[0].shape)} and {tuple(counts[1].shape)} (seeds, prompts, "
                         "counts)")
    S, P = counts[0].shape[:2]
    per_seed = [ratio_figures(c.sum(1), K) for c in counts]  # key -> [S]
    # the prompt bootstrap: one resample of prompt indices for every seed and both settings
    boot = [[], []]
    for w in resample_weights(P, resamples, seed):
        for side in (0, 1):
            figs = ratio_figures(torch.einsum("rp,spc->rsc", w, counts[side]), K)  # key -> [r, S]
            boot[side].append({k: v.mean(1) for k, v in figs.items()})
    seed_rows = [[acceptance_intervals(s, resamples, seed) for s in side] for side in (a, b)]

    # each seed's figure as if its rounds were independent trials, the floor of its prompt
    # variance: prompts that tie (budget-exact counting gives prompts with as many rounds the same
    # figure) resample to no spread at all, and a zero-width difference was then "significant"
    floors = [pooled_binomial_variance(c.sum(1), K) for c in counts]  # key -> [S]

    def spread(values: torch.Tensor, resampled: torch.Tensor, floor: torch.Tensor) -> tuple:
        v_seed = float(values.var()) / S if S > 1 else 0.0
        v_prompt = float(resampled.var(unbiased=False)) * P / max(P - 1, 1)
        return v_seed, max(v_prompt, float(floor.sum()) / S ** 2)

    out = {}
    for key in per_seed[0]:
        fa, fb = per_seed[0][key], per_seed[1][key]
        ra, rb = (torch.cat([chunk[key] for chunk in boot[side]]) for side in (0, 1))
        # a mean's interval stays inside the figure's range (a rate near 0 gave a negative bound);
        # the difference's is left whole, since its verdict reads both ends
        va, vb = floors[0][key], floors[1][key]
        mean_a, _ = _interval(float(fa.mean()), *spread(fa, ra, va), S, P, level,
                              figure_range(key, K))
        mean_b, _ = _interval(float(fb.mean()), *spread(fb, rb, vb), S, P, level,
                              figure_range(key, K))
        diff, df = _interval(float((fa - fb).mean()), *spread(fa - fb, ra - rb, va + vb), S, P,
                             level)
        rows = [[Interval(float(f[i]), r[f"{key}_lo95"], r[f"{key}_hi95"]) for i,
                 r in enumerate(side)]
                for f, side in zip((fa, fb), seed_rows)]
        out[key] = SeedComparison(key, rows[0], rows[1], mean_a, mean_b, diff, df, P)
    return out
