"""docs/configuration.md is generated from the config docstrings (tandem.trainer.config_docs) and
must stay current: every key of the typed tree, with its type, default and docstring, as the code
has it."""

from __future__ import annotations

import dataclasses
import os

from tandem.trainer import config_docs
from tandem.trainer.config import TandemConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "configuration.md")


def _keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = prefix + config_docs.public_name(f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(value, key + ".")
        else:
            yield key


def test_committed_page_equals_the_generated_one():
    with open(PAGE) as f:
        committed = f.read()
    assert committed == config_docs.render(), (
        "docs/configuration.md is stale: run `python -m tandem.trainer.config_docs --write` and "
        "commit it")


def test_every_key_is_rendered_with_its_docstring():
    text = config_docs.render()
    keys = list(_keys(TandemConfig()))
    assert len(keys) > 100 and "mtp.loss.lambda" in keys and "train.max_steps" in keys
    for key in keys:
        assert f"- **`{key}`** · `" in text, key
    # the docstring under the field, not a neighbour's
    dtype = text.split("- **`train.dtype`**", 1)[1].split("\n- **", 1)[0]
    assert "`str` · default `\"auto\"`" in dtype and "bf16 autocast" in dtype
    assert "## `mtp.loss`" in text and "written `mtp.loss.lambda` in recipes" in text


def test_field_docs_reads_the_literal_under_each_field():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """First."""
        b: str = "x"
        c: float = 0.5
        """Third,
        on two lines."""

    assert config_docs.field_docs(Example) == {"a": "First.", "c": "Third,\non two lines."}
    assert config_docs.field_types(Example) == {"a": "int", "b": "str", "c": "float"}
