"""The value checks and converters the config sections' fields use, and
the choices they accept: each names the key and what it takes."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import ConfigError
from ..pipeline._named import SCHEDULES as PIPELINE_SCHEDULES

OPTIMIZERS = (
    "adamw",
    "adam",
    "lion",
    "sgd",
    "adagrad",
    "rmsprop",
    "lamb",
    "onebit_adam",
    "onebit_lamb",
    "zero_one_adam",
    "muon",
)
COMPRESSED = ("onebit_adam", "onebit_lamb", "zero_one_adam")  # each averages over the data axes
SCHEDULES = (
    "constant",
    "warmup_constant",
    "warmup_cosine",
    "warmup_linear",
    "one_cycle",
    "one_cycle_linear",
)
PRECISIONS = ("fp32", "bf16", "fp16")
PP_SCHEDULES = tuple(PIPELINE_SCHEDULES)
WRITERS = ("stdout", "csv", "jsonl", "tensorboard")


def _in(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{attribute.name} is one of {choices}; got {value!r}{hint}")

    return check


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not value > 0):
        raise ConfigError(f"{attribute.name} must be positive; got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0; got {value!r}")


def _as_int(name: str) -> Callable[[Any], int]:
    """A converter to an integer that refuses ``true``, ``2.5``, ``"3"``,
    ``1e400`` and anything beyond int64, naming the key."""

    def convert(value: Any) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**63:
            raise ConfigError(f"{name} is an integer; got {value!r}")
        return value

    return convert


def _as_float(name: str) -> Callable[[Any], float]:
    """A converter to a finite number that refuses ``true``, strings, NaN and
    infinities (``1e400`` parses as one), naming the key."""

    def convert(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} is a number; got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} is a finite number; got {value!r}")
        return float(value)

    return convert


def _as_bool(name: str) -> Callable[[Any], bool]:
    def convert(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} is true or false; got {value!r}")
        return value

    return convert


def _as_str(name: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} is a string; got {value!r}")
        return value

    return convert


def _optional(convert: Callable[[str], Callable[[Any], Any]], name: str) -> Callable[[Any], Any]:
    """``convert(name)``, letting ``None`` (the key's "not set") through."""
    inner = convert(name)
    return lambda value: None if value is None else inner(value)


def _list_of(convert: Callable[[str], Callable[[Any], Any]], name: str) -> Callable[[Any], tuple]:
    """A list whose items each pass ``convert``, named ``name[i]`` in errors."""

    def check(value: Any) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} is a list; got {value!r}")
        return tuple(convert(f"{name}[{i}]")(v) for i, v in enumerate(value))

    return check
