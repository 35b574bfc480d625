"""MTP self-distillation and MTP refresh, measured side by side on the default job's checkpoint.

    python bench/self_distill.py run [--checkpoint runs/tiny] [size flags]   # the measurement
    python bench/self_distill.py prompts --out prompts.jsonl [--count N] [--source-dir DIR]

`prompts` writes `{"text": ...}` prompts for `tandem generate`: a run of whole lines cut from each
of `--count` files, spread over the stdlib corpus's held-out test/ split (default) or the .py files
of `--source-dir`.

`run` (every training and generation step is the real `tandem` command, in a subprocess):

1. the checkpoint: `--checkpoint DIR`, else `recipes/tiny.yaml` trained for `--pretrain-steps` into
   WORK/seed_<seed>/tiny (the recipe's 750 steps take ~7 minutes on 2 cores);
2. self-distillation: from the same checkpoint, the MTP module alone (frozen trunk, K=3) fine-tuned
   for `--ft-steps` steps of the same micro-batch and seq_len (equal steps and tokens) on
   (a) the stdlib corpus (recipes/finetune_mtp.yaml),
   (b) the trunk's greedy continuations of prompts from the stdlib test split (`tandem generate`),
   (c) the same at T=0.8 (recipes/finetune_mtp_selfdistill.yaml for both);
3. refresh: the trunk alone fine-tuned for `--trunk-steps` on another corpus (the installed
   setuptools' sources, its vendored and distutils copies left out; every 5th file held out), the
   old MTP module put on it (stale), then refreshed (recipes/mtp_refresh.yaml: `tandem generate`
   from the new trunk on that corpus's training files, MTP-only training from the old module,
   `--ft-steps` steps);
4. acceptance of each, greedy and T=1, with the evaluator (eval/decode_eval.evaluate_decoding:
   budget- exact acceptance length and per-position rates, 95% intervals over prompts), on prompts
   no model trained on: pip/_internal's sources for step 2, setuptools' held-out files for step 3.

Steps 1, 2 and 4 run once per training seed (`--seeds`, default 3: `train.seed` = the recipe's seed
+ 0..N-1 for the pretraining, the fine-tunes and the T=0.8 generation; every seed's models decode
the same held-out prompts). Then (b) - (a), (c) - (a) and (a) - before are compared over seeds and
prompts (tandem.eval.seed_comparison: per-seed figures, mean [lo, hi], difference [lo, hi],
significant=yes|no), greedy and at T=1; the run ends with their key=value line. The refresh (step 3)
runs for the first seed.

Recovery = (refreshed - stale) / (before - stale), where `before` is the old trunk with its own MTP
module on the same prompts. Figures and the command are in docs/finetuning.md. The issue's targets
(b or c >= a + 0.10 greedy; recovery >= 80%) are reported as met or not (the first on the mean over
seeds, and whether that difference is significant); nothing here is tuned to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from default_job_quality import code_files, pip_internal_dir  # noqa: E402
from seeded_runs import add_seed_flags, compare, decode, seed_values  # noqa: E402

QUIET = ["logging.wandb=false", "logging.progress=false"]


# --------------------------------------------------------------------------------------------------
# prompts and corpora
# --------------------------------------------------------------------------------------------------
def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        return ""


def cut_prompt(text: str, index: int, min_chars: int) -> str:
    """Whole lines from a line in the file's first half (chosen by `index`) until `min_chars` are
    in."""
    lines = text.splitlines(keepends=True)
    if not lines:
        return ""
    start = (index * 7919) % max(len(lines) // 2, 1)
    out = ""
    for line in lines[start:]:
        out += line
        if len(out) >= min_chars:
            break
    return out


def make_prompts(files: Sequence[str], count: int, min_chars: int) -> List[str]:
    """`count` prompts, one per file, from files spread evenly over the (sorted) list."""
    picks = [files[i * len(files) // count]
             for i in range(count)] if count < len(files) else list(files)
    prompts = [cut_prompt(read_text(p), i, min_chars) for i, p in enumerate(picks)]
    return [p for p in prompts if p.strip()]


def write_jsonl(path: str, records: Sequence[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def package_files(name: str, skip=("_vendor", "_distutils", "tests")) -> List[str]:
    """Sorted .py files of an installed package, its vendored copies and tests left out."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"no installed `{name}` package; pass another with "
                                "--refresh-package")
    root = list(spec.submodule_search_locations)[0]
    files = code_files(root, 1 << 40)
    return [f for f in files
            if not any(part in skip for part in os.path.relpath(f, root).split(os.sep))]


