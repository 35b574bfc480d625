"""The evaluator the training loop calls every `eval.interval` steps.

It runs real speculative decoding (and plain autoregressive decoding for the speed comparison) on a
fixed set of held-out prompts (the first `eval.prompt_len` tokens of the first `eval.num_prompts`
samples of the validation split -- never the training split: `valid_ds` is build_datasets' held-out
split, the stdlib corpus's `test/` files or the megatron blend's validation share /
`data.valid_paths`) plus teacher-forced losses/accuracies on validation micro-batches, and returns
`eval/*` metrics. With `eval.suite` set the decoded prompts are a public prompt set's instead
(eval/suites.py: spread over the suite, `eval.num_prompts` of each), read offline from an installed
package:

* greedy decoding (always): `acceptance_length`, `accept_rate/pos_k`, `draft_acceptance_rate`, the
  speed figures, and `distinct_2` / `distinct_4` of the greedy continuations (metrics.distinct_n: a
  continuation that loops scores low, and a looping continuation is easy to draft, so a high
  acceptance length means little without it); drafts are made under `eval.draft_convention`
  (`serving`, the default: as vLLM's MTP proposer drafts, so the figure is the served one;
  `tandem`: as the module was trained), and when the other convention's greedy acceptance differs
  it is logged too, as `<other>/acceptance_length` (`eval/tandem/acceptance_length`), one more
  speculative decode;
* each temperature T of `eval.temperatures`: speculative sampling of the same prompts, logged under
  `eval/T<t>/` (metrics.temperature_label) with the configured verification rule (`eval.verify`),
  and once more with the other rule under `eval/T<t>/<rule>/` (`eval/T1/block/acceptance_length`
  when the configured rule is `token`), so the run shows what block verification buys on this model.
  Only the speculative side is decoded (AR decoding is needed for the speed figures alone, which the
  greedy run gives), so each T costs two decodes. Greedy decoding is the same under both rules.

Every acceptance figure above, under each of these prefixes, is logged with its 95% interval beside
it (`eval/acceptance_length_lo95`, `eval/T1/accept_rate/pos_2_hi95`): a bootstrap over the prompts
(acceptance.acceptance_intervals), since with `eval.num_prompts` prompts a change in acceptance
between two evaluations may be noise.

`last_samples` holds the first `eval.num_samples_logged` prompts' decoded text and acceptance (the
training loop hands them to MetricsLogger.log_samples).

Evaluation never changes training: it runs under no_grad/inference mode in eval mode (the previous
mode is restored), forks the global RNG (sampling draws from its own seeded generator), and restores
the routers' `tokens_per_expert` load counters (any forward increments them, and the aux-free bias
update of the next step reads them).

Parallel layouts: the caller passes a `LayoutDecoding` (the trainer builds
trainer/parallel/pipeline_decode.py's ParallelDecoding; None in one process). Under pipeline
parallelism each stage keeps the KV caches of its layers and the rank holding the head and the MTP
module drives the decoder, passing hidden states stage to stage; the prompt batches are dealt to the
data-parallel replicas (dp x ep) and the results gathered, so every figure equals one process's;
under sequence parallelism decode steps run the TP regions on whole sequences. The figures reach
every rank; rank 0 logs them. `eval/seconds` is the wall time of one evaluation (decoding both ways
plus the teacher-forced losses).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, ContextManager, Dict, List, Optional, Protocol

import torch

from tandem.data_pipeline.chat_template import chat_template_in

from .acceptance import row_metrics
from .block_verify import VERIFY_RULES
from .decode_eval import Replicas, evaluate_decoding, other_convention_figures
from .metrics import (
    distinct_figures,
    logged_figures,
    teacher_forced,
    temperature_label,
    validation_inputs,
)
from .spec_decode import prompt_limit, unwrap
from .suites import load_suites, tokenize_suite


class LayoutDecoding(Replicas, Protocol):
    """What the evaluator needs to decode on this rank's part of a parallel layout."""

    is_driver: bool
    """Whether this rank drives the decoder (it holds the output head); the others `follow`."""
    forces_in_layout: bool
    """Whether every rank runs the teacher-forced pass itself, in the training layout (sequence and
    context shards kept, before `context()`): no rank then holds a whole window's activations.
    False (a pipeline, whose stages answer the driver's forwards): the driver runs it on whole
    windows inside `context()`."""
    model: Any
    """The driver's view of the model (the decoder and `teacher_forced` take it as the model)."""

    def context(self) -> ContextManager:
        """Around an evaluation: whole-sequence TP regions, FSDP roots' parameters gathered."""

    def teacher_forcing(self) -> ContextManager:
        """Around the teacher-forced pass when `forces_in_layout`: FSDP roots' parameters
        gathered, the sequence splitting kept."""

    def stop(self) -> None:
        """Driver: the followers' `follow` returns."""

    def follow(self) -> None:
        """Follower: run this rank's part of every forward the driver announces, until it stops."""

    def share(self, out: Optional[dict]) -> dict:
        """The driver's figures on every rank."""


