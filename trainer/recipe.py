"""Recipes and overrides into the typed config tree (trainer/config.py), and the resolved config
out.

`load_config(recipe, overrides)` composes a recipe with command-line overrides, rejects unknown keys
and wrong types with a one-line error naming the key, and validates before any work starts: each
section's `validate` method, beside its fields (the model's in models/config.py, the MTP module's
in models/mtp_config.py), then the checks that span sections (`TandemConfig.validate`).
`mtp.loss.lambda` is the public spelling of the field `lambda_` (a Python keyword cannot be a
field).

Composition, lowest layer first: the dataclass defaults; for the recipe, its `base:` recipes (each
composed the same way, in order), its model `flavor:` (models/flavors.py), its own sections; then
the `key=value` overrides in order, where `flavor=NAME` stands for that flavor's keys at that
position. Two top-level recipe keys compose rather than configure, and never reach the resolved
config:

    base: qwen38_flash_gpu.yaml      # or a list; a path relative to this recipe's directory
    flavor: qwen38_flash             # a named model shape from models/flavors.py

Sections merge key by key through the layers (OmegaConf.merge); a value, a list or a mapping-valued
key (`mtp.loss.lambda_after`) replaces the one beneath it. An override's value is read as YAML,
but for a string key, whose text is taken as written (YAML would drop ` #2` from a path as a
comment), matching quotes removed. Recipes and override values are read with YAML 1.2's scalars
(`read_yaml`), not PyYAML's 1.1: `010` is 10 in a list too, and `1:0` or `off` stay text.
The resolved config (`to_yaml`, a run's config.yaml) is complete and self-contained.
"""

from __future__ import annotations

import os
from dataclasses import is_dataclass
from typing import Any, FrozenSet, List, Optional, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import StringNode

from tandem.models import flavors

from .config import TandemConfig
from .config_checks import ConfigError
from .config_yaml import dump_yaml, read_yaml, read_yaml_mapping

# Public key -> dataclass field, for names Python cannot use as fields.
SHIPPED_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "recipes")
"""The recipes Tandem ships (named in the error for a recipe path that is not found from here)."""
_ALIASES = {"lambda": "lambda_"}
_PUBLIC = {v: k for k, v in _ALIASES.items()}


def _rename_keys(node: Any, table: dict) -> Any:
    if isinstance(node, dict):
        return {table.get(k, k) if isinstance(k, str) else k: _rename_keys(v, table) for k,
                v in node.items()}
    if isinstance(node, list):
        return [_rename_keys(v, table) for v in node]
    return node


_RETIRED = {
    "eval.temperature": ("greedy decoding always runs now; list sampled temperatures in "
                         "eval.temperatures", lambda v: v in (0, 0.0, "0", "0.0")),
    # either value did the same: Megatron's mask of a target whose input is an EOD is a subset of
    # the model's own
    "data.eod_mask_loss": ("a target whose input is an end of document is never trained: every "
                           "target across a document boundary is masked at every depth",
                           lambda v: str(v).strip().lower() in ("true", "false")),
}
"""Keys that left the schema: (what replaces them, the values a config may still hold). A config
that holds one of those (the run configs checkpoints saved before: `eval.temperature: 0.0`,
`data.eod_mask_loss: false`) loads with it dropped; any other value is an error naming the
replacement."""


def _drop_retired(key: str, value: Any) -> bool:
    """True when `key` is retired and may be dropped; raises ConfigError when its value asked for
    more."""
    if key not in _RETIRED:
        return False
    why, droppable = _RETIRED[key]
    if droppable(value):
        return True
    raise ConfigError(f"config key '{key}'={value!r} is no longer supported: {why}")


def _override_key(item: str) -> str:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key = item.split("=", 1)[0].lstrip("+")
    if key.startswith("~"):  # Hydra's deletion, which the lstrip once turned into a set
        raise ConfigError(f"override {item!r}: deleting a key is not supported; set it to its "
                          "default, or to {} / [] / nothing for an empty value")
    if not all(key.split(".")):
        raise ConfigError(f"override {item!r} names no key, or a key with an empty part "
                          "(the form is section.key=value)")
    return ".".join(_ALIASES.get(part, part) for part in key.split("."))


def _refuse_a_section_value(schema: Any, key: str, value: str) -> None:
    """`train=5` would reach omegaconf's merge and fail there with a message naming a class."""
    node = OmegaConf.select(schema, key, default=None)
    if (isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node))
            and not value.strip().startswith("{")):
        raise ConfigError(f"config key '{key}' is a section, not a value: set its keys "
                          f"({key}.KEY=VALUE)")


