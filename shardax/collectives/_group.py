"""A collective group: the ranks along some mesh axes, the process group that
connects them, and the bookkeeping that turns a hang into a clear error."""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import CollectiveError, CollectiveTimeoutError

__all__ = ["Group", "PGState", "arrival_grace"]


class PGState:
    """One torch process group and the number of collectives issued on it.

    Every rank of an SPMD program issues the same collectives on a group in the
    same order, so the count names a collective across ranks; on a timeout it
    tells which ranks reached it.
    """

    __slots__ = ("backend", "check", "pg", "ranks", "seq", "timeout")

    @property
    def wait(self) -> float:
        """How long the transport waits before it gives up: the timeout less
        the :func:`arrival_grace` spent finding out who did not arrive, so
        that the error comes within the timeout."""
        return self.timeout - arrival_grace(self.timeout)

    def __init__(
        self, pg: Any, ranks: tuple[int, ...], timeout: float, backend: Any, check: bool = True
    ) -> None:
        self.pg = pg
        self.ranks = ranks  # sorted global ranks: torch's group rank order
        self.timeout = timeout
        self.backend = backend  # chosen once, when the group is made
        self.check = check  # collectives compare their signatures first (``_agree``)
        self.seq = 0


class Group:
    """The ranks of one mesh-axis group, in member order, as seen by one rank.

    ``members[i]`` is the global rank of member ``i`` (mixed radix over the
    axes, first axis major); ``index`` is this rank's member index. A group of
    one member has no process group: every collective on it is local.
    """

    __slots__ = ("_torch_ranks", "axes", "index", "label", "members", "rank", "state")

    def __init__(
        self,
        members: tuple[int, ...],
        rank: int,
        state: PGState | None,
        label: str,
        axes: tuple[str, ...] = (),
    ) -> None:
        self.axes = axes
        self.members = members
        self.rank = rank
        self.index = members.index(rank)
        self.state = state
        self.label = label
        if state is None:
            self._torch_ranks: tuple[int, ...] | None = None
        else:
            order = tuple(state.ranks.index(r) for r in members)
            self._torch_ranks = None if order == tuple(range(len(members))) else order

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def pg(self) -> Any:
        return None if self.state is None else self.state.pg

    @property
    def in_torch_order(self) -> bool:
        """Whether member ``i`` is torch group rank ``i`` (true unless the axes
        were named out of mesh order)."""
        return self._torch_ranks is None

    def torch_rank(self, member: int) -> int:
        """Torch's group rank of member ``member``."""
        return member if self._torch_ranks is None else self._torch_ranks[member]

    def member_of_torch_rank(self, group_rank: int) -> int:
        return group_rank if self._torch_ranks is None else self._torch_ranks.index(group_rank)

    def __repr__(self) -> str:
        return f"<Group {self.label} members={self.members} index={self.index}>"


def arrival_grace(timeout: float) -> float:
    """Seconds of a collective's ``timeout`` kept for naming the ranks that
    did not arrive (through the store) once the transport gave up.

    >>> arrival_grace(2.0), arrival_grace(600.0)
    (0.4, 5.0)
    """
    return min(5.0, 0.2 * timeout)


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def _is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def translate_error(group: Group, op: str, seq: int, err: BaseException) -> CollectiveError:
    """Turn a backend failure of collective number ``seq`` into a typed error
    that names the op, the axes, the ranks, and (on a timeout) which ranks did
    not arrive."""
    where = f"{op} over {group.label} (collective #{seq} on ranks {list(group.members)})"
    timeout = group.state.timeout if group.state else 0.0
    grace = max(arrival_grace(timeout), 0.1)
    if not _is_timeout(err):
        if _is_peer_closed(err):
            # A peer that timed out on this collective, or died (its node's
            # launcher stopped it), closes its connections, and ranks still
            # waiting see that before their own timer fires: the cause is the
            # rank that never came, so name it.
            arrived, missing, elsewhere = _who_arrived(group, op, seq, grace=grace)
            if missing:
                how = (
                    f"was abandoned on rank {group.rank} when a peer closed its connection (a "
                    f"rank died or was stopped — on another node too —, or timed out after "
                    f"{timeout:g} s)"
                )
                return _timeout_error(where, how, arrived, missing, elsewhere)
        return CollectiveError(
            f"{where} failed on rank {group.rank}: {err}. If a peer crashed, its own traceback "
            "names the cause; every rank must issue the same collectives in the same order."
        )
    arrived, missing, elsewhere = _who_arrived(group, op, seq, grace=grace)
    how = f"did not complete within {timeout:g} s on rank {group.rank}"
    return _timeout_error(where, how, arrived, missing, elsewhere)


def _is_peer_closed(err: BaseException) -> bool:
    text = str(err).lower()
    return "connection closed by peer" in text or "connection reset" in text


def _timeout_error(
    where: str,
    how: str,
    arrived: list[int],
    missing: list[int],
    elsewhere: list[tuple[int, str]],
) -> CollectiveTimeoutError:
    detail = ""
    if missing:
        detail = f" Ranks that did not arrive: {missing}"
        if elsewhere:
            detail += " (" + "; ".join(f"rank {r} is waiting in {w}" for r, w in elsewhere) + ")"
        detail += f"; ranks that arrived: {arrived}."
    return CollectiveTimeoutError(
        f"{where} {how}.{detail} "
        "A rank that skipped or reordered this collective (rank-local control flow), a dead rank, "
        "or a rank stuck elsewhere causes this; if the work is only slow, raise the timeout "
        "(shardax.init(timeout=...) or Mesh(..., timeout=...))."
    )


def _who_arrived(
    group: Group, op: str, seq: int, grace: float
) -> tuple[list[int], list[int], list[tuple[int, str]]]:
    store = _store()
    if store is None or group.state is None:
        return [], [], []
    tag = f"shardax/timeout/{'-'.join(map(str, group.state.ranks))}/{seq}"
    mine = json.dumps({"op": f"{op} over {group.label}", "seq": seq})
    try:
        store.set(f"{tag}/{group.rank}", mine)
        store.set(f"shardax/blocked/{group.rank}", mine)
        deadline = time.monotonic() + grace
        pending = set(group.members) - {group.rank}
        while pending and time.monotonic() < deadline:
            pending = {r for r in pending if not store.check([f"{tag}/{r}"])}
            if pending:
                time.sleep(0.05)
        elsewhere = []
        for r in sorted(pending):
            key = f"shardax/blocked/{r}"
            if store.check([key]):
                info = json.loads(store.get(key))
                elsewhere.append((r, f"{info['op']} (collective #{info['seq']})"))
        arrived = sorted(set(group.members) - pending)
        return arrived, sorted(pending), elsewhere
    except Exception:  # the store itself may be gone; report without it
        return [], [], []
