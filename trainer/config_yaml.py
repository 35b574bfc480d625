"""The config's YAML: recipes, override values and a run's or a checkpoint's config.yaml are read
with YAML 1.2's core scalars, and config.yaml is written so that it reads back the same.

PyYAML follows YAML 1.1, which reads `parallel.pp_layout=[010,2]` as [8, 2], `[1:0]` as [60] (base
60) and `off` as false, silently; 1.2 reads 010 as 10, and the others stay text, which a number or
boolean key then refuses or reads by name. Kept apart from trainer/recipe.py, which imports the
model flavors and with them torch: `tandem report` reads config.yaml files and imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any

import yaml

from .config_checks import ConfigError


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core scalars: integers in base 10 (`0o` octal and `0x`
    hex as written), floats with an optional dot (`3e-4`), booleans true/false only, no
    timestamps; a key given twice in one mapping is refused, as omegaconf's loader refuses it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT, _BOOL, _TIME = (f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool",
                                                                  "timestamp"))
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT, _BOOL, _TIME)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(  # before the float: plain digits are an integer
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_Yaml12Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
                           |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
_Yaml12Loader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    return int(text[2:] if base != 10 else text, base)


_Yaml12Loader.add_constructor(_INT, _yaml12_int)


def read_yaml(text_or_file: Any) -> Any:
    """A YAML document (text or an open file) as plain Python values, with YAML 1.2's scalars
    (`_Yaml12Loader`)."""
    return yaml.load(text_or_file, Loader=_Yaml12Loader)


def read_yaml_mapping(path: str, named: str, error: type = ConfigError,
                      empty_ok: bool = True) -> dict:
    """The YAML file at `path` as a dict of config sections (`read_yaml`), for a recipe, a run's or
    a checkpoint's config.yaml: an empty (or comments-only) file is {} when `empty_ok`; anything
    else that is not a mapping, and bad YAML (with its line, on one line), raise `error` with a
    message starting with `named` (`recipe PATH`, `checkpoint config PATH`)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = read_yaml(f)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # yaml's span lines: one, with the line
        raise error(f"{named} is not valid YAML: {' '.join(str(exc).split())}") from None
    if raw is None and empty_ok:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{named} is not a mapping of config sections")
    return raw


def dump_yaml(container: Any) -> str:
    """Plain Python values (a config's container) as block-style YAML that `read_yaml` reads back
    the same (`_Yaml12Dumper`), keys in their order."""
    return yaml.dump(container, Dumper=_Yaml12Dumper, default_flow_style=False,
                     allow_unicode=True, sort_keys=False)


class _Yaml12Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, which quotes every text a YAML 1.1 reader would read as something else
    (`off`, `010`), quoting as well every text that `read_yaml` would (`0o17`: an integer in YAML
    1.2), so a run's config.yaml reads back the same under both."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    node = dumper.represent_str(text)
    try:
        reads_back = read_yaml(text) == text
    except yaml.YAMLError:
        reads_back = False
    if node.style is None and not reads_back:
        node.style = "'"
    return node


_Yaml12Dumper.add_representer(str, _represent_text)
