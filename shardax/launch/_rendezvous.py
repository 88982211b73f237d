"""``--elastic`` over several nodes: the node launchers agree on each try.

Each node runs its own ``shardax launch --launcher none --elastic MIN:MAX``
(all with the same ``--master-addr``/``--master-port``). Node 0's launcher
keeps a small key-value store at ``MASTER_PORT + 1`` for the launchers
(the ranks' own rendezvous is a fresh port each try). A *round* is one try:

1. every node launcher still running posts how many of its slots are left;
2. node 0 waits until every node of the last round has posted, or
   ``rejoin_timeout`` seconds — a node that has not posted by then is lost
   (its launcher died, or its machine) — and posts the members: the nodes
   with slots left, in node order, and the ranks' port; or why the job
   stops (fewer ranks than MIN, node 0 without ranks, no restarts left);
3. each node starts its ranks: global ranks numbered node after node
   (``RANK`` = the ranks of the nodes before it + ``LOCAL_RANK``),
   ``WORLD_SIZE`` their sum, ``NODE_RANK`` its place among the members;
4. when a node's ranks fail, its launcher judges which of them are lost
   (as on one node, :func:`~._elastic.lost_ranks`: a rank that failed
   because a peer on another node went away is not), posts that the round
   failed — the other nodes stop their ranks at once — and joins the next
   round.

Node 0 holds the store, so it must survive: when it is lost the other node
launchers cannot agree, say so, and stop (restart the job from its newest
checkpoint), as torchrun's c10d rendezvous does.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from datetime import timedelta
from typing import Any

import attrs

from ..errors import LaunchError
from ._elastic import Job, describe_lost, lost_ranks
from ._launcher import POLL_S
from ._memory import HostMemory
from ._spec import LaunchSpec, free_port

__all__ = ["STORE_PORT_OFFSET", "run_nodes_elastic"]

STORE_PORT_OFFSET = 1
"""The launchers' store listens at ``MASTER_PORT`` + this, on node 0."""
ANSWER_MARGIN_S = 30.0  # beyond rejoin_timeout, how long the others wait for node 0's answer


@attrs.frozen(kw_only=True)
class _NodeSpec(LaunchSpec):
    """This node's ranks in a round: ``first`` the global rank of its first,
    ``total`` the ranks of the round on every node."""

    first: int = 0
    total: int = 1

    @property
    def world_size(self) -> int:
        return self.total

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.nproc_per_node)


class _Store:
    """The launchers' store (node 0 hosts it); keys under ``elastic/``."""

    def __init__(self, job: Job) -> None:
        from torch.distributed import TCPStore

        self.node, self.nodes = job.node_rank, job.num_nodes
        self.wait_s = job.rejoin_timeout
        port = int(job.master_port or 0) + STORE_PORT_OFFSET
        try:
            self.store = TCPStore(
                job.master_addr,
                port,
                is_master=self.node == 0,
                timeout=timedelta(seconds=job.rejoin_timeout + ANSWER_MARGIN_S),
                wait_for_workers=False,
            )
        except Exception as err:  # torch raises RuntimeError or DistNetworkError by version
            raise LaunchError(
                f"--elastic: node {self.node} cannot reach the launchers' store at "
                f"{job.master_addr}:{port} (node 0's launcher, MASTER_PORT + 1): {err}"
            ) from None

    def join(self, rnd: int, live: int, job: Job, members: list[list[int]] | None) -> dict:
        """Post this node's slots left for round ``rnd``; node 0's answer."""
        key = f"elastic/{rnd}/members"
        if self.node == 0:
            self.store.set(f"elastic/{rnd}/node0", json.dumps({"live": live}))
            answer = self._decide(rnd, job, members)
            self.store.set(key, json.dumps(answer))
            return answer
        try:
            self.store.set(f"elastic/{rnd}/node{self.node}", json.dumps({"live": live}))
            self.store.wait([key], timedelta(seconds=self.wait_s + ANSWER_MARGIN_S))
            answer = json.loads(self.store.get(key))
        except Exception:
            return {
                "stop": "node 0's launcher, which holds the launchers' store, did not answer: "
                "node 0 was lost, and without it the nodes cannot agree"
            }
        self.store.set(f"elastic/{rnd}/ack{self.node}", "1")
        return answer

    def _decide(self, rnd: int, job: Job, members: list[list[int]] | None) -> dict:
        expected = [n for n, _ in members] if members is not None else list(range(self.nodes))
        keys = {n: f"elastic/{rnd}/node{n}" for n in expected}
        until = time.monotonic() + self.wait_s
        while time.monotonic() < until and not all(self.store.check([k]) for k in keys.values()):
            time.sleep(POLL_S)
        came = {n: json.loads(self.store.get(k))["live"] for n, k in keys.items()
                if self.store.check([k])}  # fmt: skip
        gone = [n for n in expected if n not in came]
        left = [[n, live] for n, live in sorted(came.items()) if live > 0]
        total = sum(live for _, live in left)
        lost = f"node(s) {gone} did not rejoin within {self.wait_s:g} s: lost; " if gone else ""
        if job.elastic is not None and total < job.elastic.min:
            return {"stop": f"{lost}{total} rank(s) remain, fewer than --elastic "
                    f"{job.elastic}'s minimum of {job.elastic.min}"}  # fmt: skip
        if not left or left[0][0] != 0:
            return {"stop": f"{lost}node 0 has no rank left, and it holds the rendezvous"}
        return {"members": left, "port": free_port(), "gone": gone}

    def linger(self, rnd: int) -> None:
        """Node 0: wait (a while) until the others have read a last answer."""
        if self.node != 0:
            return
        until = time.monotonic() + self.wait_s
        keys = [f"elastic/{rnd}/ack{n}" for n in range(1, self.nodes)]
        while time.monotonic() < until and not all(self.store.check([k]) for k in keys):
            time.sleep(POLL_S)

    def fail(self, rnd: int, reason: str) -> None:
        """Tell the other nodes that round ``rnd`` failed here."""
        with contextlib.suppress(Exception):  # node 0 gone: the others' ranks fail by themselves
            self.store.set(f"elastic/{rnd}/failed", f"node {self.node}: {reason}")

    def failed(self, rnd: int) -> str | None:
        """Another node's failure of round ``rnd``, if any."""
        try:
            key = f"elastic/{rnd}/failed"
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # node 0 is gone: its ranks' peers fail their collectives
            return None


