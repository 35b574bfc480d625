"""`tandem generate`'s output: the JSONL it writes (and resumes).

Prompts: data_pipeline/prompts.py (what `tandem eval --prompts` reads too).

Output. One record per line: `prompt_index`, `sample_index`, `prompt` (a chat prompt's rendered
text), `response`, `prompt_ids`, `response_ids` (ending with the end-of-document token when the
response finished), `finished` and the row's `acceptance_length`: what `data.source=jsonl` reads
(its `{prompt_ids, response_ids}` form). The sidecar `OUT.meta.json` holds what the records depend
on: the sampling settings, the checkpoint's fingerprint and a digest of the tokenized prompts. A
rerun refuses when the sidecar differs (other settings, checkpoint or prompts), drops a torn last
line, and continues after the records already there.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import List, Tuple

from .files import naming, parent_problem, write_replacing


class GenerateError(ValueError):
    """A problem with `tandem generate`'s output file, in one line (exit status 2)."""


def prompts_digest(ids: List[List[int]]) -> str:
    """sha256 of the tokenized prompt set: a rerun on other prompts must not append to this file."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


# --- the output file ------------------------------------------------------------------------------
INFORMATIONAL = ("checkpoint",)
"""Header keys a rerun may change: the checkpoint's path (a copied checkpoint has the same
fingerprint)."""


def meta_path(out: str) -> str:
    """The sidecar holding the settings a file of records was written with."""
    return f"{out}.meta.json"


def read_output(path: str, header: dict) -> Tuple[List[dict], bool]:
    """(records already in `path`, whether its last line was torn); ([], False) when there are none.
    GenerateError when `path` holds records and `path.meta.json` differs from `header` (other
    settings, checkpoint or prompts) or is missing (not this command's file)."""
    problem = parent_problem(path)
    if problem:  # (a write's "[Errno 17] File exists" said to run it again, which never helps)
        raise GenerateError(f"--out {path}: {problem}")
    has_records = os.path.exists(path) and os.path.getsize(path) > 0
    meta = meta_path(path)
    if not os.path.exists(meta):
        if has_records:
            raise GenerateError(f"--out {path}: exists without {meta} (not written by tandem "
                                "generate); "
                                "pass another --out")
        return [], False
    try:
        with open(meta, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerateError(
            f"{meta}: unreadable ({exc.__class__.__name__}); pass another --out"
        ) from None
    if not isinstance(saved, dict):
        raise GenerateError(f"{meta}: not a JSON object (not written by tandem generate); pass "
                            "another --out")
    diff = sorted(k for k in set(saved) | set(header) if k not in INFORMATIONAL
                  and saved.get(k) != header.get(k))
    if diff and has_records:  # (a sidecar without records is rewritten: a run that failed first)
        raise GenerateError(f"--out {path} was written with other settings or checkpoint "
                            f"({', '.join(diff)} "
                            f"differ in {meta}); pass another --out or the same settings")
    if not has_records:
        return [], False
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    torn = lines[-1] != ""  # a killed write leaves a last line without its newline
    records = []
    for n, line in enumerate(lines[:-1], 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise GenerateError(
                f"{path}:{n}: not a JSON record (only the last line may be torn)"
            ) from None
    return records, torn


def write_lines(path: str, rows: List[dict], mode: str) -> None:
    """Write (`w`) or append (`a`) JSON lines and make them durable before returning: a kill after
    this loses nothing written here."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with naming(path), open(path, mode, encoding="utf-8") as f:  # a full disk's error names none
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def rewrite_output(path: str, header: dict, records: List[dict]) -> None:
    """Write the sidecar, then replace `path` by `records`, each atomically (a kill leaves the old
    or the new file, never a part)."""
    for target, write in ((meta_path(path), lambda f: json.dump(header, f, indent=1)),
                          (path,
                           lambda f: f.write("".join(json.dumps(r) + "\n" for r in records)))):
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        write_replacing(target, write)
