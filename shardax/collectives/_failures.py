"""A collective that failed, as a typed error: the op, the axes, the ranks,
and — on a timeout, or a peer that closed its connection — which ranks did
not arrive and where they wait instead (found through the store)."""

from __future__ import annotations

import json
import time

from ..errors import CollectiveError, CollectiveTimeoutError
from ..mesh._groups import Group, arrival_grace
from ..mesh._runtime import _default_store

__all__ = ["translate_error"]


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
    store = _default_store()
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
