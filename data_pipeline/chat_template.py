"""A checkpoint's chat template, found and rendered one way for everything that renders chat:
training records (data_pipeline/chat.py) and prompt sets (data_pipeline/prompts.py: `tandem
generate`, `tandem eval --prompts`, the evaluator's suites).

The template is a local tokenizer directory's `chat_template.jinja` (where transformers saves it)
or the `chat_template` of its `tokenizer_config.json` (never downloaded). It is rendered the way
transformers' `apply_chat_template` renders it: jinja2's sandbox with `trim_blocks` /
`lstrip_blocks` and the loop-controls extension, the `raise_exception` and `strftime_now` globals, a
`tojson` that keeps non-ASCII text, and the config's `bos_token` / `eos_token`
(tests/unit/test_chat_data.py compares the two renderers).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import List, Optional, Sequence


def chat_template_in(dirs: Sequence[str]) -> Optional[dict]:
    """The chat template of the first of `dirs` that has one: {"template", the special tokens the
    template may name (bos_token, eos_token, from tokenizer_config.json), "path" of the file it came
    from}; None when none has one. A `chat_template.jinja` wins over tokenizer_config.json's
    `chat_template`, as in transformers."""
    for d in dirs:
        if not d or not os.path.isdir(d):
            continue
        config_path = os.path.join(d, "tokenizer_config.json")
        conf = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                conf = json.load(f)
        path, template = config_path, conf.get("chat_template")
        if isinstance(template, list):  # named templates: transformers picks "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(d, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                path, template = jinja_path, f.read()
        if template:
            special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}
            return {"template": template, "path": path, **special}
    return None


def _token_text(tok) -> str:
    return tok.get("content", "") if isinstance(tok, dict) else (tok or "")


def render_chat(chat: dict, messages: List[dict], add_generation_prompt: bool = True) -> str:
    """The text of `messages` under the chat template; with `add_generation_prompt` it ends with
    the assistant's turn opening. jinja2's errors (and the template's own `raise_exception`) come
    out as jinja2.exceptions.TemplateError."""
    return _compiled(chat["template"]).render(messages=messages,
                                              add_generation_prompt=add_generation_prompt,
                                              bos_token=chat["bos_token"],
                                              eos_token=chat["eos_token"])


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """One compiled template per text: a training corpus renders every record with it."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)
