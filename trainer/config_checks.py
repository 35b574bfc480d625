"""`ConfigError`, `require` (the check every config section's `validate` runs) and
`require_finite` (every float of the tree, before the sections' checks): the base the
section modules (trainer/config.py, trainer/train_config.py) import, kept apart so they import
nothing from each other but this."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key."""


def require(prefix: str, section: Any, checks: Sequence[tuple]) -> None:
    """Raise ConfigError "config key 'prefix.name'=value why" for the first (name, ok, why) not
    ok."""
    for name, ok, why in checks:
        if not ok:
            key = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"config key '{key}'={getattr(section, name)!r} {why}")


def require_finite(prefix: str, section: Any) -> None:
    """ConfigError for the first float of a config section tree (a field, or an item of a list or
    mapping field) that is inf or nan: no setting means infinity (0 or -1 turn things off), and an
    inf learning rate or loss weight passed the range checks and trained NaNs to the end."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            require_finite(key, value)
            continue
        items = (value.values() if isinstance(value, dict)
                 else value if isinstance(value, (list, tuple)) else [value])
        if any(isinstance(x, float) and not math.isfinite(x) for x in items):
            # the field `lambda_` is written `lambda`
            key = key.replace("lambda_", "lambda") if key.endswith("lambda_") else key
            raise ConfigError(f"config key '{key}'={value!r} must be a finite number")
