"""`tandem generate`'s files: the prompt set it reads and the JSONL it writes (and resumes).

Prompts. A JSONL file of `{"text": ...}` or `{"messages": [{"role": ..., "content": ...}, ...]}` per
line (blank lines skipped), or a parquet file / a local `datasets` directory (`save_to_disk`; a
DatasetDict's train split) whose `column` holds a string (text) or a list of messages per row, read
as `data.source=jsonl` reads its records. Chat prompts are rendered with the
checkpoint's chat template (`chat_template` of a `tokenizer_config.json`: jinja2 in a sandbox, as
transformers renders it, with the generation prompt added) and tokenized with the template's special
tokens recognised. Every problem is one line naming FILE:LINE (`FILE:row N` for a table).

Output. One record per line: `prompt_index`, `sample_index`, `prompt` (a chat prompt's rendered
text), `response`, `prompt_ids`, `response_ids` (ending with the end-of-document token when the
response finished), `finished` and the row's `acceptance_length`: what `data.source=jsonl` reads (its
`{prompt_ids, response_ids}` form). The sidecar `OUT.meta.json` holds what the records depend on: the
sampling settings, the checkpoint's fingerprint and a digest of the tokenized prompts. A rerun
refuses when the sidecar differs (other settings, checkpoint or prompts), drops a torn last line, and
continues after the records already there.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

PromptValue = Union[str, List[dict]]


class GenerateError(ValueError):
    """A problem `tandem generate` reports in one line (exit status 2)."""


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
        raise GenerateError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for msg in value:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise GenerateError(f"{where}: each message must be an object with string \"role\" and \"content\"")
    return value


def _prompt_of(value, where: str) -> PromptValue:
    """A table cell or a JSON field as a prompt: a non-empty string, or a messages list."""
    if isinstance(value, str):
        if not value:
            raise GenerateError(f"{where}: empty prompt text")
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
    raise GenerateError(f"{where}: neither {{\"text\": string}} nor {{\"messages\": [...]}}")


def read_prompts(path: str, column: str = "text") -> List[Prompt]:
    """The prompt set of `path` (JSONL, parquet or a `datasets` directory, read as `data.source=jsonl`
    reads records: data_pipeline/chat.py iter_records); GenerateError naming FILE:LINE otherwise."""
    from tandem.data_pipeline.chat import iter_records

    if not os.path.exists(path):
        raise GenerateError(f"--prompts {path}: no such file or directory")
    table = os.path.isdir(path) or path.lower().endswith(".parquet")
    out = []
    try:
        for where, rec in iter_records([path]):
            if not table:
                out.append(Prompt(where, _jsonl_prompt(rec, where)))
            elif column not in rec:
                raise GenerateError(f"--prompts {path}: no column {column!r} (columns: {', '.join(rec)}); "
                                    "pass --column")
            else:
                out.append(Prompt(where, _prompt_of(rec[column], where)))
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerateError(f"--prompts {path}: cannot read ({exc.__class__.__name__}: {exc})") from None
    if not out:
        raise GenerateError(f"--prompts {path}: holds no prompts")
    return out


# --- chat template ----------------------------------------------------------------------------------
def chat_template_in(dirs: Sequence[str]) -> Optional[dict]:
    """The first `tokenizer_config.json` among `dirs` that has a chat template: {"template", the special
    tokens the template may name (bos_token, eos_token), "path"}; None when none has one."""
    for d in dirs:
        path = os.path.join(d, "tokenizer_config.json") if d else ""
        if not path or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            conf = json.load(f)
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: transformers picks "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}
            return {"template": template, "path": path, **special}
    return None


def _token_text(tok) -> str:
    return tok.get("content", "") if isinstance(tok, dict) else (tok or "")


def render_chat(chat: dict, messages: List[dict]) -> str:
    """The prompt text of `messages` under the chat template, ending with the assistant's turn opening."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(chat["template"]).render(messages=messages, add_generation_prompt=True,
                                                    bos_token=chat["bos_token"], eos_token=chat["eos_token"])


