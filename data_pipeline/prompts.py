"""Prompt sets: what `tandem generate`, `tandem eval --prompts` and the evaluator's public suites
read.

A JSONL file of `{"text": ...}` or `{"messages": [{"role": ..., "content": ...}, ...]}` per line
(blank lines skipped), or a parquet file / a local `datasets` directory (`save_to_disk`; a
DatasetDict's train split) whose `column` holds a string (text) or a list of messages per row, read
as `data.source=jsonl` reads its records. Chat prompts are rendered with the checkpoint's chat
template (data_pipeline/chat_template.py, as training records are, with the generation prompt
added) and tokenized with the template's special tokens recognised.
Every problem is a PromptError of one line naming FILE:LINE (`FILE:row N` for a table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from .chat import iter_records
from .chat_template import render_chat

PromptValue = Union[str, List[dict]]


class PromptError(ValueError):
    """A bad prompt set, in one line naming FILE:LINE (the commands exit with status 2)."""


@dataclass
class Prompt:
    """One prompt of the set: where it came from and what it is."""

    where: str
    """`FILE:LINE` (JSONL) or `FILE:row N` (a table): where error messages point."""
    value: PromptValue
    """The text, or the chat messages."""

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.value, str)


def _check_messages(value, where: str) -> List[dict]:
    """`value` if it is a non-empty list of {role, content} string objects."""
    if not isinstance(value, list) or not value:
        raise PromptError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", "
                          "\"content\"} objects")
    for msg in value:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"),
                                                       str) or not isinstance(msg.get("content"),
                                                                              str):
            raise PromptError(f"{where}: each message must be an object with string \"role\" and "
                              "\"content\"")
    return value


def _prompt_of(value, where: str) -> PromptValue:
    """A table cell or a JSON field as a prompt: a non-empty string, or a messages list."""
    if isinstance(value, str):
        if not value:
            raise PromptError(f"{where}: empty prompt text")
        return value
    if hasattr(value, "tolist"):  # a numpy array of messages from parquet
        value = value.tolist()
    return _check_messages(value, where)


def _jsonl_prompt(rec, where: str) -> PromptValue:
    """A JSONL record's prompt: its `messages`, else its `text`."""
    if isinstance(rec, dict) and "messages" in rec:
        return _check_messages(rec["messages"], where)
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return _prompt_of(rec["text"], where)
    raise PromptError(f"{where}: neither {{\"text\": string}} nor {{\"messages\": [...]}}")


def read_prompts(path: str, column: str = "text") -> List[Prompt]:
    """The prompt set of `path` (JSONL, parquet or a `datasets` directory, read as
    `data.source=jsonl` reads records: chat.iter_records); PromptError naming FILE:LINE
    otherwise."""
    if not os.path.exists(path):
        raise PromptError(f"--prompts {path}: no such file or directory")
    table = os.path.isdir(path) or path.lower().endswith(".parquet")
    if column != "text" and not table:  # (any JSONL name: .json.gz and .JSONL went unnoticed)
        raise PromptError(f"--column {column}: a JSONL prompt file's prompts are its records' "
                          "text or messages; --column names a parquet file's or a datasets "
                          "directory's column")
    out = []
    try:
        for where, rec in iter_records([path]):
            if not table:
                out.append(Prompt(where, _jsonl_prompt(rec, where)))
            elif column not in rec:
                raise PromptError(f"--prompts {path}: no column {column!r} (columns: "
                                  f"{', '.join(rec)}); "
                                    "pass --column")
            else:
                out.append(Prompt(where, _prompt_of(rec[column], where)))
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(
            f"--prompts {path}: cannot read ({exc.__class__.__name__}: {exc})"
        ) from None
    if not out:
        raise PromptError(f"--prompts {path}: holds no prompts")
    return out


def tokenize_prompts(prompts: List[Prompt], tok, chat: Optional[dict], limit: int,
                     limit_note: str) -> Tuple[List[str], List[List[int]]]:
    """(prompt texts, token ids) of every prompt; a chat prompt without a template, an empty one or
    one longer than `limit` tokens is a PromptError naming FILE:LINE."""
    texts, ids = [], []
    for p in prompts:
        where = p.where
        if p.is_chat:
            if chat is None:
                raise PromptError(f"{where}: a chat prompt (\"messages\"), but the checkpoint's "
                                  "tokenizer has no "
                                    "chat template (no \"chat_template\" in a "
                                    "tokenizer_config.json)")
            try:
                text = render_chat(chat, p.value)
            except Exception as exc:
                raise PromptError(f"{where}: the chat template ({chat['path']}) failed: "
                                    f"{' '.join(str(exc).split())[:200]}") from None
            row = tok.encode_rendered(text)[0]
        else:
            text, row = p.value, tok.encode(p.value, start=True)
        if not row or len(row) > limit:
            raise PromptError(f"{where}: prompt is {len(row)} tokens; 1 to {limit} fit "
                              f"({limit_note})")
        texts.append(text)
        ids.append(row)
    return texts, ids
