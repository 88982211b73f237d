"""The DeepSpeed importer's data-parallel layouts across nodes: MiCS
(``mics_shard_size``) as hybrid sharding, ZeRO++'s hpZ and qgZ
(``zero_hpz_partition_size``, ``zero_quantized_gradients``) as
``parallel.node`` with its options."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError

Put = Callable[[str, str, Any], None]
Skip = Callable[..., None]


def _ds_mics(size: int, where: str, put: Put, skip: Skip) -> None:
    """MiCS (``mics_shard_size``: shard within groups of that many ranks,
    replicate across them) as hybrid sharding: the mesh
    ``{replicate: -1, dp: size}`` with ZeRO over ``dp``; -1 (off) changes
    nothing."""
    if size == -1:
        skip(where, "-1: MiCS off, ZeRO over every rank (the default)", False)
        return
    if size < 1:
        raise ConfigError(f"DeepSpeed config: {where} is a group size or -1; got {size}")
    put("mesh", "replicate", -1)
    put("mesh", "dp", size)
    put("parallel", "replicate", "replicate")


def _ds_hpz(size: int, where: str, put: Put, skip: Skip) -> None:
    """ZeRO++'s hpZ (``zero_hpz_partition_size``: a secondary copy of the
    weights split over groups of that many ranks, a node's) as the mesh
    ``{node: -1, dp: size}`` with ZeRO-3 over both and the secondary copy
    over ``dp``; 1 (off) changes nothing."""
    if size == 1:
        skip(where, "1: no secondary partition (the default)", False)
        return
    if size < 1:
        raise ConfigError(f"DeepSpeed config: {where} is a group size (ranks per node); got {size}")
    put("mesh", "node", -1)
    put("mesh", "dp", size)
    put("parallel", "node", "node")
    put("parallel", "secondary", True)


def _ds_qgz(zero: Mapping[str, Any], where: str, put: Put) -> None:
    """ZeRO++'s qgZ as ``parallel.quantize_grads``: it reduces within a
    node, then across, so it needs to know the node's ranks — from
    ``zero_hpz_partition_size`` (DeepSpeed reads the machine's device
    count instead, which a config cannot say)."""
    hpz = zero.get("zero_hpz_partition_size", 1)
    if not isinstance(hpz, int) or hpz < 2:
        raise ConfigError(
            f"DeepSpeed config: {where} (ZeRO++ qgZ) reduces gradients within each node, then "
            "across, and this config does not say how many ranks a node has: add "
            "zero_hpz_partition_size: <ranks per node> to it, or drop the key and set mesh: "
            "{node: <nodes>, dp: <ranks per node>} with parallel: {node: node, "
            "quantize_grads: true} in the converted config"
        )
    put("parallel", "quantize_grads", True)