def split_files(files: Sequence[str], every: int = 5):
    """(training files, held-out files): every `every`-th file held out."""
    return [f for i, f in enumerate(files) if i % every], [f for i,
                                                           f in enumerate(files) if not i % every]


# --------------------------------------------------------------------------------------------------
# the tandem commands
# --------------------------------------------------------------------------------------------------
def tandem(args: Sequence[str], log: str) -> float:
    """Run `tandem ARGS` (this interpreter's), its output to `log`; seconds taken. Exits on
    failure."""
    cmd = [sys.executable, "-c",
           "import sys; from tandem.trainer.cli import main; sys.exit(main())", *args]
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        with open(log) as f:
            print(f.read()[-4000:], file=sys.stderr)
        raise SystemExit(f"self_distill: `tandem {' '.join(args[:3])} ...` failed (log {log})")
    return time.perf_counter() - t0


def corpus(a) -> List[str]:
    """The stdlib corpus slice the pretraining and fine-tune (a) read (0: all of it, as the
    recipe)."""
    return [f"data.stdlib_max_bytes={a.corpus_bytes}"] if a.corpus_bytes else []


def finetune_args(recipe: str, work: str, name: str, init: str, a, extra=()) -> List[str]:
    """An MTP-only fine-tune of `--ft-steps` steps: every variant the same steps, batch and
    seq_len."""
    return ["train", recipe, f"model.init_from={init}", f"run.dir={os.path.join(work, name)}",
            f"train.max_steps={a.ft_steps}", f"train.micro_batch_size={a.batch}",
            f"data.seq_len={a.seq_len}",
            f"train.warmup_steps={max(a.ft_steps // 15, 1)}", "eval.interval=0",
            f"checkpoint.interval={a.ft_steps}", f"mtp.num_steps={a.K}", *QUIET, *extra]


def generate(work: str, ckpt: str, prompts: str, name: str, a, temperature: float,
             seed: int = 1) -> str:
    out = os.path.join(work, f"{name}.jsonl")
    tandem(["generate", "--checkpoint", ckpt, "--prompts", prompts, "--out", out, "--temperature",
            str(temperature),
            "--seed", str(seed), "--max-new-tokens", str(a.gen_tokens), "--batch-size", "16"],
           os.path.join(work, f"{name}.log"))
    return out


