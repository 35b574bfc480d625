"""Real speculative decoding against plain autoregressive decoding of the same model on the same
prompts, for the in-loop evaluator, `tandem eval` and the benchmarks.

* `evaluate_decoding`: acceptance (vLLM definitions, each figure with its 95% interval over prompts:
  eval/acceptance.py), decode tokens/s of both sides, measured and predicted speedup
  (`autoregressive=False` decodes the speculative side only: acceptance without speed figures), and
  at temperature 0 whether the speculative tokens equal the autoregressive ones;
* `other_convention_figures`: the other drafting convention's greedy acceptance (`serving` as vLLM's
  proposer, `tandem` as trained; eval/drafting.py) when it differs on this model.

Keys are returned without the `eval/` prefix (the in-loop evaluator adds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from .acceptance import acceptance_metrics
from .drafting import DRAFT_CONVENTIONS, resolve_convention
from .spec_decode import DecodeResult, DecodeStats, StopIds, generate, unwrap


@dataclass(frozen=True)
class DecodeSettings:
    """How every prompt batch is decoded (the `generate` arguments `evaluate_decoding` shares)."""

    num_steps: int
    """K, the drafts per round (the autoregressive side decodes with 0)."""
    max_new_tokens: int
    """Tokens generated per prompt."""
    batch_size: int
    """Prompts decoded together."""
    eos_id: StopIds = None
    """A row stops after this token, or any of these (None: only at max_new_tokens)."""
    temperature: float = 0.0
    """0: greedy; > 0 speculative sampling."""
    top_p: float = 1.0
    """Nucleus threshold when sampling."""
    top_k: int = 0
    """When sampling, only each head's k largest logits (0: all)."""
    seed: int = 0
    """Batch i's sampling generator is seeded with `batch_seed(seed, first_batch + i)`, on both
    sides and any replica."""
    first_batch: int = 0
    """The index of the first batch in its whole prompt set (`tandem generate` decodes the set a
    group of batches at a time): a batch draws the same whichever call decodes it."""
    verify: str = "token"
    """The speculative side's rule for sampled drafts: `token` or `block` (eval/block_verify.py)."""
    draft_convention: str = "serving"
    """How depths 2..K draft: `serving` (vLLM's proposer) or `tandem` (as trained)."""


class Replicas(Protocol):
    """Data-parallel replicas decoding a share of the batches each
    (trainer/parallel/pipeline_decode.py's ParallelDecoding implements it; the evaluator receives it
    from the caller)."""

    def my_batches(self, n_batches: int) -> List[Optional[int]]:
        """Global indices of the batches this replica decodes, None for padding slots."""

    def any_active(self) -> Callable[[bool], bool]:
        """`generate`'s lockstep test: whether any replica still has an active row."""

    def gather(self, results: list) -> list:
        """Every replica's (batch index, result) pairs, in batch order."""


def batch_seed(seed: int, batch: int) -> int:
    """The sampling seed of batch `batch` under the run's `seed`: both mixed by numpy's
    SeedSequence, so no two (seed, batch) pairs share a stream. `seed + batch` gave `--seed 1`'s
    batch b the draws of `--seed 0`'s batch b + 1, and two generate runs that differ only in the
    seed wrote the same samples."""
    mixed = np.random.SeedSequence([int(seed) % 2**64, int(batch)]).generate_state(1, np.uint64)
    return int(mixed[0])