def _override_layer(schema: Any, key: str, value: str) -> Any:
    """`key=value` as a config layer: YAML, but a string key's text as written."""
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(schema, parent, default=None) if parent else schema
    if isinstance(section, ListConfig):  # `key.0=v`: omegaconf's merge raised a TypeError
        raise ConfigError(f"config key '{parent}' is a list, set whole: {parent}=[...]")
    if isinstance(section, DictConfig) and not is_dataclass(OmegaConf.get_type(section)):
        raise ConfigError(f"config key '{parent}' is a mapping, set whole: "
                          f"{parent}={{{leaf}: {value.strip()}}}")
    node = section._get_node(leaf) if isinstance(section, DictConfig) else None
    text = value.strip()
    layer: Any
    if not isinstance(node, StringNode) or (text in ("null", "~") and node._is_optional()):
        # YAML 1.2 (`read_yaml`: 010 is 10); a section set whole (`mtp.loss={lambda: 0.2}`)
        # spells keys as recipes do
        layer = _rename_keys(read_yaml(value), _ALIASES)
    elif text in ("null", "~"):  # YAML's null, which this key cannot hold: not a name or a path
        raise ConfigError(f"config key '{key}' is text and cannot be null: write {key}= for empty, "
                          f"or {key}='{text}' for the text")
    else:
        # as written, `${...}` too: omegaconf resolved it (`${oc.env:TOKEN}` put a secret in
        # config.yaml)
        layer = _literal(text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
                         else text)
    for part in reversed(key.split(".")):
        layer = {part: layer}
    return OmegaConf.create(layer)


def _mapping_keys(node: Any, prefix: str = "") -> List[str]:
    """The schema's mapping-valued keys (a `Dict` field, not a section)."""
    keys = []
    for name in node:
        child = node._get_node(name)
        if isinstance(child, DictConfig):
            path = f"{prefix}{name}"
            keys += (_mapping_keys(child, path + ".") if is_dataclass(OmegaConf.get_type(child))
                     else [path])
    return keys


RECIPE_KEYS = ("base", "flavor")
"""Top-level recipe keys that compose the recipe (see the module docstring); not config keys."""


def _read_recipe(path: str) -> dict:
    """One recipe file as a plain dict, retired keys at their old defaults dropped. Raises
    ConfigError."""
    raw = read_yaml_mapping(path, f"recipe {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.create(raw), resolve=False)
    except Exception as exc:  # a key omegaconf refuses (not a text)
        raise ConfigError(f"recipe {path}: {' '.join(str(exc).split())}") from None
    for key in _RETIRED:
        section, leaf = key.split(".")
        if isinstance(raw.get(section),
                      dict) and leaf in raw[section] and _drop_retired(key, raw[section][leaf]):
            del raw[section][leaf]
    return raw


def _flavor_layer(name: Any, where: str) -> dict:
    if not isinstance(name, str):
        raise ConfigError(f"{where}: flavor must be the name of a model flavor, got {name!r}")
    try:
        return flavors.flavor(name)
    except flavors.UnknownFlavor as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _recipe_layers(path: str, chain: Sequence[str] = ()) -> List[tuple]:
    """[(source, layer dict)] of recipe `path`, lowest first: its bases' layers, its flavor, its
    body."""
    raw = _read_recipe(path)
    base, name = raw.pop("base", None), raw.pop("flavor", None)
    bases = [] if base is None else [base] if isinstance(base, str) else base
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"recipe {path}: base must be a recipe path or a list of them, got "
                          f"{base!r}")
    layers: List[tuple] = []
    here = os.path.realpath(path)
    for b in bases:
        parent = os.path.join(os.path.dirname(path), os.path.expanduser(b))
        if not os.path.isfile(parent):
            raise ConfigError(f"recipe {path}: base recipe not found: {parent}")
        if os.path.realpath(parent) in (*chain, here):
            raise ConfigError(f"recipe {path}: base {b} includes itself")
        layers += _recipe_layers(parent, (*chain, here))
    if name is not None:
        layers.append((f"model flavor {name!r} of {path}", _flavor_layer(name, f"recipe {path}")))
    layers.append((path, _rename_keys(raw, _ALIASES)))
    return layers


