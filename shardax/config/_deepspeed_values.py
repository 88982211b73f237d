"""How the DeepSpeed importer reads a config's values: each reader names
the key and what it takes; and the callbacks a section's converter gets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError

Put = Callable[[str, str, Any], None]
Skip = Callable[..., None]


def _bad(key: str, value: Any, what: str) -> ConfigError:
    hint = ""
    word = value.rstrip(",").replace("_", "") if isinstance(value, str) else ""
    if word.isalnum() and word[:1].isalpha():
        hint = " (a word where a value belongs: a template's placeholder left unfilled?)"
    return ConfigError(f"{key} is {what}; got {value!r}{hint}", key)


def _whole(key: str, value: Any, auto: bool = False) -> int:
    """An integer setting (``8.0`` too; ``"8"`` is an error, as in DeepSpeed)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, value, 'an integer or "auto"' if auto else "an integer")
    return value


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, value, "a number")
    return float(value)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _section(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _bad(key, value, "an object of settings")
    return value
