"""The collective conformance suite on real gloo ranks: world sizes 1, 2, 4,
meshes {x:4} and {x:2, y:2}; every collective, dtype, uneven/empty piece."""

from __future__ import annotations

import pytest
from _dist import run_ranks

from shardax.collectives.conformance import CHECKS, run_check

MESHES = [
    pytest.param(1, {"x": 1}, id="ws1-x1"),
    pytest.param(2, {"x": 2}, id="ws2-x2"),
    pytest.param(4, {"x": 4}, id="ws4-x4"),
    pytest.param(4, {"x": 2, "y": 2}, id="ws4-x2y2"),
]


@pytest.mark.parametrize(("world_size", "mesh_shape"), MESHES)
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance(check: str, world_size: int, mesh_shape: dict[str, int]) -> None:
    cases = run_ranks(run_check, check, mesh_shape, world_size=world_size)
    assert len(set(cases)) == 1 and cases[0] > 0