def _spec(job: Job, answer: dict[str, Any], node: int, slots: list[int]) -> _NodeSpec:
    members = [n for n, _ in answer["members"]]
    sizes = dict((n, live) for n, live in answer["members"])
    place = members.index(node)
    devices = None if job.devices is None else [job.devices[k] for k in slots]
    return _NodeSpec(
        cmd=job.cmd,
        nproc_per_node=len(slots),
        master_addr=job.master_addr,
        master_port=int(answer["port"]),
        num_nodes=len(members),
        node_rank=place,
        devices=devices,
        first=sum(sizes[n] for n in members[:place]),
        total=sum(sizes.values()),
    )


def run_nodes_elastic(job: Job) -> int:
    """This node's part of an elastic job of several nodes; its exit code."""
    if job.master_port is None:
        raise LaunchError("--elastic over several nodes needs --master-port (the same on each)")
    store = _Store(job)
    memory = HostMemory.create(job.nproc_per_node)
    slots = list(range(job.nproc_per_node))
    members: list[list[int]] | None = None
    code, rnd = 1, 0
    try:
        while True:
            answer = store.join(rnd, len(slots), job, members)
            if "stop" in answer:
                store.linger(rnd)
                print(f"shardax launch: --elastic: {answer['stop']}: the job stopped",
                      file=sys.stderr, flush=True)  # fmt: skip
                return code
            if answer["gone"] and job.node_rank == 0:
                total = sum(live for _, live in answer["members"])
                print(f"shardax launch: --elastic: node(s) {answer['gone']} did not rejoin within "
                      f"{job.rejoin_timeout:g} s: lost; going on with {total} rank(s) on "
                      f"{len(answer['members'])} node(s)", file=sys.stderr, flush=True)  # fmt: skip
            if job.node_rank not in [n for n, _ in answer["members"]]:
                return code  # this node has no slot left
            members = answer["members"]
            spec = _spec(job, answer, job.node_rank, slots)
            outcome, code, sink, tails = job.run(
                spec, rnd, memory, slots, stop_check=lambda rnd=rnd: store.failed(rnd)
            )
            if outcome.signum is not None or outcome.timed_out:
                store.fail(rnd, "its launcher was stopped")
                return code
            if outcome.remote is None and not outcome.failures:
                return code
            lost = [r - spec.first for r in lost_ranks(outcome.failures, tails)]
            if outcome.failures:
                why = describe_lost(outcome.failures, [r + spec.first for r in lost])
                store.fail(rnd, why)
            else:
                why = f"another node failed ({outcome.remote})"
            if memory is not None:
                memory.drop(slots[i] for i in lost)
            slots = [k for i, k in enumerate(slots) if i not in lost]
            if rnd >= job.max_restarts:  # every node counts the same rounds: all stop here
                sink.message(f"shardax launch: {why}; no restarts left (--max-restarts "
                             f"{job.max_restarts}): the job stopped")  # fmt: skip
                return code
            rnd += 1
            sink.message(
                f"shardax launch: {why}; node {job.node_rank} rejoins with {len(slots)} rank(s) "
                f"(restart {rnd} of {job.max_restarts}, --elastic {job.elastic})"
            )
    finally:
        if memory is not None:
            memory.close()