def load_config(recipe: Optional[str], overrides: Sequence[str] = ()) -> TandemConfig:
    """Compose defaults <- recipe YAML (its bases and flavor first) <- `key=value` overrides, then
    validate. Raises ConfigError."""
    schema = OmegaConf.structured(TandemConfig)
    layers: List[tuple] = []  # (source, a DictConfig or a plain dict)
    if recipe:
        if not os.path.isfile(recipe):
            where = os.path.dirname(recipe) or "."
            if os.path.isdir(recipe):
                raise ConfigError(f"recipe {recipe} is a directory, not a YAML file")
            if os.path.basename(recipe) == "config.yaml" and os.path.isdir(where):
                raise ConfigError(f"{where} has no config.yaml: not a Tandem run or checkpoint, "
                                  "or an incomplete one")
            shipped = os.path.join(SHIPPED_RECIPES, os.path.basename(recipe))
            hint = f" (a shipped recipe: {shipped})" if os.path.isfile(shipped) else ""
            raise ConfigError(f"recipe file not found: {recipe}{hint}")
        layers += _recipe_layers(recipe)
    for item in overrides:
        key = _override_key(item)
        value = item.split("=", 1)[1]
        if key == "flavor":  # the flavor's keys, at this position among the overrides
            layers.append((f"override {item!r}",
                           _flavor_layer(value.strip(), f"override {item!r}")))
            continue
        if _drop_retired(key, value.strip()):
            continue
        _refuse_a_section_value(schema, key, value)
        try:
            layers.append(("the overrides", _override_layer(schema, key, value)))
        except OmegaConfBaseException as exc:
            raise ConfigError(_one_line_error(exc, recipe, "the overrides")) from None
        except ConfigError:
            raise
        except Exception as exc:  # YAML scanner errors on values such as `...` or unbalanced quotes
            raise ConfigError(f"override {item!r} has a value that is not valid YAML: "
                              f"{' '.join(str(exc).split())[:200]}") from None
    try:
        # One merge, applying the layers in order: merging each override into the result of the last
        # would deep-copy the whole config once per override (0.16 s for 30 overrides, on every
        # rank).
        confs = [OmegaConf.create(layer) if isinstance(layer, dict) else layer
                 for _, layer in layers]
        merged = OmegaConf.merge(schema, *confs)
        for path in _mapping_keys(schema):  # the last layer that sets one wins whole
            given = [c for c in confs if OmegaConf.select(c, path, default=None) is not None]
            if given:
                OmegaConf.update(merged, path, OmegaConf.select(given[-1], path), merge=False)
        cfg: TandemConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line_error(exc, recipe, _culprit(schema, layers))) from None
    cfg.validate()
    return cfg


def explicit_keys(recipe: Optional[str], overrides: Sequence[str] = ()) -> FrozenSet[str]:
    """The dotted keys that a recipe's own sections (its bases' too) and the `key=value` overrides
    set, not those that a flavor or the defaults gave: what a run asked for itself, which
    model.init_from leaves as set where a later stage may change it (hf/init_from.py
    `STAGE_SETTINGS`). Call after `load_config` accepted the same arguments."""
    keys = set()

    def leaves(node: Any, prefix: str) -> None:
        for name, value in node.items():
            if isinstance(value, dict) and value:
                leaves(value, f"{prefix}{name}.")
            else:
                keys.add(f"{prefix}{_PUBLIC.get(name, name)}")

    for source, layer in _recipe_layers(recipe) if recipe else []:
        if not source.startswith("model flavor"):
            leaves(layer, "")
    for item in overrides:
        key = ".".join(_PUBLIC.get(p, p) for p in _override_key(item).split("."))
        value = item.split("=", 1)[1].strip()
        if value.startswith("{"):  # a section set whole (`model={rope_theta: 1e6}`): its leaves
            leaves(read_yaml(value), key + ".")
        elif key != "flavor":
            keys.add(key)
    return frozenset(keys)


def _culprit(schema: Any, layers: Sequence[tuple]) -> Optional[str]:
    """The source of the first layer that fails to merge into the schema on its own (None: only
    their combination fails); for an error message that says where to look."""
    for source, layer in layers:
        try:
            OmegaConf.merge(schema, OmegaConf.create(layer) if isinstance(layer, dict) else layer)
        except OmegaConfBaseException:
            return source
    return None


def _one_line_error(exc: OmegaConfBaseException, recipe: Optional[str],
                    source: Optional[str] = None) -> str:
    key = getattr(exc, "full_key", None)
    key = ".".join(_PUBLIC.get(p, p) for p in str(key).split(".")) if key else None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = f" (in {source})" if source else f" (in {recipe} or the overrides)" if recipe else ""
    if "Key" in first and "not in" in first:
        return f"unknown config key '{key}'{where}"
    if key:
        return f"invalid value for config key '{key}'{where}: {first}"
    return f"invalid config{where}: {first}"


def _literal(node: Any) -> Any:
    """Every `${` of the strings in `node` escaped, so that omegaconf reads them back as text."""
    if isinstance(node, dict):
        return {k: _literal(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_literal(v) for v in node]
    return node.replace("${", "\\${") if isinstance(node, str) else node


def to_yaml(cfg: TandemConfig) -> str:
    """The config (already resolved: its values are final) as YAML, with public key spellings
    (`mtp.loss.lambda`); a `${` in a value stays text when the file is read back (resolved again,
    a value written as `${oc.env:X}` became X's value at resume)."""
    return dump_yaml(OmegaConf.to_container(OmegaConf.create(_literal(as_dict(cfg))),
                                            enum_to_str=True))




def as_dict(cfg: TandemConfig) -> dict:
    """Plain nested dict with public key spellings (for wandb and checkpoints), values as they
    are."""
    return _rename_keys(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False), _PUBLIC)
