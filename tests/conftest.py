"""Test-session setup: the worker-pool harness, and multi-process tests
ordered by world size so each pool starts once."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
from _dist import shutdown_pools


def _world_size(item: pytest.Item) -> int:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world_size" in callspec.params:
        return int(callspec.params["world_size"])
    marker = item.get_closest_marker("world_size")
    return int(marker.args[0]) if marker else 0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "world_size(n): the test runs on n gloo ranks")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "slow: a heavy case, left out of the default run; pytest -m slow runs them"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_world_size)  # stable: file order within a world size


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
