"""Reading hjson text for a config: duplicate keys refused, numbers out of
range named, the line where a key is written, and errors that carry the key
path they are about (so that a file's line can be named)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError


def _keyed(message: str, key_path: str | None) -> ConfigError:
    """A ConfigError that knows the key path it is about (so that a file's
    line can be named)."""
    return ConfigError(message, key_path)


def _first_key(message: str, keys: Any) -> str | None:
    """The key a value error names first (``lr is a number; ...``), if it is one of ``keys``."""
    word = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return word if word in keys else None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def parse(text: str, source: str, *, unreadable: str, twice: str) -> Any:
    """``text`` read as hjson (JSON is hjson), keys written twice refused:
    a :class:`ConfigError` naming ``source``, the line (and column) and
    what failed — ``unreadable`` says what the text is not, ``twice`` why a
    key written twice is refused.

    >>> parse('{"a": 1}', "x.json", unreadable="not hjson", twice="keep one")
    {'a': 1}
    >>> parse('{"a": 1, "a": 2}', "x.json", unreadable="not hjson", twice="keep one")
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: x.json:1: duplicate key 'a': keep one
    """
    import hjson

    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as err:
        raise ConfigError(f"{source}:{err.lineno}:{err.colno}: {unreadable}: {err.msg}") from None
    except (OverflowError, ValueError):  # hjson's own reader fails on 1e400
        raise ConfigError(f"{source}:{_overflow(text)}") from None
    except _DuplicateKey as dup:
        line = _line_of(text, (dup.key,), occurrence=2)
        raise ConfigError(f"{source}:{line}: duplicate key {dup.key!r}: {twice}") from None


def _overflow(text: str) -> str:
    """``LINE: message`` for the first number in ``text`` that is no finite float."""
    import re

    for m in re.finditer(r"(?<![\w.])[-+]?\d+(?:\.\d*)?[eE][-+]?\d+", text):
        if not math.isfinite(float(m.group())):
            line = text.count("\n", 0, m.start()) + 1
            return f"{line}: the number {m.group()} is too large (not a finite number)"
    return " a number could not be read (out of range)"


def _line_of(text: str, path: tuple[str, ...], occurrence: int = 1) -> int | None:
    """The line of ``text`` where the key ``path`` (section, key) is written
    (its ``occurrence``-th time for the last part); None if not found."""
    import re

    pos = 0
    for i, key in enumerate(path):
        pattern = re.compile(rf'(?:^|[{{,\s])["\']?{re.escape(key)}["\']?\s*:', re.M)
        found = list(pattern.finditer(text, pos))
        want = occurrence if i == len(path) - 1 else 1
        if len(found) < want:
            return None
        pos = found[want - 1].end()
    return text.count("\n", 0, pos) + 1


def _unknown(source: str, key: str, prefix: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = prefix.rstrip(".") or "the top level"
    return f"{source}: unknown key {prefix}{key}{hint}; {where} takes {', '.join(allowed)}"


def _plain(value: Any) -> Any:
    """hjson's ordered dicts and Decimal-free values as plain Python."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
