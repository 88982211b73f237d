"""``collectives.traffic()`` counts every collective a rank issues — by op
and axes, with nccl-tests' byte convention — whoever issues it."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import collectives as C


def counted() -> dict:
    mesh = sx.Mesh({"dp": 2, "tp": 2})
    x = torch.ones(8, 4)  # 128 bytes
    with C.traffic() as outer:
        C.psum(x, "tp", mesh=mesh)
        C.all_gather(x, "dp", sizes=(8, 8), mesh=mesh)  # sizes known: no size exchange
        with C.traffic() as inner:
            C.psum_scatter(x, ("dp", "tp"), mesh=mesh)
        w = sx.shard(torch.arange(8.0), mesh, sx.P("dp"))
        sx.transfer(w, sx.P())  # an all_gather issued by transfer
    return {"outer": outer.summary(), "inner": inner.summary(), "total": outer.total()}


def untimed(summary: dict) -> dict:
    """The summary without its ``seconds`` (checked to be positive)."""
    for row in summary.values():
        assert row.pop("seconds") > 0
    return summary


@pytest.mark.world_size(4)
def test_traffic_counts_ops_axes_and_bytes():
    for got in run_ranks(counted, world_size=4):
        scatter = {"calls": 1, "bytes": 128, "wire": 128 * 3 / 4}
        assert untimed(got["inner"]) == {"psum_scatter over dp,tp": scatter}
        assert untimed(got["outer"]) == {
            "all_gather over dp": {"calls": 2, "bytes": 256 + 32, "wire": (256 + 32) / 2},
            "psum over tp": {"calls": 1, "bytes": 128, "wire": 128.0},  # 2 (n-1)/n, n = 2
            "psum_scatter over dp,tp": scatter,
        }
        assert got["total"] == 128 + 256 + 32 + 128
