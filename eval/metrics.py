"""Evaluation metrics shared by the in-loop evaluator, `tandem eval` and the benchmark.

* `teacher_forced`: per-depth validation loss and top-1 accuracy of a training-style forward (true
  tokens fed to every MTP depth; Megatron logs this accuracy as its "acceptance rate");
* `evaluate_decoding`: real speculative decoding vs plain autoregressive decoding of the same model on
  the same prompts: acceptance (vLLM definitions), decode tokens/s of both, measured and predicted
  speedup (`autoregressive=False` decodes the speculative side only: acceptance without speed figures),
  drafting under `draft_convention` (`serving` as vLLM's proposer, `tandem` as trained) and, with
  `compare_conventions`, the other convention's greedy acceptance when it differs; every acceptance
  figure comes with its 95% interval over prompts (`<key>_lo95`, `<key>_hi95`, spec_decode's
  `acceptance_intervals`), the speed figures without one;
* `distinct_n`: the repetition figure of decoded text (unique / total n-grams, mean over prompts);
* `temperature_label`: the variant segment of a sampled temperature's keys (`T1`, `T0.7`).

Keys are returned without the `eval/` prefix (the in-loop evaluator adds it).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tandem.models.loss import chunked_argmax
from tandem.models.model import window_documents, window_positions
from tandem.models.mtp import depth_target_mask, shifted_tokens

from .draft_serving import DRAFT_CONVENTIONS, resolve_convention
from .spec_decode import DecodeResult, DecodeStats, acceptance_metrics, generate, unwrap


@contextlib.contextmanager
def _head_inputs(head):
    """Inside, `model.logits(depth, h)` returns the head's input (depth's final-normed state, [n x hidden])
    instead of [n x vocab] logits: the model (or a pipeline's driver view, which runs a depth's norm on
    the rank holding it) keeps deciding where each norm runs, and the head then runs chunk by chunk."""
    head.logits = lambda h_normed: h_normed  # an instance attribute shadows the method
    try:
        yield
    finally:
        del head.logits


def _head_argmax(head, h_nh: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Top-1 token of the output head per row, one [chunk x vocab] slice of logits at a time. A
    vocab-parallel head (trainer/parallel/tensor.py: `weight` a Shard(0) DTensor over `tp_mesh`) keeps
    its vocabulary shard: each chunk's largest logit is all-reduced over tp, then the smallest vocab id
    reaching it, which is the first index argmax over the gathered vocabulary picks."""
    tp_mesh = getattr(head, "tp_mesh", None)
    if tp_mesh is None:
        return chunked_argmax(h_nh, head.weight, chunk_tokens)
    w = head.weight.to_local()
    group, start = tp_mesh.get_group(), tp_mesh.get_local_rank() * w.shape[0]
    out = torch.empty(h_nh.shape[0], dtype=torch.long, device=h_nh.device)
    for i in range(0, h_nh.shape[0], chunk_tokens):
        best, idx = F.linear(h_nh[i : i + chunk_tokens], w).float().max(dim=-1)
        top = best.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        first = torch.where(best == top, idx + start, torch.full_like(idx, torch.iinfo(torch.long).max))
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        out[i : i + chunk_tokens] = first
    return out