def encode_with_specials(tok, text: str) -> List[int]:
    """Token ids of a rendered chat prompt, its special-token strings (`<|im_start|>`) as special tokens
    (TandemTokenizer.encode treats them as plain text, as a document's text must be)."""
    backend = tok.backend
    if backend is None:
        return list(tok._hf.encode(text, add_special_tokens=False))
    saved = backend.encode_special_tokens
    backend.encode_special_tokens = False
    try:
        return backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.encode_special_tokens = saved


def tokenize_prompts(prompts: List[Prompt], tok, chat: Optional[dict], limit: int,
                     limit_note: str) -> Tuple[List[str], List[List[int]]]:
    """(prompt texts, token ids) of every prompt; a chat prompt without a template, an empty one or one
    longer than `limit` tokens is a GenerateError naming FILE:LINE."""
    texts, ids = [], []
    for p in prompts:
        where = p.where
        if p.is_chat:
            if chat is None:
                raise GenerateError(f"{where}: a chat prompt (\"messages\"), but the checkpoint's tokenizer has no "
                                    "chat template (no \"chat_template\" in a tokenizer_config.json)")
            try:
                text = render_chat(chat, p.value)
            except Exception as exc:
                raise GenerateError(f"{where}: the chat template ({chat['path']}) failed: "
                                    f"{' '.join(str(exc).split())[:200]}") from None
            row = encode_with_specials(tok, text)
        else:
            text, row = p.value, tok.encode(p.value)
        if not row or len(row) > limit:
            raise GenerateError(f"{where}: prompt is {len(row)} tokens; 1 to {limit} fit ({limit_note})")
        texts.append(text)
        ids.append(row)
    return texts, ids


def prompts_digest(ids: List[List[int]]) -> str:
    """sha256 of the tokenized prompt set: a rerun on other prompts must not append to this file."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


# --- the output file ----------------------------------------------------------------------------------
INFORMATIONAL = ("checkpoint",)
"""Header keys a rerun may change: the checkpoint's path (a copied checkpoint has the same fingerprint)."""


def meta_path(out: str) -> str:
    """The sidecar holding the settings a file of records was written with."""
    return f"{out}.meta.json"


def read_output(path: str, header: dict) -> Tuple[List[dict], bool]:
    """(records already in `path`, whether its last line was torn); ([], False) when there are none.
    GenerateError when `path.meta.json` differs from `header` (other settings, checkpoint or prompts),
    or when `path` holds records but no sidecar (not this command's file)."""
    has_records = os.path.exists(path) and os.path.getsize(path) > 0
    meta = meta_path(path)
    if not os.path.exists(meta):
        if has_records:
            raise GenerateError(f"--out {path}: exists without {meta} (not written by tandem generate); "
                                "pass another --out")
        return [], False
    try:
        with open(meta, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise GenerateError(f"{meta}: unreadable ({exc.__class__.__name__}); pass another --out") from None
    diff = sorted(k for k in set(saved) | set(header) if k not in INFORMATIONAL and saved.get(k) != header.get(k))
    if diff:
        raise GenerateError(f"--out {path} was written with other settings or checkpoint ({', '.join(diff)} "
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
            raise GenerateError(f"{path}:{n}: not a JSON record (only the last line may be torn)") from None
    return records, torn


def write_lines(path: str, rows: List[dict], mode: str) -> None:
    """Write (`w`) or append (`a`) JSON lines and make them durable before returning: a kill after this
    loses nothing written here."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, mode, encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def rewrite_output(path: str, header: dict, records: List[dict]) -> None:
    """Write the sidecar, then replace `path` by `records`, each atomically (a kill leaves the old or
    the new file, never a part)."""
    for target, write in ((meta_path(path), lambda f: json.dump(header, f, indent=1)),
                          (path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records)))):
        tmp = f"{target}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
