"""How in-memory checkpoints move between ranks: who keeps whose copy, and
the transfers — small JSON gathered from every rank, and bytes point to
point — over a gloo group of every rank of its own.

Not through torch.distributed's store: a background disk save
(``save_async``) waits in the store from its thread, and a store client
serves one call at a time, so a snapshot taken meanwhile would wait for
that save, which waits for the other ranks' snapshots.

A rank's *peer* keeps the copy of its shards. Where the job spans nodes
(ranks grouped by their node's host memory), the peer is a rank of the next
node, so losing a whole node leaves a copy of each of its ranks' shards on
another; on one node it is the next rank.

>>> peers_of([7, 7, 9, 9])  # two nodes of two ranks: each rank's peer is on the other
[2, 3, 0, 1]
>>> peers_of([5, 5, 5]), peers_of([5])
([1, 2, 0], [None])
"""

from __future__ import annotations

import json
import socket
import zlib
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..mesh._runtime import _timeout_seconds

__all__ = ["Transport", "node_key", "peers_of", "read_bytes", "write_bytes"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # by version

_GROUPS: dict[tuple[int, int], Any] = {}  # (world size, the default group's id) -> gloo group


def node_key(slot: Path) -> int:
    """A number naming this rank's node: its host and the folder of host
    memory its slot lives in (one per node launcher)."""
    text = f"{socket.gethostname()}:{Path(slot).absolute().parent}"
    return zlib.crc32(text.encode()) & 0x7FFF_FFFF


def peers_of(nodes: Sequence[int]) -> list[int | None]:
    """Each rank's peer, from each rank's node (see the module): a rank
    of the next node (the same place among its ranks, wrapping), or on one
    node the next rank; None for a rank alone."""
    order: list[int] = []
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(rank)
    if len(order) == 1:
        world = len(nodes)
        return [None if world == 1 else (r + 1) % world for r in range(world)]
    out: list[int | None] = []
    for node in nodes:
        mine = members[node]
        other = members[order[(order.index(node) + 1) % len(order)]]
        out.append(other[mine.index(len(out)) % len(other)])
    return out


class Transport:
    """Bytes between ranks: a gloo group of every rank, created collectively
    on first use. A transfer a peer never joins (it died) fails within the
    collectives' timeout (``SHARDAX_TIMEOUT``) with a ``CheckpointError``
    saying so."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.group = _group(world) if world > 1 else None

    def _run(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except RuntimeError as err:  # gloo: a closed connection, a timeout
            raise CheckpointError(
                f"in-memory checkpoint: {what} failed on rank {self.rank}: {err} — a peer went "
                f"away, or did not arrive within {_timeout_seconds(None):g} s (SHARDAX_TIMEOUT)"
            ) from err

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON ``value``, in rank order.

        >>> Transport(0, 1).gather_json({"a": 1})
        [{'a': 1}]
        """
        if self.group is None:
            return [value]
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        sizes = [row[0] for row in self.gather_ints([data.numel()])]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        out = torch.empty(self.world * max(sizes), dtype=torch.uint8)
        self._run("gathering", lambda: _all_gather(out, padded, group=self.group))
        rows = out.reshape(self.world, -1)
        return [json.loads(bytes(rows[r, : sizes[r]].numpy())) for r in range(self.world)]

    def gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each)."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        if self.group is None:
            return [mine.tolist()]
        out = torch.empty(self.world * len(values), dtype=torch.int64)
        self._run("gathering", lambda: _all_gather(out, mine, group=self.group))
        return out.reshape(self.world, -1).tolist()

    def exchange(
        self,
        sends: Mapping[int, Sequence[torch.Tensor]],
        recvs: Mapping[int, Sequence[int]],
    ) -> dict[int, list[torch.Tensor]]:
        """Send each rank its list of byte tensors and receive from each
        rank a list of the given sizes, all at once (one message a pair).

        >>> Transport(0, 1).exchange({}, {})
        {}
        """
        got = {peer: torch.empty(sum(sizes), dtype=torch.uint8) for peer, sizes in recvs.items()}
        ops = [dist.P2POp(dist.isend, torch.cat(list(ts)), peer, self.group)
               for peer, ts in sends.items()]  # fmt: skip
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for peer, t in got.items()]

        def run() -> None:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        if ops:
            self._run(f"sending to {sorted(sends)} and receiving from {sorted(recvs)}", run)
        return {peer: list(got[peer].split(list(sizes))) for peer, sizes in recvs.items()}

    def barrier(self) -> None:
        if self.group is not None:
            self._run("waiting for every rank", lambda: dist.barrier(group=self.group))


def _group(world: int) -> Any:
    """A gloo group of every rank, of its own (CPU bytes travel on it even
    where the default group is NCCL, and never meet the job's own
    collectives); made once per process group — after any background save,
    as making it goes through the store."""
    key = (world, id(dist.group.WORLD))
    if key not in _GROUPS:
        from ._save import wait_pending

        wait_pending()
        timeout = timedelta(seconds=_timeout_seconds(None))
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _GROUPS[key]


def read_bytes(path: Path) -> torch.Tensor:
    """A file's bytes as a uint8 tensor."""
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def write_bytes(path: Path, data: torch.Tensor) -> None:
    """A uint8 tensor's bytes as a file."""
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()))