@torch.no_grad()
def teacher_forced(model, batches: Iterable[Dict[str, torch.Tensor]], device=None,
                   document_mask: bool = False) -> Dict[str, float]:
    """Mean cross-entropy (`loss/main`, `loss/mtp_k`) and top-1 accuracy (`tf_acc/mtp_k`) per depth,
    from the same hidden states the training forward computes (`TandemModel.depth_states`; packed
    documents kept apart with `document_mask`, as data.document_mask trains). The head runs
    `mtp.loss_chunk_tokens` rows at a time, as the training loss does (vocab-parallel under TP), so no
    [tokens x vocab] logits exist, nor a gathered vocabulary."""
    m = unwrap(model)
    depths = m.num_depths
    head, chunk = m.lm_head, m.mtp_cfg.loss_chunk_tokens
    loss = torch.zeros(depths, dtype=torch.float64)
    correct = torch.zeros(depths, dtype=torch.float64)
    count = torch.zeros(depths, dtype=torch.float64)
    for batch in batches:
        tokens = batch["tokens"].to(device) if device is not None else batch["tokens"]
        b, s1 = tokens.shape
        s = s1 - 1
        loss_mask = batch.get("loss_mask")
        loss_mask = torch.ones(b, s) if loss_mask is None else loss_mask
        loss_mask = loss_mask.to(tokens.device)
        doc_ids = batch.get("doc_ids")
        doc_ids = doc_ids.to(tokens.device) if doc_ids is not None else None
        docs = window_documents(doc_ids, s) if document_mask else None
        pos = window_positions(docs, b, s, tokens.device)
        extra = {} if docs is None else {"documents": docs}
        for d, h in m.depth_states(m.trunk(tokens[:, :s], pos, **extra), tokens, pos, **extra):
            mask = depth_target_mask(loss_mask, doc_ids, d)
            if not bool(mask.any()):
                continue
            with _head_inputs(head):
                normed = m.logits(d, h[mask])
            targets = shifted_tokens(tokens, d + 1, s)[mask]
            loss[d] += float(head.loss_sums(normed[None], targets[None], chunk)[0])
            correct[d] += float((_head_argmax(head, normed, chunk) == targets).sum())
            count[d] += float(mask.sum())
    out = {"loss/main": float(loss[0] / count[0].clamp(min=1))}
    for d in range(1, depths):
        out[f"loss/mtp_{d}"] = float(loss[d] / count[d].clamp(min=1))
    for d in range(1, depths):
        out[f"tf_acc/mtp_{d}"] = float(correct[d] / count[d].clamp(min=1))
    return out


def distinct_n(outputs: Sequence[Sequence[int]], n: int) -> Optional[float]:
    """Mean over continuations of (distinct n-grams / total n-grams) of each one's token ids: 1.0 when
    no n-gram repeats, near 1/len when the text loops on one token. Continuations shorter than n have
    no n-gram and are left out of the mean; None when none has one."""
    ratios = []
    for out in outputs:
        grams = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else None


def temperature_label(t: float) -> str:
    """`T<t>` with t as Python's shortest general format writes it: 1.0 -> `T1`, 0.7 -> `T0.7`."""
    return f"T{float(t):g}"


def _merge_stats(stats: List[DecodeStats], K: int) -> DecodeStats:
    merged = DecodeStats(torch.cat([s.rounds for s in stats]), torch.cat([s.accepted for s in stats]),
                         torch.cat([s.accepted_at for s in stats]), K)
    for name in ("draft_s", "verify_s", "overhead_s", "prefill_s", "decode_s", "num_rounds"):
        setattr(merged, name, sum(getattr(s, name) for s in stats))
    if all(s.accepted_all is not None for s in stats):
        merged.accepted_all = torch.cat([s.accepted_all for s in stats])
        merged.accepted_all_at = torch.cat([s.accepted_all_at for s in stats])
    return merged


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