def merge_stats(stats: List[DecodeStats], K: int) -> DecodeStats:
    """One DecodeStats of several decode calls: rows concatenated in order, times and rounds summed
    (a whole prompt set's figures and intervals, e.g. from the per-batch results `evaluate_decoding`
    returns)."""
    merged = DecodeStats(torch.cat([s.rounds for s in stats]),
                         torch.cat([s.accepted for s in stats]),
                         torch.cat([s.accepted_at for s in stats]), K)
    for name in ("draft_s", "verify_s", "overhead_s", "prefill_s", "decode_s", "num_rounds"):
        setattr(merged, name, sum(getattr(s, name) for s in stats))
    if all(s.accepted_all is not None for s in stats):
        merged.accepted_all = torch.cat([s.accepted_all for s in stats])
        merged.accepted_all_at = torch.cat([s.accepted_all_at for s in stats])
    return merged


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def _decode_batches(model, batches: List[list], s: DecodeSettings, replicas: Optional[Replicas],
                    autoregressive: bool, repeat: int) -> Tuple[List[DecodeResult],
                                                                List[DecodeResult]]:
    """One pass over the batches (this replica's share, gathered): (speculative, autoregressive)
    results in batch order. The two sides are interleaved batch by batch, their order alternating,
    so machine noise hits both alike."""
    slots = replicas.my_batches(len(batches)) if replicas is not None else list(range(len(batches)))
    lockstep = {"any_active": replicas.any_active()} if replicas is not None else {}
    device = unwrap(model).embed_tokens.weight.device
    spec, ar = [], []
    for j, i in enumerate(slots):
        batch = batches[i] if i is not None else [[0]]
        order = (0, 1) if (repeat + j) % 2 == 0 else (1, 0)
        res = [None, None]
        for which in order if autoregressive else (0,):
            # the batch's own seed: sampling draws as in one process, whichever replica decodes it
            g = torch.Generator(device=device).manual_seed(batch_seed(s.seed,
                                                                      s.first_batch + (i or 0)))
            res[which] = generate(model, batch, s.max_new_tokens, s.num_steps if which == 0 else 0,
                                  eos_id=s.eos_id,
                                  temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  generator=g,
                                  padding=i is None,
                                  verify=s.verify, draft_convention=s.draft_convention, **lockstep)
        if i is not None:
            spec.append((i, res[0]))
            if autoregressive:
                ar.append((i, res[1]))
    if replicas is not None:
        spec, ar = replicas.gather(spec), replicas.gather(ar)
    return [r for _, r in spec], [r for _, r in ar]


def _occupancy(results: List[DecodeResult]) -> float:
    """The share of a batch's rows that a round advanced, over every round of `results`' batches
    (1 at batch size 1; lower when rows finish at different rounds)."""
    row_rounds = sum(int(r.stats.rounds.sum()) for r in results)
    slots = sum(len(r.stats.rounds) * r.stats.num_rounds for r in results)
    return row_rounds / max(slots, 1)


SPEED_FIGURES = ("decode_tokens_per_s/", "speedup", "time_per_")
"""Prefixes of `_speed_figures`' keys: what only a decode with its autoregressive side gives (the
in-loop evaluator's sampled decodes give acceptance figures alone)."""


def _speed_figures(runs_spec: List[List[DecodeResult]], runs_ar: List[List[DecodeResult]],
                   spec_stats: List[DecodeStats], acceptance_length: float) -> dict:
    """Tokens/s of both sides, measured and predicted speedup and per-round phase times (medians
    over repetitions)."""
    ar_stats = [merge_stats([r.stats for r in run], 0) for run in runs_ar]
    spec_tokens = sum(r.decoded_tokens for r in runs_spec[0])
    ar_tokens = sum(r.decoded_tokens for r in runs_ar[0])
    spec_tps = _median([spec_tokens / max(s.decode_s, 1e-12) for s in spec_stats])
    ar_tps = _median([ar_tokens / max(s.decode_s, 1e-12) for s in ar_stats])
    D = _median([s.draft_s / max(s.num_rounds, 1) for s in spec_stats])
    V = _median([s.verify_s / max(s.num_rounds, 1) for s in spec_stats])
    O = _median([s.overhead_s / max(s.num_rounds, 1) for s in spec_stats])  # noqa: E741 (the paper's symbol)
    T = _median([s.decode_s / max(s.num_rounds, 1) for s in ar_stats])
    # A round yields the acceptance length per row it advances; a batched round also carries rows
    # that have finished, on either side, so each side's tokens per batched round is its occupancy
    # times that.
    occupancy = _occupancy(runs_spec[0]) / max(_occupancy(runs_ar[0]), 1e-12)
    return {
        "decode_tokens_per_s/spec": spec_tps,
        "decode_tokens_per_s/ar": ar_tps,
        "speedup": spec_tps / max(ar_tps, 1e-12),
        "speedup_predicted": acceptance_length * occupancy * T / max(D + V + O, 1e-12),
        "time_per_round/draft_ms": 1e3 * D,
        "time_per_round/verify_ms": 1e3 * V,
        "time_per_round/overhead_ms": 1e3 * O,
        "time_per_token/ar_ms": 1e3 * T,
    }


