"""The hook through which library code reports the phases of a step
(``value_and_grad``'s forward and backward) to an active
:class:`shardax.monitor.Monitor` — a no-op costing one context-variable
lookup when none is active."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

__all__ = ["ACTIVE", "phase"]

ACTIVE: contextvars.ContextVar[Callable[[str], ContextManager[Any]] | None] = (
    contextvars.ContextVar("shardax_phase_timer", default=None)
)

_NULL = contextlib.nullcontext()


def phase(name: str) -> ContextManager[Any]:
    """A context that times ``name`` in the active monitor, if any.

    >>> with phase("forward"):
    ...     pass
    """
    timer = ACTIVE.get()
    return _NULL if timer is None else timer(name)