def describe(path: str) -> str:
    """Records and distinct-4 of the responses (1: no 4-gram repeats; near 0: the trunk loops)."""
    total = unique = n = 0
    with open(path) as f:
        for line in f:
            ids = json.loads(line)["response_ids"]
            grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
            total, unique, n = total + len(grams), unique + len(set(grams)), n + 1
    return f"{n} records, distinct-4 {unique / max(total, 1):.3f}"


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------
def eval_prompts(tok, files: Sequence[str], count: int, length: int) -> List[List[int]]:
    """`count` prompts of `length` tokens, evenly spaced over the files' token stream."""
    stream: List[int] = []
    for ids in tok.encode_batch([t for t in (read_text(f) for f in files) if t]):
        stream += list(ids) + [tok.eod_id]
    n = len(stream) // length
    if n < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one prompt of "
                         f"{length}")
    return [stream[(i * n // count) * length:(i * n // count + 1) * length]
            for i in range(min(count, n))]


def acceptance(model, prompts, a, eos_id: int, stats: Optional[dict] = None) -> Dict[str, dict]:
    """Greedy and T=1 figures of evaluate_decoding (speculative side only); each decode's
    DecodeStats go to `stats[mode]` when given (for the comparison over seeds)."""
    out = {}
    common = dict(num_steps=a.K, max_new_tokens=a.eval_tokens, batch_size=8, eos_id=eos_id, seed=0)
    with torch.inference_mode():
        for label, temp in (("greedy", 0.0), ("T1", 1.0)):
            out[label], st, _ = decode(model, prompts, temperature=temp, **common)
            if stats is not None:
                stats[label] = st
    return out


def load(ckpt: str):
    from tandem.trainer.checkpoint import load_model_from_checkpoint

    return load_model_from_checkpoint(ckpt)[0]


def with_trunk_of(model, trunk_ckpt: str):
    """`model`'s MTP module on the trunk of `trunk_ckpt` (what mtp.init_from builds before
    training)."""
    trunk = {k: v for k, v in load(trunk_ckpt).state_dict().items() if not k.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    return model


def fmt(fig: dict, key: str) -> str:
    lo, hi = fig.get(f"{key}_lo95"), fig.get(f"{key}_hi95")
    return f"{fig[key]:.3f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None else "")


def row(label: str, figs: Dict[str, dict], K: int) -> str:
    cells = [label]
    for mode in ("greedy", "T1"):
        f = figs[mode]
        cells += [fmt(f, "acceptance_length"),
                  " / ".join(f"{f[f'accept_rate/pos_{k}']:.3f}" for k in range(1, K + 1))]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| MTP module | greedy acceptance length [95%] | greedy per position | T=1 acceptance "
          "length [95%] "
          "| T=1 per position |\n|---|---|---|---|---|")


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def pretrained(a, work: str, seed: int) -> str:
    if a.checkpoint:
        return a.checkpoint
    ckpt = os.path.join(work, "tiny")
    secs = tandem(["train", "recipes/tiny.yaml", f"run.dir={ckpt}",
                   f"train.max_steps={a.pretrain_steps}",
                   f"checkpoint.interval={a.pretrain_steps}", "eval.interval=0",
                   f"train.seed={seed}", *corpus(a),
                   *QUIET, *a.pretrain_overrides.split()], os.path.join(work, "tiny.log"))
    print(f"pretrained recipes/tiny.yaml (train.seed={seed}) for {a.pretrain_steps} steps in "
          f"{secs:.0f} s -> {ckpt}",
          flush=True)
    return ckpt


VARIANTS = ("before fine-tuning", "(a) stdlib corpus", "(b) own greedy continuations",
            "(c) own continuations at T=0.8")
COMPARED = (("(b)", "(a)"), ("(c)", "(a)"), ("(a)", "before"))
"""The pairs compared over seeds: each self-distilled module against the corpus one, and the corpus
fine-tune against no fine-tuning."""


def self_distillation(a, work: str, ckpt: str, tok, seed: int, held, stats: dict) -> List[str]:
    """Fine-tunes (a), (b), (c) of one training seed and their acceptance on pip's held-out prompts
    `held`; the seed's table lines. Each variant's DecodeStats go to stats[variant][mode]."""
    from tandem.data_pipeline.stdlib_corpus import stdlib_files

    prompts = write_jsonl(os.path.join(work, "stdlib_prompts.jsonl"),
                          [{"text": p} for p in make_prompts(stdlib_files()[1], a.gen_prompts,
                                                             a.prompt_chars)])
    runs = {VARIANTS[1]: ("recipes/finetune_mtp.yaml", "ft_corpus", corpus(a))}
    notes = []
    for label, name, temp in ((VARIANTS[2], "gen_greedy", 0.0), (VARIANTS[3], "gen_t08", 0.8)):
        t0 = time.perf_counter()
        data = generate(work, ckpt, prompts, name, a, temp, seed)
        print(f"generated {name} in {time.perf_counter() - t0:.0f} s: {describe(data)}", flush=True)
        notes.append(f"{label[:3]} data: {describe(data)}.")
        runs[label] = ("recipes/finetune_mtp_selfdistill.yaml", f"ft_{name}",
                       [f"data.paths=[{data}]"])
    lines = [f"train.seed={seed}:", "", HEADER,
             row(VARIANTS[0], acceptance(load(ckpt), held, a, tok.eod_id, stats[VARIANTS[0]]), a.K)]
    for label, (recipe, name, extra) in runs.items():
        secs = tandem(finetune_args(recipe, work, name, ckpt, a, [f"train.seed={seed}", *extra]),
                      os.path.join(work, f"{name}.log"))
        lines.append(row(label, acceptance(load(os.path.join(work, name)), held, a, tok.eod_id,
                                           stats[label]), a.K))
        print(f"{label}: {a.ft_steps} steps in {secs:.0f} s; {lines[-1]}", flush=True)
    return lines + ["", " ".join(notes)]


def over_seeds(a, stats: dict, n_seeds: int) -> Tuple[List[str], Dict[str, str]]:
    """The comparison over seeds and prompts of each pair in COMPARED, greedy and T=1: the table's
    lines and the key=value summary."""
    short = {v[:3] if v.startswith("(") else v.split()[0]: v for v in VARIANTS}
    lines = [f"Over {n_seeds} training seeds (mean over seeds [95% interval over seeds and "
             "prompts]; "
             "difference [95%], significant when the interval excludes 0):", "",
             "| comparison | greedy difference [95%] | significant | T=1 difference [95%] | "
             "significant |",
             "|---|---|---|---|---|"]
    summary, means = {}, {}
    for x, y in COMPARED:
        cells = [f"{x} - {y}"]
        for mode in ("greedy", "T1"):
            c = compare(x, [s[mode] for s in stats[short[x]]], y,
                        [s[mode] for s in stats[short[y]]], mode)
            means.setdefault(short[x], {})[mode], means.setdefault(short[y],
                                                                   {})[mode] = c.mean_a, c.mean_b
            cells += [str(c.diff), "yes" if c.significant else "no"]
            key = f"{x.strip('()')}_minus_{y.strip('()')}_{mode}"
            summary[key], summary[f"{key}_significant"] = (
                f"{c.diff.value:+.3f}",
                "yes" if c.significant else "no",
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| MTP module | greedy mean [95%] | T=1 mean [95%] |", "|---|---|---|"]
    lines += [f"| {v} | {means[v]['greedy']} | {means[v]['T1']} |" for v in VARIANTS]
    gain = max(float(summary["b_minus_a_greedy"]), float(summary["c_minus_a_greedy"]))
    sig = any(summary[f"{v}_minus_a_greedy_significant"] == "yes"
              and float(summary[f"{v}_minus_a_greedy"]) >= 0.10
              for v in "bc")
    lines += ["",
              f"Best self-distilled minus corpus, greedy acceptance length: {gain:+.3f} (target >= "
              "+0.10: "
              f"{'met' if gain >= 0.10 else 'not met'} on the mean; "
              f"{'significant' if sig else 'not significant'})."]
    return lines, summary


def refresh(a, work: str, ckpt: str, tok) -> List[str]:
    """Trunk fine-tuned alone on another package; old MTP stale on it, then refreshed; the table's
    lines."""
    train_files, held_files = split_files(package_files(a.refresh_package))
    texts = [t for t in map(read_text, train_files) if t]
    corpus = write_jsonl(os.path.join(work, "trunk_corpus.jsonl"), [{"text": t} for t in texts])
    trunk = os.path.join(work, "trunk_ft")
    secs = tandem(["train", "recipes/tiny.yaml", f"model.init_from={ckpt}", f"run.dir={trunk}",
                   "mtp.num_steps=0",
                   "data.source=jsonl", f"data.paths=[{corpus}]", "data.document_mask=true",
                   f"train.max_steps={a.trunk_steps}", f"checkpoint.interval={a.trunk_steps}",
                   "eval.interval=0",
                   f"train.warmup_steps={max(a.trunk_steps // 15, 1)}", f"train.lr={a.trunk_lr}",
                   f"train.min_lr={a.trunk_lr / 10}", *QUIET], os.path.join(work, "trunk_ft.log"))
    print(f"trunk fine-tuned alone on {a.refresh_package} ({len(train_files)} files) for "
          f"{a.trunk_steps} steps "
          f"in {secs:.0f} s", flush=True)
    prompts = write_jsonl(os.path.join(work, "refresh_prompts.jsonl"),
                          [{"text": p} for p in make_prompts(train_files, a.gen_prompts,
                                                             a.prompt_chars)])
    data = generate(work, trunk, prompts, "gen_refresh", a, 0.0)
    print(f"generated gen_refresh: {describe(data)}", flush=True)
    secs = tandem(finetune_args("recipes/mtp_refresh.yaml", work, "refreshed", trunk, a,
                                [f"mtp.init_from={ckpt}", f"data.paths=[{data}]"]),
                  os.path.join(work, "refreshed.log"))
    print(f"refreshed the MTP module in {secs:.0f} s", flush=True)
    held = eval_prompts(tok, held_files, a.eval_prompts, a.prompt_len)
    figs = {"before: old trunk, its own MTP": acceptance(load(ckpt), held, a, tok.eod_id),
            "stale: new trunk, old MTP": acceptance(with_trunk_of(load(ckpt), trunk), held, a,
                                                    tok.eod_id),
            "refreshed: new trunk, MTP refreshed": acceptance(load(os.path.join(work, "refreshed")),
                                                              held, a, tok.eod_id)}
    lines = [f"Held-out: {len(held)} prompts of {a.prompt_len} tokens from {len(held_files)} "
             "held-out files of "
             f"{a.refresh_package}, {a.eval_tokens} new tokens; refresh data: {describe(data)}.",
             "", HEADER]
    lines += [row(label, f, a.K) for label, f in figs.items()]
    for mode in ("greedy", "T1"):
        before, stale, new = (f[mode]["acceptance_length"] for f in figs.values())
        lost = before - stale
        text = f"{(new - stale) / lost:.0%} of the {lost:.3f} lost" if lost > 1e-9 else \
            f"nothing lost ({lost:+.3f}); refreshed {new - stale:+.3f} over stale"
        target = "" if mode != "greedy" or lost <= 1e-9 else \
            f" (target >= 80%: {'met' if (new - stale) / lost >= 0.8 else 'not met'})"
        lines.append(f"{'' if mode == 'T1' else chr(10)}Recovered, {mode}: {text}{target}.")
    return lines


def run(a) -> int:
    from tandem.trainer.checkpoint import resolve_checkpoint
    from tandem.trainer.eval_cli import load_run_tokenizer
    from tandem.trainer.recipe import load_config

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    work = os.path.abspath(a.work)
    seeds = seed_values("recipes/tiny.yaml", a.pretrain_overrides.split(), a.seeds)
    cpu = platform.processor() or platform.machine()
    lines = [f"`python bench/self_distill.py run {shlex.join(sys.argv[2:])}` on {cpu}"
             f" ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}; "
             + (f"checkpoint {a.checkpoint}" if a.checkpoint
                else f"pretraining {a.pretrain_steps} steps per seed")
             + f"; fine-tunes of {a.ft_steps} steps x {a.batch} x {a.seq_len} tokens each; "
               "generation: "
             f"{a.gen_prompts} prompts, {a.gen_tokens} new tokens; train.seed "
             f"{', '.join(map(str, seeds))}.", ""]
    stats = {v: [] for v in VARIANTS}  # variant -> per seed {mode: DecodeStats}
    held, first = None, None
    for seed in seeds:
        seed_work = os.path.join(work, f"seed_{seed}")
        os.makedirs(seed_work, exist_ok=True)
        ckpt = os.path.abspath(pretrained(a, seed_work, seed))
        step = resolve_checkpoint(ckpt)
        tok = load_run_tokenizer(load_config(os.path.join(step, "config.yaml")), step)
        if held is None:  # one prompt set for every seed: the comparison is paired by prompt
            held = eval_prompts(tok, code_files(pip_internal_dir(), a.eval_bytes), a.eval_prompts,
                                a.prompt_len)
            lines += [f"Held-out: {len(held)} prompts of {a.prompt_len} tokens from pip/_internal, "
                      f"{a.eval_tokens} "
                      f"new tokens, K={a.K}.", ""]
            first = (seed_work, ckpt, tok)
        seed_stats = {v: {} for v in VARIANTS}
        lines += self_distillation(a, seed_work, ckpt, tok, seed, held, seed_stats) + [""]
        for v in VARIANTS:
            stats[v].append(seed_stats[v])
    table, summary = over_seeds(a, stats, len(seeds))
    lines += table
    if a.trunk_steps > 0:
        lines += ["", f"Refresh (train.seed={seeds[0]} only):", ""] + refresh(a, *first)
    lines += ["", f"Wall time {(time.perf_counter() - t0) / 60:.1f} min."]
    print("\n" + "\n".join(lines))
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prompts", help="write {text} prompts for tandem generate")
    pr.add_argument("--out", required=True)
    pr.add_argument("--count", type=int, default=64, help="prompts (one per file)")
    pr.add_argument("--source-dir", default="",
                    help=".py files to cut from (default: the stdlib test split)")
    pr.add_argument("--prompt-chars", type=int, default=200,
                    help="whole lines until this many characters")
    r = sub.add_parser("run", help="the measurement (module docstring)")
    r.add_argument(
        "--checkpoint",
        default="",
        help="default: train recipes/tiny.yaml into WORK/seed_<seed>/tiny first, once "
        "per seed (with a "
        "checkpoint, the seeds vary the fine-tunes and the sampled generation only)",
    )
    add_seed_flags(r, reuse=False)
    r.add_argument("--work", default="runs/self_distill", help="where the runs and generations go")
    r.add_argument("--pretrain-steps", type=int, default=750)
    r.add_argument("--pretrain-overrides", default="",
                   help="key=value ... for a smaller pretraining (flavor=debug)")
    r.add_argument("--corpus-bytes", type=int, default=0,
                   help="stdlib corpus bytes read (0: all, as the recipe)")
    r.add_argument("--ft-steps", type=int, default=150,
                   help="steps of every MTP fine-tune (a, b, c, refresh)")
    r.add_argument("--batch", type=int, default=8, help="micro-batch of every fine-tune")
    r.add_argument("--seq-len", type=int, default=256)
    r.add_argument("--K", type=int, default=3, help="MTP depths trained and drafted")
    r.add_argument("--gen-prompts", type=int, default=256,
                   help="prompts generated from (one per file)")
    r.add_argument("--gen-tokens", type=int, default=192, help="new tokens per generated response")
    r.add_argument("--prompt-chars", type=int, default=200,
                   help="generation prompts: whole lines to this length")
    r.add_argument("--trunk-steps", type=int, default=200,
                   help="refresh scenario's trunk fine-tune (0: skip it)")
    r.add_argument("--trunk-lr", type=float, default=1e-3)
    r.add_argument("--refresh-package", default="setuptools",
                   help="installed package the trunk moves to")
    r.add_argument("--eval-prompts", type=int, default=32)
    r.add_argument("--prompt-len", type=int, default=64)
    r.add_argument("--eval-tokens", type=int, default=48)
    r.add_argument("--eval-bytes", type=int, default=400_000,
                   help="cap on pip/_internal's bytes read")
    r.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "prompts":
        from tandem.data_pipeline.stdlib_corpus import stdlib_files

        files = code_files(a.source_dir, 1 << 40) if a.source_dir else stdlib_files()[1]
        write_jsonl(a.out, [{"text": t} for t in make_prompts(files, a.count, a.prompt_chars)])
        print(f"wrote {a.out}")
        return 0
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
