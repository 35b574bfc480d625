"""Evaluation metrics shared by the in-loop evaluator, `tandem eval` and the benchmark (the decoding
figures are eval/decode_eval.py's and eval/acceptance.py's).

* `teacher_forced`: per-depth validation loss and top-1 accuracy of a training-style forward (true
  tokens fed to every MTP depth; Megatron logs this accuracy as its "acceptance rate");
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

from tandem.data_pipeline.batches import get_batch
from tandem.models.loss import chunked_argmax
from tandem.models.model import window_documents, window_positions
from tandem.models.mtp import depth_target_mask, shifted_tokens

from .recall import RecallProbe
from .spec_decode import unwrap


@contextlib.contextmanager
def _head_inputs(head):
    """Inside, `model.logits(depth, h)` returns the head's input (depth's final-normed state, [n x
    hidden]) instead of [n x vocab] logits: the model (or a pipeline's driver view, which runs a
    depth's norm on the rank holding it) keeps deciding where each norm runs, and the head then runs
    chunk by chunk."""
    head.logits = lambda h_normed: h_normed  # an instance attribute shadows the method
    try:
        yield
    finally:
        del head.logits


def _head_argmax(head, h_nh: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Top-1 token of the output head per row, one [chunk x vocab] slice of logits at a time. A
    vocab-parallel head (trainer/parallel/tensor.py: `weight` a Shard(0) DTensor over `tp_mesh`)
    keeps its vocabulary shard: each chunk's largest logit is all-reduced over tp, then the smallest
    vocab id reaching it, which is the first index argmax over the gathered vocabulary picks."""
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
        first = torch.where(best == top, idx + start,
                            torch.full_like(idx, torch.iinfo(torch.long).max))
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
        out[i : i + chunk_tokens] = first
    return out


def depth_loss_key(depth: int) -> str:
    """The key of depth `depth`'s loss: `loss/main` for the trunk's head, `loss/mtp_k` after it."""
    return "loss/main" if depth == 0 else f"loss/mtp_{depth}"


@torch.no_grad()
def teacher_forced(model, batches: Iterable[Dict[str, torch.Tensor]], device=None,
                   document_mask: bool = False, measure_recall: bool = False) -> Dict[str, float]:
    """Mean cross-entropy (`loss/main`, `loss/mtp_k`) and top-1 accuracy (`tf_acc/mtp_k`) per depth,
    from the same hidden states the training forward computes (`TandemModel.depth_states`; packed
    documents kept apart with `document_mask`, as data.document_mask trains). The head runs
    `mtp.loss_chunk_tokens` rows at a time, as the training loss does (vocab-parallel under TP), so
    no [tokens x vocab] logits exist, nor a gathered vocabulary. A depth with no target in the
    batches (windows shorter than depth + 2 tokens: `tandem eval`'s short prompts) has no key: 0.0
    would read as a perfect loss. `measure_recall` (the evaluators'): also `qsa_recall`, QSA's
    recall over these forwards (eval/recall.py), when the model has QSA layers.

    In a training layout with its sequence splitting on (sequence and context parallelism), each
    rank computes its rows of every window, as a training forward does, and the sums are taken over
    the ranks splitting the window (`model.context`): every rank of the window returns the same
    figures, and no rank holds a whole window's activations (the 256k stage's windows are 32 ranks'
    worth)."""
    if not measure_recall:
        return _teacher_forced(model, batches, device, document_mask)
    with RecallProbe(model) as recall:
        out = _teacher_forced(model, batches, device, document_mask)
    value = recall.value()
    if value is not None:
        context = unwrap(model).context
        if context.sharded:  # each rank's mean over its equal share of rows
            value = float(_window_sum(context, torch.tensor([value]), _device(model)) /
                          context.size)
        out["qsa_recall"] = value
    return out


def _window_sum(context, x: torch.Tensor, device) -> torch.Tensor:
    """`x` (host, fp64) summed over the ranks splitting the window, in fp32 on `device`
    (accelerators such as Ascend 910 have no fp64)."""
    return context.sum(x.float().to(device)).cpu().double()


def _device(model) -> torch.device:
    return next(unwrap(model).parameters()).device


def _teacher_forced(model, batches, device, document_mask: bool) -> Dict[str, float]:
    m = unwrap(model)
    depths = m.num_depths
    head, chunk = m.lm_head, m.mtp_cfg.loss_chunk_tokens
    # the window's rows this rank computes (all, but under context parallelism its chunks), and the
    # hidden states' sequence layout (whole, but under sequence parallelism a tp rank's shard); a
    # pipeline's driver view reads its base model's, switched to whole windows by the decoding
    # context it runs in
    context, whole = m.context, m.sequence.whole
    local = context.local
    # [depth, (loss, correct, count)], summed over the window's ranks at the end
    totals = torch.zeros(depths, 3, dtype=torch.float64)
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
        pos = local(window_positions(docs, b, s, tokens.device))
        extra = {} if docs is None else {"documents": docs.local(context)}
        h0 = m.trunk(local(tokens[:, :s]), pos, **extra)
        for d, h in m.depth_states(h0, tokens, pos, **extra):
            mask = local(depth_target_mask(loss_mask, doc_ids, d))
            if not bool(mask.any()):
                continue
            with _head_inputs(head):
                normed = m.logits(d, whole(h)[mask])
            targets = local(shifted_tokens(tokens, d + 1, s))[mask]
            totals[d, 0] += float(head.loss_sums(normed[None], targets[None], chunk)[0])
            totals[d, 1] += float((_head_argmax(head, normed, chunk) == targets).sum())
            totals[d, 2] += float(mask.sum())
    if context.sharded:
        totals = _window_sum(context, totals, _device(m))
    loss, correct, count = totals.unbind(1)
    measured = [d for d in range(depths) if count[d] > 0]
    out = {depth_loss_key(d): float(loss[d] / count[d]) for d in measured}
    out.update({f"tf_acc/mtp_{d}": float(correct[d] / count[d]) for d in measured if d > 0})
    return out


DISTINCT_N = (2, 4)
"""n-gram orders of the `distinct_n` repetition figures."""


def distinct_figures(outputs: Sequence[Sequence[int]]) -> dict:
    """`distinct_<n>` for each DISTINCT_N order that some continuation is long enough for."""
    values = {f"distinct_{n}": distinct_n(outputs, n) for n in DISTINCT_N}
    return {k: v for k, v in values.items() if v is not None}


def distinct_n(outputs: Sequence[Sequence[int]], n: int) -> Optional[float]:
    """Mean over continuations of (distinct n-grams / total n-grams) of each one's token ids: 1.0
    when no n-gram repeats, near 1/len when the text loops on one token. Continuations shorter than
    n have no n-gram and are left out of the mean; None when none has one."""
    ratios = []
    for out in outputs:
        grams = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
        if grams:
            ratios.append(len(set(grams)) / len(grams))
    return sum(ratios) / len(ratios) if ratios else None


def temperature_label(t: float) -> str:
    """`T<t>` with t as Python's shortest general format writes it: 1.0 -> `T1`, 0.7 -> `T0.7`."""
    return f"T{float(t):g}"


def logged_figures(figures: dict, temperature: float = 0.0, verify: str = "",
                   run_verify: str = "") -> dict:
    """One decoding's figures under the names the in-loop evaluator logs them (metrics.jsonl's, the
    contract's): `eval/` then, when sampling, `T<t>/` and, for a rule other than the run's
    eval.verify, `<rule>/`; each a float, the per-round timings left out."""
    prefix = "" if temperature == 0 else f"{temperature_label(temperature)}/" + (
        "" if verify == run_verify else f"{verify}/")
    return {f"eval/{prefix}{k}": float(v) for k, v in figures.items()
            if not k.startswith("time_per_")}


def validation_inputs(valid_ds, num_prompts: int, prompt_len: int, loss_batches: int,
                      micro_batch: int, document_mask: bool, eod_id: Optional[int] = None) -> tuple:
    """(prompts, teacher-forced batches, note) from a validation split, for the in-loop evaluator
    and `tandem eval` alike. A split of chat records (`data.source=jsonl`) gives each record's
    prompt, its last `prompt_len` tokens (a record of plain text: its first), one per record (its
    record_prompts): its windows start mid-record, and the last ones hold nothing but a response,
    which a self-distilled drafter continues at a high acceptance. Any other split: each prompt is
    the first `prompt_len` tokens of a window, without the `eod_id` tokens that end them (a
    document's own end, a packed split's padding); with `document_mask` only the last document
    left (the decoder reads a prompt as one sequence, which training never did across a
    document's start). A window with nothing left gives no prompt. A split shorter than what is
    asked for gives each window (or record) once (a window read twice counted twice, and narrowed
    the intervals over prompts): `note` says so, else it is ''."""
    n = len(valid_ds)
    records = getattr(valid_ds, "record_prompts", None)  # chat records (data_pipeline/chat_dataset)
    if records is not None:  # a chat prompt's last prompt_len tokens (as a suite's), a text's first
        prompts = [(p[-prompt_len:] if chat else p[:prompt_len]).tolist()
                   for p, chat in records[:num_prompts] if len(p)]
    else:
        prompts = _window_prompts(valid_ds, min(num_prompts, n), prompt_len, document_mask, eod_id)
    pool, unit = (len(records), "records") if records is not None else (n, "windows")
    count = min(loss_batches, -(-n // micro_batch))
    batches = [get_batch(valid_ds, list(range(i * micro_batch, min((i + 1) * micro_batch, n))))
               for i in range(count)]
    capped = [f"{len(prompts)} prompts of eval.num_prompts={num_prompts}"] * (num_prompts > pool)
    capped += [f"{count} loss batches of eval.loss_batches={loss_batches}"] * (count < loss_batches)
    note = (f"the validation split holds {pool} {unit}: {' and '.join(capped)}, each "
            f"{unit[:-1]} once" if capped else "")
    return prompts, batches, note


def _window_prompts(valid_ds, count: int, prompt_len: int, document_mask: bool,
                    eod_id: Optional[int]) -> List[List[int]]:
    """The first `prompt_len` tokens of the first `count` windows (validation_inputs)."""
    rows = get_batch(valid_ds, list(range(count)))
    prompts = []
    for tokens, docs in zip(rows["tokens"][:, :prompt_len], rows["doc_ids"][:, :prompt_len]):
        if eod_id is not None:
            text = (tokens != eod_id).nonzero()
            end = int(text[-1]) + 1 if len(text) else 0
            tokens, docs = tokens[:end], docs[:end]
        if not len(tokens):
            continue
        keep = docs == docs[-1] if document_mask else torch.ones_like(docs, dtype=torch.bool)
        prompts.append(tokens[keep].tolist())
    return prompts
