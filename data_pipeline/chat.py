"""Prompt/response and chat records -> token ids with a per-token response flag (the loss mask's
source).

Records (one per JSONL line, parquet row or `datasets` row), first matching form wins:
  * `{"messages": [{"role", "content"}, ...]}`: rendered with the tokenizer's chat template (a local
    Hugging Face tokenizer directory's `chat_template.jinja` / `tokenizer_config.json`, rendered by
    data_pipeline/chat_template.py as prompt sets are); the loss is on the assistant turns (their
    content and the template's end-of-turn text), nothing else.
  * `{"prompt_ids", "response_ids"}` (what `tandem generate` writes beside the text): the token ids
    as written, so the fine-tune sees exactly the tokens the trunk produced; the loss is on the
    response, and on the EOD appended after one that does not end with it unless the record says
    `"finished"` (false: cut off, not ended; true: ended at another stop id, which it holds).
  * `{"prompt", "response"}`: with a chat template, one user turn and one assistant turn (as
    `messages`); without one, prompt and response are tokenised separately and joined (ids of the
    prompt, then ids of the response), so the boundary is exact and matches how `tandem generate`
    continues a prompt. The loss is on the response.
  * `{"text"}`: a plain document, every token counted (pretraining text mixed into the data).
Each record then ends with the tokenizer's EOD (appended unless it already ends with it), whose flag
is the last token's: a response's end is learnt, so generation stops.

`ChatEncoder.encode` returns `(ids, response)`: int64 token ids and a uint8 flag per token, 1 where
the token is a target that counts. The loss mask of a window is the flag of each *target* (token
t+1); the data layer pairs it with record ordinals as `doc_ids`, so no target (any MTP depth)
crosses into another record (models/mtp.py `depth_target_mask`). Bad records raise
`ValueError("FILE:LINE: ...")`.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from tandem.data_pipeline import preprocess
from tandem.data_pipeline.chat_template import chat_template_in, render_chat
from tandem.data_pipeline.records import (
    JSON_EXT,
    PARQUET_EXT,
    json_records,
    parquet_records,
    utf8_text,
)
from tandem.data_pipeline.saved_datasets import saved_records
from tandem.data_pipeline.tokenizer import TandemTokenizer

LOSS_MASK_SUFFIX = "_loss_mask"
"""`<prefix>_loss_mask.bin/.idx`: the loss-mask channel `tandem preprocess --chat` writes beside the
tokens."""
FORMS = "{prompt, response}, {messages: [...]}, {prompt_ids, response_ids} or {text}"


def expand_paths(paths: Sequence[str]) -> List[str]:
    """Files, `datasets` directories and globs -> existing paths in order; FileNotFoundError names a
    miss."""
    return preprocess.expand_paths(paths, "data file not found",
                                   "no chat data files given (data.paths)")


def iter_records(paths: Sequence[str]) -> Iterator[Tuple[str, object]]:
    """Yield `(where, record)` of every record: `where` is `FILE:LINE` (JSONL) or `FILE:row N`."""
    for path in expand_paths(paths):
        low = path.lower()
        if os.path.isdir(path):
            yield from saved_records(path)
        elif low.endswith(PARQUET_EXT):
            yield from parquet_records(path)
        elif low.endswith(JSON_EXT):
            yield from json_records(path)
        else:
            raise ValueError(f"{path}: not a chat data file (.jsonl, .json, .parquet or a "
                             "`datasets` directory)")


def record_form(where: str, rec) -> str:
    """The form of `rec` (`messages`, `ids`, `prompt`, `text`), or ValueError naming `where` (also
    for text that is no UTF-8: a JSON escape of a lone surrogate, which the tokenizer fails on)."""
    form = _form(where, rec)
    texts = ([m["content"] for m in rec["messages"]] if form == "messages"
             else [rec[k] for k in ("prompt", "response", "text") if isinstance(rec.get(k), str)])
    for text in texts:
        utf8_text(where, text)
    return form


def _form(where: str, rec) -> str:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object with {FORMS}")
    if rec.get("messages") is not None:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"),
                                                   str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise ValueError(f"{where}: messages must be a list of {{role, content}} objects with "
                             "string values")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: messages have no assistant turn (nothing to train on)")
        return "messages"
    if rec.get("prompt_ids") is not None and rec.get("response_ids") is not None:
        if not all(isinstance(x, list) and all(isinstance(i, int) for i in x)
                   for x in (rec["prompt_ids"], rec["response_ids"])):
            raise ValueError(f"{where}: prompt_ids and response_ids must be lists of integers")
        return "ids"
    if rec.get("prompt") is not None and rec.get("response") is not None:
        if not (isinstance(rec["prompt"], str) and isinstance(rec["response"], str)):
            raise ValueError(f"{where}: prompt and response must be strings")
        return "prompt"
    if isinstance(rec.get("text"), str):
        return "text"
    raise ValueError(f"{where}: a record needs {FORMS}; found keys: "
                     f"{', '.join(map(str, rec)) or 'none'}")


class ChatEncoder:
    """Encodes records of every form with one tokenizer and (optionally) its chat template."""

    def __init__(self, tokenizer: TandemTokenizer, template: Optional[dict] = None) -> None:
        self.tokenizer = tokenizer
        self.template = template  # data_pipeline/chat_template.chat_template_in's, or None
        if template is not None and tokenizer.backend is None:
            raise ValueError(f"tokenizer {tokenizer.path}: chat data needs a fast tokenizer "
                             "(tokenizer.json)")

    def check(self, where: str, rec: dict, form: str) -> None:
        """Raise what `encode` would, short of tokenising (`form`: record_form's): a form that
        needs a chat template this tokenizer lacks, token ids outside the vocabulary, and a
        conversation the template fails on or renders without its assistant turns (rendered here,
        so a bad record late in a file fails before any is tokenised)."""
        if form == "messages" and self.template is None:
            raise ValueError(f"{where}: messages need a chat template, and tokenizer "
                             f"{self.tokenizer.path} has none "
                             "(use a Hugging Face tokenizer directory whose tokenizer_config.json "
                             "has chat_template)")
        if form == "ids":
            bad = [i for i in rec["prompt_ids"] + rec["response_ids"]
                   if not 0 <= i < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside tokenizer "
                                 f"{self.tokenizer.path}'s "
                                 f"vocabulary of {self.tokenizer.vocab_size}")
        elif self._templated(form):
            self._spans(where, self._messages(rec, form))

    def _templated(self, form: str) -> bool:
        return form == "messages" or (form == "prompt" and self.template is not None)

    @staticmethod
    def _messages(rec: dict, form: str) -> List[dict]:
        if form == "messages":
            return rec["messages"]
        return [{"role": "user", "content": rec["prompt"]},
                {"role": "assistant", "content": rec["response"]}]

    def encode(self, where: str, rec: dict, form: str) -> Tuple[np.ndarray, np.ndarray]:
        """(ids int64, response flags uint8) of one record, EOD-terminated."""
        if self._templated(form):
            full, spans = self._spans(where, self._messages(rec, form))
            ids, offsets = self.tokenizer.encode_rendered(full)
            flags = [int(any(start < b and a < end for a, b in spans)) for start, end in offsets]
        elif form == "ids":
            ids = list(rec["prompt_ids"]) + list(rec["response_ids"])
            flags = [0] * len(rec["prompt_ids"]) + [1] * len(rec["response_ids"])
        elif form == "prompt":
            prompt = self.tokenizer.encode(rec["prompt"], start=True)
            response = self.tokenizer.encode(rec["response"])
            ids, flags = prompt + response, [0] * len(prompt) + [1] * len(response)
        else:
            ids = self.tokenizer.encode(rec["text"], start=True)
            flags = [1] * len(ids)
        if not ids or ids[-1] != self.tokenizer.eod_id:
            # a response cut off by generate's token budget (`finished: false`) did not end there;
            # one generate saw end at another stop id (`finished: true`, a chat model's end of
            # turn) ended with it; a template that ends each turn with the EOD (ChatML's
            # `<|im_end|>\n` where it is the EOS) has ended it: the EOD after any of these only
            # separates documents (learnt, it taught every depth a second end after the turn's)
            ends = (bool(flags and flags[-1]) and "finished" not in rec
                    and not (self._templated(form) and self.tokenizer.eod_id in ids))
            flags = flags + [int(ends)]
            ids = ids + [self.tokenizer.eod_id]
        return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=np.uint8)

    def _spans(self, where: str, msgs: List[dict]) -> Tuple[str, List[Tuple[int, int]]]:
        """(the rendered conversation, each assistant turn's character span in it): the span is
        the text that rendering the turn adds after the conversation before it with the generation
        prompt (so the header is not learnt). `encode` flags the tokens that overlap a span: a
        byte-level BPE joins a word to the space before it, so a response's first token starts
        where a header ending in a space ends (`<|assistant|> `), one character before the
        span."""
        try:
            full = self._text(msgs, False)
            spans, cursor = [], 0
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                before = self._text(msgs[:i], True) if i else ""
                upto = self._text(msgs[: i + 1], False)
                # a template that ignores add_generation_prompt renders the header in the turn:
                # the turn is then its content (and end-of-turn), as _turn_in finds it
                plain = self._text(msgs[:i], False) if i else ""
                # a first turn has no conversation before it to prompt: its span is searched,
                # or the header (and a template's default system turn) before it were targets
                prompted = before != plain
                if prompted and full.startswith(upto) and upto.startswith(before):
                    span = (len(before), len(upto))
                else:
                    # the turn's content is searched after its header (the text the generation
                    # prompt adds), not from the previous turn's end: a user message quoting the
                    # reply matched first, and trained instead of it
                    header = before[len(plain):] if before.startswith(plain) else ""
                    at = full.find(header, cursor) if header else -1
                    span = _turn_in(full, at + len(header) if at >= 0 else cursor, m["content"],
                                    upto)
                if span is None:
                    raise ValueError(f"{where}: cannot find assistant turn {i + 1} in the "
                                     "conversation the chat "
                                     f"template of {self.tokenizer.path} renders")
                spans.append(span)
                cursor = span[1]
        except ValueError:
            raise
        except Exception as exc:  # jinja's TemplateError, raise_exception() of the template itself
            raise ValueError(f"{where}: the chat template failed: "
                             f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
                             ) from None
        return full, spans

    def _text(self, msgs: List[dict], generation_prompt: bool) -> str:
        return render_chat(self.template, msgs, generation_prompt)


def _turn_in(full: str, cursor: int, content: str, upto: str) -> Optional[Tuple[int, int]]:
    """An assistant turn's span in `full` when the template renders it otherwise as the last turn
    than as an earlier one (Qwen3 drops the reasoning block of earlier turns, so the conversation
    before a turn is no prefix of the whole): the turn's content, searched from `cursor`, plus the
    end-of-turn text that follows it when it is last (`upto`'s tail after the content)."""
    pos = full.find(content, cursor) if content else -1
    if pos < 0:
        return None
    end = pos + len(content)
    tail = upto[upto.rfind(content) + len(content):]
    return pos, end + (len(tail) if tail and full.startswith(tail, end) else 0)


def check_files(paths: Sequence[str], encoder: ChatEncoder) -> int:
    """Read and check every record of `paths` (ChatEncoder.check) without tokenising: a bad line
    fails in one line before any expensive work. Returns the number of records."""
    count = 0
    for where, rec in iter_records(paths):
        encoder.check(where, rec, record_form(where, rec))
        count += 1
    if not count:
        raise ValueError(f"no records in {', '.join(map(str, paths))}")
    return count


def iter_encoded(paths: Sequence[str],
                 encoder: ChatEncoder) -> Iterator[Tuple[str, np.ndarray, np.ndarray]]:
    """`(where, ids, flags)` of every record of `paths`, in order (run `check_files` first)."""
    for where, rec in iter_records(paths):
        yield (where, *encoder.encode(where, rec, record_form(where, rec)))


def chat_encoder(tokenizer: TandemTokenizer, tokenizer_path: Optional[str]) -> ChatEncoder:
    """A `ChatEncoder` for `tokenizer`, with the chat template of the directory it came from if
    any."""
    path = os.path.expanduser(str(tokenizer_path or tokenizer.path or ""))
    # a tokenizer directory's chat template (a bare tokenizer.json has none)
    return ChatEncoder(tokenizer, chat_template_in([path]) if os.path.isdir(path) else None)