class InLoopEvaluator:
    """`run(step)`: the eval/* figures of the model now. `decoding`: the layout's LayoutDecoding,
    None in one process."""

    def __init__(self, cfg, model, valid_ds, tokenizer, pstate,
                 decoding: Optional[LayoutDecoding] = None,
                 stop_ids: Optional[List[int]] = None):
        self.cfg, self.model, self.valid_ds, self.tokenizer, self.pstate = (
            cfg,
            model,
            valid_ds,
            tokenizer,
            pstate,
        )
        if decoding is None and pstate.world_size > 1:
            raise ValueError("InLoopEvaluator on several processes needs the layout's decoding "
                             "(trainer/parallel/pipeline_decode.parallel_decoding)")
        e = cfg.eval
        self.num_steps = e.num_steps or cfg.mtp.num_steps
        # the ids that end a response (the trainer's: the tokenizer's EOS and the source model's
        # generation_config.json ones, as `tandem generate` / `tandem eval` stop)
        self.eos_id = stop_ids if stop_ids is not None else getattr(tokenizer, "eod_id", None)
        self._warned = False
        self.decoding = decoding
        self.last_samples: List[dict] = []
        self.prompts: List[List[int]] = []
        self.loss_batches: List[Dict[str, torch.Tensor]] = []
        if valid_ds is not None:
            self.prompts, self.loss_batches, note = validation_inputs(
                valid_ds, e.num_prompts, max(1, min(e.prompt_len, cfg.data.seq_len)),
                e.loss_batches, cfg.train.micro_batch_size, cfg.data.document_mask,
                getattr(tokenizer, "eod_id", None))
            if note and pstate.is_main:
                print(f"eval: {note}", file=sys.stderr)
        whole = decoding is not None and not decoding.forces_in_layout and cfg.parallel.cp > 1
        if whole and self.loss_batches and pstate.is_main:  # (`--check` sizes training only)
            print(f"eval: under pp x cp the teacher-forced windows run whole: a forward of "
                  f"{len(self.loss_batches)} x {cfg.train.micro_batch_size} windows of "
                  f"data.seq_len={cfg.data.seq_len} tokens on each driver rank per evaluation, "
                  "cp times a training forward's rows; eval.loss_batches=0 leaves them out",
                  file=sys.stderr)
        if getattr(e, "suite", ""):
            self.prompts = self._suite_prompts(cfg, tokenizer)

    def _suite_prompts(self, cfg, tokenizer) -> List[List[int]]:
        """`eval.num_prompts` prompts spread over each suite of `eval.suite` (eval/suites.py), each
        cut to the decoder's room (its last tokens: the text the continuation follows). Public
        prompt sets put the in-loop figure on the scale papers report; the teacher-forced losses
        stay held-out."""
        e = cfg.eval
        if tokenizer is None:
            raise ValueError(f"eval.suite={e.suite!r} needs the run's tokenizer")
        tok = cfg.data.tokenizer or ""
        chat = chat_template_in([tok if os.path.isdir(tok) else os.path.dirname(tok),
                                 cfg.model.init_from or ""])
        limit = prompt_limit(cfg.model.max_seq_len, e.max_new_tokens, self.num_steps)
        prompts, _ = tokenize_suite(load_suites(e.suite, e.num_prompts), tokenizer, chat, limit)
        return prompts

    def _say_once(self, message: str) -> None:
        if not self._warned and self.pstate.is_main:
            print(message, file=sys.stderr)
        self._warned = True

    def run(self, step: int) -> Dict[str, float]:
        if not self.prompts:
            self._say_once("eval: no validation split (data gives validation no samples); "
                           "evaluator skipped")
            return {}
        t0 = time.perf_counter()
        model, d = self.model, self.decoding
        device = self.pstate.device.device
        routers = [m.router for m in unwrap(model).moe_layers()] if hasattr(unwrap(model),
                                                                            "moe_layers") else []
        saved_loads = [r.tokens_per_expert.clone() for r in routers]
        was_training = model.training
        devices = [] if device.type == "cpu" else [device]
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
                model.eval()
                forced = None
                if d is None or d.forces_in_layout:
                    with d.teacher_forcing() if d is not None else contextlib.nullcontext():
                        forced = self._teacher_forced(model)
                with d.context() if d is not None else contextlib.nullcontext():
                    out = None
                    if d is None or d.is_driver:
                        out = self._evaluate(d.model if d is not None else model, forced)
                        if d is not None:
                            d.stop()
                    else:
                        d.follow()
                    if d is not None:
                        out = d.share(out)
        finally:
            model.train(was_training)
            with torch.no_grad():
                for r, saved in zip(routers, saved_loads):
                    r.tokens_per_expert.copy_(saved)
        self.last_outputs = out.pop("outputs")  # the speculative greedy tokens (tests compare them)
        self.last_samples = [{"step": step, **self._texts(r)} for r in out.pop("samples")]
        return {**logged_figures(out), "eval/seconds": time.perf_counter() - t0}

    def _teacher_forced(self, m) -> dict:
        return teacher_forced(m, self.loss_batches, self.pstate.device.device,
                              self.cfg.data.document_mask, measure_recall=True)

    def _evaluate(self, m, forced: Optional[dict] = None) -> dict:
        """The driver's figures on model (view) `m`: teacher-forced losses (`forced` when every
        rank computed them already), greedy decoding both ways, then each sampled temperature; plus
        the greedy `outputs` and the logged `samples`."""
        e, d = self.cfg.eval, self.decoding
        out = dict(forced) if forced is not None else self._teacher_forced(m)
        common = dict(num_steps=self.num_steps, max_new_tokens=e.max_new_tokens,
                      batch_size=e.batch_size,
                      eos_id=self.eos_id, seed=self.cfg.train.seed,
                      draft_convention=e.draft_convention)
        dec, spec, _ = evaluate_decoding(m, self.prompts, replicas=d, temperature=0.0, **common)
        out.update(dec)
        out.update(other_convention_figures(m, self.prompts, dec, replicas=d, temperature=0.0,
                                            **common))
        greedy = [o for r in spec for o in r.outputs]
        out.update(distinct_figures(greedy))
        variants = [("", spec)] + self._sampled(m, common, out)
        out["outputs"] = greedy
        out["samples"] = self._samples(variants)
        return out

    def _sampled(self, m, common: dict, out: dict) -> list:
        """Speculative sampling at each `eval.temperatures` T under the configured rule (`T<t>/`
        keys) and the other rule (`T<t>/<rule>/`), figures added to `out`; returns the (label,
        results) of the configured rule's decodes."""
        e, d = self.cfg.eval, self.decoding
        other = next(r for r in VERIFY_RULES if r != e.verify)
        variants = []
        for t in e.temperatures:
            label = temperature_label(t)
            dec_t, spec_t, _ = evaluate_decoding(m, self.prompts, replicas=d, temperature=t,
                                                 top_p=e.top_p,
                                                 autoregressive=False, verify=e.verify, **common)
            out.update({f"{label}/{k}": v for k, v in dec_t.items()})
            variants.append((label, spec_t))
            dec_o, _, _ = evaluate_decoding(m, self.prompts, replicas=d, temperature=t,
                                            top_p=e.top_p,
                                            autoregressive=False, verify=other, **common)
            out.update({f"{label}/{other}/{k}": v for k, v in dec_o.items()})
        return variants

    def _samples(self, variants) -> List[dict]:
        """Token ids and per-row acceptance of the first `eval.num_samples_logged` prompts, for
        every variant ("" greedy, then `T<t>`), as plain lists (they travel to rank 0 with the
        figures)."""
        n = min(self.cfg.eval.num_samples_logged, len(self.prompts))
        rows = [{"prompt_ids": list(self.prompts[i])} for i in range(n)]
        for label, results in variants:
            pre = f"{label}/" if label else ""
            i = 0
            for res in results:
                for b, ids in enumerate(res.outputs):
                    if i < n:
                        rows[i][f"{pre}output_ids"] = list(ids)
                        rows[i][f"{pre}acceptance_length"] = row_metrics(res.stats,
                                                                         b)["acceptance_length"]
                    i += 1
        return rows

    def _texts(self, row: dict) -> dict:
        """A sample with its ids decoded by the run's tokenizer: `prompt`, `continuation`,
        `T<t>/continuation` beside the ids (ids alone when the run has no tokenizer)."""
        out = {}
        for k, v in row.items():
            if k.endswith("_ids") and self.tokenizer is not None:
                out[k[: -len("_ids")].replace("output", "continuation")] = self.tokenizer.decode(v)
            out[k] = v
        return out
