"""`ConfigError` and `require`, the check every config section's `validate` runs: the base the
section modules (trainer/config.py, trainer/train_config.py) import, kept apart so they import
nothing from each other but this."""

from __future__ import annotations

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