def evaluate_decoding(model, prompts: Sequence[Sequence[int]], *,
                      replicas: Optional[Replicas] = None,
                      autoregressive: bool = True, warmup: bool = False, repeats: int = 1,
                      **settings):
    """Speculative and autoregressive decoding of `prompts` in batches, as `settings`
    (DecodeSettings' fields) say. Returns (metrics, spec results, AR results) with per-batch
    DecodeResults; with `repeats` > 1 the times are medians over repetitions. `autoregressive=False`
    skips the AR decode (needed only for the speed figures): the metrics are then the acceptance
    figures alone and the AR results an empty list. `warmup` decodes one short prompt both ways
    first.

    `replicas` (trainer/parallel/pipeline_decode.ParallelDecoding) deals the batches to
    data-parallel replicas, keeps them in lockstep and gathers every replica's results before the
    figures are computed (times add up over replicas, so tokens/s is one replica's rate, as in one
    process); None decodes every batch here."""
    s = DecodeSettings(**settings)
    batches = [list(prompts[i : i + s.batch_size]) for i in range(0, len(prompts), s.batch_size)]
    if warmup:
        n = min(4, s.max_new_tokens)
        generate(model, batches[0][:1], n, s.num_steps, eos_id=s.eos_id,
                 draft_convention=s.draft_convention)
        generate(model, batches[0][:1], n, 0, eos_id=s.eos_id)
    runs = [_decode_batches(model, batches, s, replicas, autoregressive, r) for r in range(repeats)]
    runs_spec, runs_ar = [spec for spec, _ in runs], [ar for _, ar in runs]
    # every replica's rows, in batch order: the figures and their bootstrap intervals equal one
    # process's
    spec_stats = [merge_stats([r.stats for r in run], s.num_steps) for run in runs_spec]
    metrics = acceptance_metrics(spec_stats[0])
    if not autoregressive:
        return metrics, runs_spec[0], []
    metrics.update(_speed_figures(runs_spec, runs_ar, spec_stats, metrics["acceptance_length"]))
    if s.temperature <= 0:
        metrics["identical_to_autoregressive"] = all(
            sp.outputs == a.outputs for sp, a in zip(runs_spec[0], runs_ar[0]))
    return metrics, runs_spec[0], runs_ar[0]


def other_convention(model, num_steps: int, convention: str) -> Optional[str]:
    """The drafting convention besides `convention` when it drafts differently on this model (None
    when both resolve alike, e.g. the parallel style, or the other cannot run here)."""
    other = next(c for c in DRAFT_CONVENTIONS if c != convention)
    try:
        mine = resolve_convention(unwrap(model), convention, num_steps)
        theirs = resolve_convention(unwrap(model), other, num_steps)
    except ValueError:
        return None
    return other if num_steps > 0 and mine != theirs else None


def other_convention_figures(model, prompts: Sequence[Sequence[int]], metrics: dict, *,
                             replicas: Optional[Replicas] = None, **settings) -> dict:
    """`<other>/acceptance_length` (`tandem/...` or `serving/...`, with its interval) of a greedy
    decode of `prompts` under the other drafting convention than `settings`' (speculative side
    only), when it differs from `metrics["acceptance_length"]` (this convention's): what each
    convention gives on this model. Empty when sampling, or when the conventions draft alike
    here."""
    s = DecodeSettings(**settings)
    other = other_convention(model, s.num_steps, s.draft_convention)
    if other is None or s.temperature > 0:
        return {}
    alt_settings = dataclasses.asdict(dataclasses.replace(s, draft_convention=other,
                                                          temperature=0.0, top_p=1.0))
    alt, _, _ = evaluate_decoding(model, prompts, replicas=replicas, autoregressive=False,
                                  **alt_settings)
    if alt["acceptance_length"] == metrics["acceptance_length"]:
        return {}
    return {f"{other}/{k}": alt[k] for k in alt if k.startswith("acceptance_length")}