def evaluate_decoding(model, prompts: Sequence[Sequence[int]], *, num_steps: int, max_new_tokens: int,
                      batch_size: int, eos_id: Optional[int] = None, temperature: float = 0.0, top_p: float = 1.0,
                      seed: int = 0, warmup: bool = False, repeats: int = 1, replicas=None,
                      autoregressive: bool = True, verify: str = "token", draft_convention: str = "serving",
                      compare_conventions: bool = False):
    """Speculative and autoregressive decoding of `prompts` (batches of `batch_size`, the two
    interleaved batch by batch so machine noise hits both alike). Returns (metrics, spec results, AR
    results) with per-batch DecodeResults; with `repeats` > 1 the times are medians over repetitions.

    `autoregressive=False` skips the AR decode (needed only for the speed figures): the metrics are
    then the acceptance figures alone and the AR results an empty list. Batch i's sampling generator
    is seeded with `seed + i` either way, so the speculative side draws the same tokens. `verify` is the
    speculative side's rule for sampled drafts (`token` or `block`, eval/block_verify.py).
    `draft_convention` is how depths 2..K draft (eval/draft_serving.py: `serving`, vLLM's proposer,
    or `tandem`, as trained). `compare_conventions=True` (greedy only) decodes the speculative side
    once more under the other convention and adds `<other>/acceptance_length` (`tandem/...`,
    `serving/...`) when it differs from this one's: what each convention gives on this model.

    `replicas` (trainer/parallel/pipeline_decode.ParallelDecoding) deals the batches to data-parallel
    replicas, keeps them in lockstep and gathers every replica's results before the figures are
    computed (times add up over replicas, so tokens/s is one replica's rate, as in one process);
    None decodes every batch here."""
    K = num_steps
    batches = [list(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
    slots = replicas.my_batches(len(batches)) if replicas is not None else list(range(len(batches)))
    lockstep = {"any_active": replicas.any_active()} if replicas is not None else {}
    device = unwrap(model).embed_tokens.weight.device
    if warmup:
        generate(model, batches[0][:1], min(4, max_new_tokens), K, eos_id=eos_id, draft_convention=draft_convention)
        generate(model, batches[0][:1], min(4, max_new_tokens), 0, eos_id=eos_id)
    runs_spec: List[List[DecodeResult]] = []
    runs_ar: List[List[DecodeResult]] = []
    for r in range(repeats):
        spec, ar = [], []
        for j, i in enumerate(slots):
            # the batch's own seed: sampling draws as in one process, whichever replica decodes it
            g_s = torch.Generator(device=device).manual_seed(seed + (i or 0))
            g_a = torch.Generator(device=device).manual_seed(seed + (i or 0))
            batch = batches[i] if i is not None else [[0]]
            first, second = (0, 1) if (r + j) % 2 == 0 else (1, 0)
            res = [None, None]
            for which in (first, second) if autoregressive else (0,):
                res[which] = generate(model, batch, max_new_tokens, K if which == 0 else 0, eos_id=eos_id,
                                      temperature=temperature, top_p=top_p, generator=g_s if which == 0 else g_a,
                                      padding=i is None, verify=verify, draft_convention=draft_convention,
                                      **lockstep)
            if i is not None:
                spec.append((i, res[0]))
                if autoregressive:
                    ar.append((i, res[1]))
        if replicas is not None:
            spec, ar = replicas.gather(spec), replicas.gather(ar)
        runs_spec.append([res for _, res in spec])
        runs_ar.append([res for _, res in ar])

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])

    # every replica's rows, in batch order: the figures and their bootstrap intervals equal one process's
    spec_stats = [_merge_stats([r.stats for r in run], K) for run in runs_spec]
    metrics = acceptance_metrics(spec_stats[0])
    other = other_convention(model, K, draft_convention) if compare_conventions and temperature <= 0 else None
    if other is not None:
        alt, _, _ = evaluate_decoding(model, prompts, num_steps=K, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                      eos_id=eos_id, seed=seed, replicas=replicas, autoregressive=False,
                                      verify=verify, draft_convention=other)
        if alt["acceptance_length"] != metrics["acceptance_length"]:
            metrics.update({f"{other}/{k}": alt[k] for k in alt if k.startswith("acceptance_length")})
    if not autoregressive:
        return metrics, runs_spec[0], []
    ar_stats = [_merge_stats([r.stats for r in run], 0) for run in runs_ar]
    spec_tokens = sum(r.decoded_tokens for r in runs_spec[0])
    ar_tokens = sum(r.decoded_tokens for r in runs_ar[0])
    spec_tps = median([spec_tokens / max(s.decode_s, 1e-12) for s in spec_stats])
    ar_tps = median([ar_tokens / max(s.decode_s, 1e-12) for s in ar_stats])
    D = median([s.draft_s / max(s.num_rounds, 1) for s in spec_stats])
    V = median([s.verify_s / max(s.num_rounds, 1) for s in spec_stats])
    O = median([s.overhead_s / max(s.num_rounds, 1) for s in spec_stats])
    T = median([s.decode_s / max(s.num_rounds, 1) for s in ar_stats])
    # Batched rounds advance every row; the tokens a round yields per row is the acceptance length.
    A = metrics["acceptance_length"]
    metrics.update({
        "decode_tokens_per_s/spec": spec_tps,
        "decode_tokens_per_s/ar": ar_tps,
        "speedup": spec_tps / max(ar_tps, 1e-12),
        "speedup_predicted": A * T / max(D + V + O, 1e-12),
        "time_per_round/draft_ms": 1e3 * D,
        "time_per_round/verify_ms": 1e3 * V,
        "time_per_round/overhead_ms": 1e3 * O,
        "time_per_token/ar_ms": 1e3 * T,
    })
    if temperature <= 0:
        metrics["identical_to_autoregressive"] = all(
            s.outputs == a.outputs for s, a in zip(runs_spec[0], runs_ar[0]))
    return metrics, runs_spec[0], runs_ar[0]
