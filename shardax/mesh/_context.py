"""The current mesh of a ``with mesh:`` block (a context variable, not a global)."""

from __future__ import annotations

import contextvars
from typing import Any

_STACK: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "shardax_mesh_stack", default=()
)


def push(mesh: Any) -> None:
    _STACK.set((*_STACK.get(), mesh))


def pop() -> None:
    _STACK.set(_STACK.get()[:-1])


def current() -> Any | None:
    """The innermost mesh entered with ``with mesh:``, or None."""
    stack = _STACK.get()
    return stack[-1] if stack else None
