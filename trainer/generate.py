"""`tandem generate`: the trunk's own continuations of a prompt set, for MTP self-distillation.

    tandem generate (--checkpoint DIR | --hf DIR) --prompts FILE --out FILE [--column NAME]
                    [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens N]
                    [--samples-per-prompt M] [--batch-size B] [--seed S] [--device D]
    torchrun --nproc-per-node N --no-python tandem generate (--checkpoint DIR | --hf DIR) ...
        [--tp T] [--pp P] [--ep E]

Decoding is the evaluator's (eval/decode_eval.py evaluate_decoding, speculative side only): with the
checkpoint's MTP module it is speculative decoding, exact, so the tokens are the trunk's own (at T =
0 the autoregressive greedy tokens; for T > 0 distributed as sampling from the trunk); without one,
plain autoregressive decoding. Work is (prompt, sample) rows in prompt order, cut into batches of
`--batch-size` rows; batch i samples with a generator seeded from (`seed`, i), as the evaluator
seeds its batches (eval/decode_eval.py batch_seed), so the records do not depend on the layout, on
the number of processes or on a resume, and runs with other seeds share no draws. The records go to
OUT (JSONL, what `data.source=jsonl` reads), their settings to OUT.meta.json.
`--top-k` keeps each head's k largest logits (trunk and drafts alike, so speculative sampling stays
exact for the top-k distribution).

Under torchrun the model is sharded as in training (`--tp`, `--pp`, `--ep`; dp = the rest of the
world) and the batches are dealt over the data-parallel replicas by the in-loop evaluator's layout
adapter (trainer/parallel/pipeline_decode.py ParallelDecoding): replicas decode a batch each in
lockstep, and after every round of batches one process writes them all. A Hugging Face directory
is sharded the same way: each rank reads only its shards of the safetensors (`model.init_from`).

Files, resume and bad input: trainer/generate_io.py. Every input problem is one line naming
FILE:LINE, reported before the model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from tandem.data_pipeline.chat_template import chat_template_in
from tandem.data_pipeline.prompts import read_prompts, tokenize_prompts
from tandem.data_pipeline.tokenizer import load_tokenizer
from tandem.eval.acceptance import row_metrics
from tandem.eval.decode_eval import evaluate_decoding
from tandem.eval.spec_decode import draft_steps_problem, non_finite_weights, prompt_limit

from . import eval_cli
from .checkpoint import load_checkpoint
from .checkpoint_dirs import resolve_checkpoint
from .generate_io import GenerateError, prompts_digest, read_output, rewrite_output, write_lines
from .hf.importer import hf_config
from .hf.init_from import check_reference, fingerprint, read_reference, serving_origin
from .hf.reader import stop_ids
from .materialize import build_sharded_model
from .parallel import init_parallel
from .parallel.device import resolve_device
from .parallel.layout import decided_on_rank0, init_process_group
from .parallel.pipeline_decode import ParallelDecoding
from .recipe import load_config


def _parser() -> argparse.ArgumentParser:
    """The command's options (module docstring)."""
    p = argparse.ArgumentParser(prog="tandem generate", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Tandem run directory or checkpoints/step_<N> directory")
    src.add_argument("--hf", help="Hugging Face checkpoint directory")
    p.add_argument("--prompts", required=True,
                   help="JSONL of {\"text\": ...} or {\"messages\": [...]}, a parquet file or a "
                        "datasets directory")
    p.add_argument("--column", default="text",
                   help="the prompt column of a parquet file or datasets directory")
    p.add_argument("--out", required=True,
                   help="output JSONL, one record per row, its settings in OUT.meta.json; resumed")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 sampling")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus threshold when sampling")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep the k most likely tokens when sampling (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per response at most")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="responses per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together")
    p.add_argument("--seed", type=int, default=0,
                   help="batch i samples with a generator seeded from (S, i)")
    p.add_argument("--num-steps", type=int, default=0,
                   help="draft length K (default: the trained mtp.num_steps)")
    p.add_argument("--device", default="auto",
                   help="torch device: auto (CUDA, then NPU, then CPU), cpu, cuda, npu or cuda:N / "
                        "npu:N (default auto; under torchrun each rank takes its LOCAL_RANK's)")
    for degree in ("tp", "pp", "ep"):
        p.add_argument(f"--{degree}", type=int, default=1,
                       help=f"parallel.{degree} under torchrun (default 1)")
    return p


@dataclass
class Source:
    """What is known of the checkpoint before its weights load."""

    path: str
    """The step directory (Tandem) or the Hugging Face directory."""
    cfg: object
    """The Tandem checkpoint's TandemConfig, or the Hugging Face directory's (hf_config)."""
    max_seq_len: int
    num_steps: int
    """K the decoder drafts (0: autoregressive)."""
    tokenizer: object
    chat: Optional[dict]
    """The chat template (data_pipeline/chat_template.py), None when the checkpoint has none."""
    fingerprint: str
    stop_ids: Optional[List[int]]
    """The ids that end a response (hf/reader.py stop_ids)."""


def _hf_source(args) -> Source:
    """A Hugging Face directory: its config (trunk shape, the MTP module its weights hold),
    tokenizer and chat template, without weights."""
    cfg, _ = hf_config(args.hf)
    tok = load_tokenizer(args.hf)
    return Source(args.hf, cfg, cfg.model.max_seq_len, args.num_steps or cfg.mtp.num_steps, tok,
                  chat_template_in([args.hf]), fingerprint(args.hf),
                  stop_ids(tok.eod_id, [args.hf]))


def _checkpoint_source(args) -> Source:
    """A Tandem checkpoint: its saved config, recorded tokenizer and chat template, no weights."""
    step = resolve_checkpoint(args.checkpoint)
    cfg = load_config(os.path.join(step, "config.yaml"))
    tok = eval_cli.load_run_tokenizer(cfg, step)
    if tok is None:
        raise GenerateError(f"--checkpoint {step}: no tokenizer recorded for this checkpoint")
    ref = read_reference(step)
    # a frozen-trunk fine-tune holds the MTP module only: the trunk it points at is part of its
    # identity
    fp = fingerprint(step) + (f"+{ref.get('fingerprint', '')}" if ref else "")
    tok_dir = cfg.data.tokenizer if os.path.isdir(cfg.data.tokenizer
                                                  or "") else os.path.dirname(cfg.data.tokenizer)
    chat = chat_template_in([step, tok_dir, ref["path"] if ref else cfg.model.init_from])
    K = args.num_steps or cfg.mtp.num_steps
    stops = stop_ids(tok.eod_id, [serving_origin(step)])
    return Source(step, cfg, cfg.model.max_seq_len, K, tok, chat, fp, stops)


@dataclass
class Plan:
    """The rows to decode: (prompt, sample) in prompt order, cut into batches of `batch_size`."""

    texts: List[str]
    ids: List[List[int]]
    samples: int
    batch_size: int
    rows: List[tuple] = field(init=False)

    def __post_init__(self):
        self.rows = [(p, s) for p in range(len(self.ids)) for s in range(self.samples)]

    @property
    def num_batches(self) -> int:
        """Batches of the whole set (the last may be short)."""
        return -(-len(self.rows) // self.batch_size)

    def batch(self, i: int) -> List[tuple]:
        """The (prompt, sample) rows of batch i."""
        return self.rows[i * self.batch_size:(i + 1) * self.batch_size]


def _settings(args, src: Source) -> dict:
    """decode_eval.DecodeSettings' fields (seed and first_batch are passed per group of batches)."""
    ev = getattr(src.cfg, "eval", None)
    return dict(num_steps=src.num_steps, max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                eos_id=src.stop_ids, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k,
                verify=getattr(ev, "verify", "token"),
                draft_convention=getattr(ev, "draft_convention", "serving"))


def _meta(args, src: Source, settings: dict, ids: List[List[int]]) -> dict:
    """What the records depend on (OUT.meta.json): a rerun with any of it changed must not
    append."""
    return {"checkpoint": os.path.abspath(src.path), "checkpoint_fingerprint": src.fingerprint,
            "prompts_sha256": prompts_digest(ids), "num_prompts": len(ids),
            "samples_per_prompt": args.samples_per_prompt, "seed": args.seed,
            # how batches are seeded: records of the earlier `seed + i` draws are not resumed
            "batch_seeds": "SeedSequence(seed, batch)", "top_k": args.top_k,
            # one seed draws otherwise on another kind of device: sampled records resumed there
            # would be no uninterrupted run's
            "sampling_device": args.device.partition(":")[0] if args.temperature > 0 else None,
            **settings}


def _check_args(args, world: int) -> None:
    """Option ranges, in one line naming the flag and its value, before anything is read (`world`:
    the processes torchrun started)."""
    for flag in ("max_new_tokens", "samples_per_prompt", "batch_size"):
        if getattr(args, flag) < 1:
            raise GenerateError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1")
    problem = eval_cli.sampling_flag_problem(args.temperature, args.top_p)
    if problem:
        raise GenerateError(problem)
    if args.samples_per_prompt > 1 and args.temperature <= 0:
        raise GenerateError(f"--samples-per-prompt {args.samples_per_prompt} at --temperature "
                            f"{args.temperature} (greedy) writes the same response "
                            f"{args.samples_per_prompt} times: pass --temperature > 0")
    if args.top_k < 0:
        raise GenerateError(f"--top-k {args.top_k} must be >= 0 (0: all)")
    if args.num_steps < 0 or min(args.tp, args.pp, args.ep) < 1:
        raise GenerateError("--num-steps must be >= 0 (0: the trained K), --tp, --pp and --ep "
                            ">= 1")
    degrees = args.tp * args.pp * args.ep
    if world % degrees:
        # one process would otherwise decode unsharded, the layout flags silently dropped
        raise GenerateError(f"--tp {args.tp} --pp {args.pp} --ep {args.ep} need a multiple of "
                            f"{degrees} processes, not {world}: launch with torchrun "
                            f"--nproc-per-node {degrees}")


def prepare(args, world: int):
    """Everything before the model loads: (source, plan, meta, records kept, done batches). Raises
    GenerateError for bad input and for an --out written with other settings."""

    _check_args(args, world)
    args.device = eval_cli.resolve_device_flag(args.device)
    prompts = read_prompts(args.prompts, args.column)
    src = _hf_source(args) if args.hf else _checkpoint_source(args)
    problem = draft_steps_problem(src.num_steps, src.cfg.mtp)
    if problem:  # found in decoding, it came after the sidecar was written, and refused the rerun
        raise GenerateError(f"--num-steps {src.num_steps}: {problem}")
    limit = prompt_limit(src.max_seq_len, args.max_new_tokens, src.num_steps)
    if limit < 1:  # no prompt fits: the budget is the problem, not the prompts
        raise GenerateError(f"--max-new-tokens {args.max_new_tokens} and the draft margin "
                            f"4K+5={4 * src.num_steps + 5} (K={src.num_steps}, --num-steps) leave "
                            f"no room for a prompt in model.max_seq_len={src.max_seq_len}")
    note = (f"model.max_seq_len={src.max_seq_len} - --max-new-tokens {args.max_new_tokens} - draft "
            "margin "
            f"4K+5={4 * src.num_steps + 5}")
    texts, ids = tokenize_prompts(prompts, src.tokenizer, src.chat, limit, note)
    plan = Plan(texts, ids, args.samples_per_prompt, args.batch_size)
    settings = _settings(args, src)
    meta = _meta(args, src, settings, ids)
    records, torn = read_output(args.out, meta)
    done = _complete_batches(plan, records)
    kept = [r for r in records if _batch_of(plan, r) in done]
    return src, plan, settings, meta, kept, done, torn or len(kept) != len(records)


def _batch_of(plan: Plan, rec: dict) -> int:
    """The batch a written record belongs to."""
    return (rec["prompt_index"] * plan.samples + rec["sample_index"]) // plan.batch_size


def _complete_batches(plan: Plan, records: List[dict]) -> set:
    """Batches whose every row is in `records` (a batch cut short by a kill is decoded again whole,
    with its own seed, so the file ends as an uninterrupted run's)."""
    seen = {}
    for r in records:
        seen.setdefault(_batch_of(plan, r), set()).add((r["prompt_index"], r["sample_index"]))
    return {b for b, rows in seen.items() if b < plan.num_batches and rows == set(plan.batch(b))}


# --- the model ------------------------------------------------------------------------------------
def decoding_layout(cfg, tp: int, pp: int, ep: int) -> None:
    """`cfg` (a checkpoint's) rewritten to decode on tp x pp x ep (dp the rest, no cp or SP): fp32
    and no training-only wrappers, so every layout decodes as one process does."""
    p = cfg.parallel
    if pp != p.pp or pp == 1:
        # the trained stages' placement fits neither another pipeline depth nor none (a run saved
        # before pp=1 refused one), and neither does its schedule: decoding runs no training
        # micro-batch, but the checks of one refused --pp (the step's sequences too few to split
        # over pp, pp_microbatches below it, interleaved stages left without a layer)
        p.pp_layout, p.pp_depth_stages, p.pp_balance = [], [], p.pp_balance and pp > 1
        p.pp_schedule, p.pp_virtual_stages, p.pp_microbatches = "1f1b", 1, 0
        cfg.train.micro_batch_size, cfg.train.grad_accum_steps = 1, max(pp, 1)
    p.tp, p.pp, p.ep, p.dp, p.cp, p.sequence_parallel = tp, pp, ep, 0, 1, False
    cfg.train.dtype, cfg.train.freeze_trunk, cfg.train.compile = "fp32", False, False
    cfg.train.activation_checkpointing = "none"


def load_on_layout(args, src: Source):
    """(model, ParallelDecoding) of this rank's part of the checkpoint (a Tandem one or a Hugging
    Face directory) on the torchrun layout: built as training builds it (meta device, parallelized,
    only this rank's shards read from the checkpoint, `model.init_from`)."""
    cfg, step = src.cfg, src.path
    ref = None if args.hf else read_reference(step)
    if ref is not None:
        check_reference(ref, step)
    decoding_layout(cfg, args.tp, args.pp, args.ep)
    cfg.model.init_from = ref["path"] if ref is not None else step
    # the rank's own device: its LOCAL_RANK's (args.device is already resolved, to this process's)
    pstate = init_parallel(cfg, resolve_device(args.device.partition(":")[0], dtype="fp32"))
    model = build_sharded_model(cfg, pstate)
    if ref is not None:  # the MTP module of a frozen-trunk fine-tune
        load_checkpoint(step, model, None)
    bad = [None] * dist.get_world_size()  # each rank checks its shards; every rank refuses
    dist.all_gather_object(bad, non_finite_weights(model))
    if any(bad):
        raise ValueError(f"{step}: the weights are corrupt: {next(filter(None, bad))} not finite")
    return model.eval(), ParallelDecoding(cfg, model, pstate)


def load_one_process(args, src: Source):
    """The model in this process, as `tandem eval` loads it."""
    eval_args = argparse.Namespace(hf=args.hf, checkpoint=src.path if not args.hf else None,
                                   device=args.device)
    model, _, _ = eval_cli.load_model_and_tokenizer(eval_args)
    return model


def _writer_and_drivers(decoding):
    """(The process that writes: the lowest rank among replica 0's decoder drivers, which holds
    every replica's gathered results; the process group of every driver, None when every rank
    drives). Every rank calls it (the group's creation is collective)."""
    if decoding is None:
        return 0, None
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (bool(decoding.is_driver), decoding.replica))
    drivers = [r for r, (driver, _) in enumerate(flags) if driver]
    group = None if len(drivers) == len(flags) else dist.new_group(drivers)
    return flags.index((True, 0)), group


class PeerFailed(Exception):
    """Another rank's write failed: this rank stops decoding too (that rank reports it)."""


def _failed_anywhere(failed: bool, decoding, group=None) -> bool:
    """Whether any rank of `group` (default: every rank) failed; each rank of it calls this at the
    same point, so one rank's failed write stops them all where they would otherwise wait for it
    in the next collective."""
    if decoding is None:
        return failed
    flag = torch.tensor([int(failed)], device=decoding.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


# --- decoding -------------------------------------------------------------------------------------
def _groups(todo: List[int], size: int) -> List[List[int]]:
    """Consecutive runs of at most `size` batches (one per replica): evaluate_decoding seeds its
    i-th batch as batch `first_batch + i`, so a group's batches must be consecutive for batch b to
    draw as batch b."""
    out = []
    for b in todo:
        if out and out[-1][-1] == b - 1 and len(out[-1]) < size:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def _records(plan: Plan, batch: int, result, tok, stops: Optional[List[int]]) -> List[dict]:
    """The output records of one decoded batch (generate_io module docstring)."""
    out = []
    for r, ((p, s), ids) in enumerate(zip(plan.batch(batch), result.outputs)):
        finished = bool(stops) and bool(ids) and ids[-1] in stops
        text = tok.decode(ids[:-1] if finished else ids)
        out.append({"prompt_index": p, "sample_index": s, "prompt": plan.texts[p], "response": text,
                    "prompt_ids": plan.ids[p], "response_ids": ids, "finished": finished,
                    "acceptance_length": row_metrics(result.stats, r)["acceptance_length"]})
    return out


class Progress:
    """stderr progress bar on the writing process: rows, tokens/s and acceptance length so far."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="generate", unit="row", dynamic_ncols=True,
                        file=sys.stderr, disable=not enabled)
        self.t0, self.tokens, self.rounds, self.accepted = time.perf_counter(), 0, 0, 0

    def add(self, results) -> None:
        """Count a written group's decode results."""
        for res in results:
            self.tokens += sum(len(o) for o in res.outputs)
            self.rounds += int(res.stats.rounds.sum())
            self.accepted += int(res.stats.accepted.sum())
            self.bar.update(len(res.outputs))
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix({"tok/s": f"{rate:.1f}",
                              "acc_len": f"{1 + self.accepted / max(self.rounds, 1):.2f}"})

    def close(self) -> None:
        self.bar.close()


def decode_and_write(args, src, plan: Plan, settings: dict, todo: List[int], model, decoding,
                     writer: bool, drivers=None) -> None:
    """Decode the batches in `todo` group by group (one batch per replica), the writer appending
    each group's records, durably, before the next group starts. A failed write (a full disk)
    raises its OSError on the writer and PeerFailed on the other drivers (`drivers`: their group),
    after the group: no driver starts a group the writer will not join."""
    replicas = decoding.replicas if decoding is not None else 1
    progress = Progress(sum(len(plan.batch(b)) for b in todo), writer)
    try:
        for group in _groups(todo, replicas):
            prompts = [plan.ids[p] for b in group for p, _ in plan.batch(b)]
            _, results, _ = evaluate_decoding(model, prompts, replicas=decoding,
                                              autoregressive=False,
                                              seed=args.seed, first_batch=group[0], **settings)
            failed = None
            if writer:
                rows = [r for b,
                        res in zip(group, results) for r in _records(plan, b, res, src.tokenizer,
                                                                            settings["eos_id"])]
                try:
                    write_lines(args.out, rows, "a")
                    progress.add(results)
                except OSError as exc:
                    failed = exc
            if _failed_anywhere(failed is not None, decoding, drivers):
                raise failed or PeerFailed()
    finally:
        progress.close()


def run(args, src, plan, settings, todo, decoding, model, writer: bool, drivers=None) -> None:
    """This rank's part: drivers decode (and one writes), pipeline followers serve their stages
    until their driver stops them, also after a failed write."""
    view = decoding.model if decoding is not None else model
    with decoding.context() if decoding is not None else contextlib.nullcontext():
        if decoding is None or decoding.is_driver:
            try:
                decode_and_write(args, src, plan, settings, todo, view, decoding, writer, drivers)
            finally:
                if decoding is not None:
                    decoding.stop()
        else:
            decoding.follow()


def _start(args, rank: int, world: int):
    """Checks, then the model: (source, plan, settings, meta, kept records, todo batches, repair,
    model, decoding). Every input problem raises before the model loads."""
    if world > 1 and not dist.is_initialized():
        args.device = eval_cli.resolve_device_flag(args.device)  # its error names the flag
        init_process_group(resolve_device(args.device.partition(":")[0]).process_group_backend)
    if world > 1 and not args.hf:
        # every rank decodes the step rank 0 found: a run directory's newest checkpoint moves on
        # while that run trains, and rows of two checkpoints went into one --out
        args.checkpoint = decided_on_rank0(lambda: resolve_checkpoint(args.checkpoint))
    src, plan, settings, meta, kept, done, repair = prepare(args, world)
    if world > 1:
        model, decoding = load_on_layout(args, src)
    else:
        model, decoding = load_one_process(args, src), None
    todo = [b for b in range(plan.num_batches) if b not in done]
    return src, plan, settings, meta, kept, todo, repair, model, decoding


def generate_main(argv: Optional[List[str]] = None) -> int:
    """`tandem generate ARGV`: 0 when every row is written, 2 after a one-line error."""
    args = _parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    # a caller's process group outlives this command
    owns_group = world > 1 and not dist.is_initialized()
    try:
        src, plan, settings, meta, kept, todo, repair, model, decoding = _start(args, rank, world)
    except (GenerateError, OSError, ValueError) as exc:
        if rank == 0:
            print(f"tandem generate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        if owns_group and dist.is_initialized():  # _start may have started it
            dist.destroy_process_group()
        return 2
    writer, drivers = _writer_and_drivers(decoding)
    writer = writer == rank
    left = sum(len(plan.batch(b)) for b in todo)
    failed = None
    try:
        if writer:
            if repair or not kept:  # the sidecar, and the records up to the last complete batch
                rewrite_output(args.out, meta, kept)
            if kept:
                print(f"tandem generate: resuming {args.out}: {len(kept)} rows written, {left} to "
                      "go", file=sys.stderr)
    except OSError as exc:
        failed = exc
    # the file is repaired before anyone appends (every rank waits here for the writer)
    if not _failed_anywhere(failed is not None, decoding):
        try:
            run(args, src, plan, settings, todo, decoding, model, writer, drivers)
        except (OSError, PeerFailed) as exc:
            failed = exc
    # every rank returns the writer's outcome, a follower's included
    code = 2 if _failed_anywhere(failed is not None, decoding) else 0
    if isinstance(failed, OSError):  # a full disk: the rows written are kept, a rerun resumes
        print(f"tandem generate: error: {failed}; run it again to resume", file=sys.stderr)
    elif writer and code == 0:
        print(json.dumps({"out": args.out, "rows": len(plan.rows), "decoded": left}))
    if drivers is not None:  # (a no-op on the ranks outside it)
        dist.destroy_process_group(drivers)
    if decoding is not None and owns_group:
        dist.destroy_process_group()
    return code

