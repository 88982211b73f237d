"""A DeepSpeed config file, read as DeepSpeed reads it (hjson, which takes
plain JSON; a key written twice refused) and converted, every error naming
the file and the line — and the column where the text stops being JSON or
hjson."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._deepspeed import _convert
from ._hjson import _line_of, _plain, parse


def read_deepspeed(path: str | Path) -> tuple[dict[str, Any], str]:
    """The settings of the DeepSpeed config file ``path``, and its text.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "ds_config.json"
    >>> _ = path.write_text('{\\n  "train_batch_size": 8,\\n  "fp16": {"enabled": true]\\n}\\n')
    >>> read_deepspeed(path)
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: .../ds_config.json:3:27: not JSON or hjson (DeepSpeed reads its config as hjson): Found ']' where a key name was expected ...
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{source}: not a text file (byte {err.start} is not UTF-8)") from None
    except OSError as err:
        raise ConfigError(
            f"cannot read DeepSpeed config {source!r}: {err.strerror or err}"
        ) from None
    data = parse(
        text,
        source,
        unreadable="not JSON or hjson (DeepSpeed reads its config as hjson)",
        twice="DeepSpeed refuses a key written twice; keep one",
    )
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: not a DeepSpeed config: its top level is {type(data).__name__} "
            f'{str(data)[:40]!r}, not an object of settings ({{"train_batch_size": ...}})'
        )
    return _plain(data), text


def convert_deepspeed_file(
    path: str | Path, *, lossy: bool = False
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """:func:`~shardax.config.from_deepspeed` on the file ``path``: errors
    start with the file and the line of their key, and a refusal names the
    line of each key it lists."""
    ds, text = read_deepspeed(path)

    def line(key: str) -> int | None:
        parts = key.split("=", 1)[0].split(".")
        while parts:  # a key the file leaves out (a default): its section's line
            found = _line_of(text, tuple(parts))
            if found is not None:
                return found
            parts.pop()
        return None

    def where(key: str) -> str:
        found = line(key)
        return f"line {found}: " if found is not None else ""

    try:
        return _convert(ds, lossy, where)
    except ConfigError as err:
        found = line(err.key_path) if err.key_path else None
        at = f"{path}:{found}" if found is not None else str(path)
        raise ConfigError(f"{at}: {err}", err.key_path) from None
