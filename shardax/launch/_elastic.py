"""Restarting a job: ``--max-restarts`` (the same ranks again) and
``--elastic MIN:MAX`` (on the ranks that remain).

A *slot* is a place a rank runs in: a local index (and its device, with
``--devices``) and a folder of host memory (:mod:`._memory`). The launcher
starts MAX slots. When a try fails, each failed rank is judged:

- **lost** — killed by a signal the launcher did not send (SIGKILL from the
  out-of-memory killer or a dying host, SIGSEGV, SIGBUS, ...), or exited
  non-zero with an error of its own: its slot, and the host memory the slot
  held, are gone;
- **a survivor** — failed with an error that says a peer went away (a
  ``CollectiveTimeoutError``, a connection closed or reset by its peer, a
  transfer some rank never joined), whatever its exit status (a process
  may still abort in its teardown after such an error): it failed because
  another rank did, so its slot stays. Ranks the launcher stopped are
  survivors too.

Then the job restarts on the slots that remain, renumbered ``0..n-1``
(``WORLD_SIZE`` n), if n is at least MIN; otherwise the launcher exits with
the failure and says why. Only the first failures count (the ranks seen
failed before the launcher stopped the others).

>>> parse_elastic("2:4")
Elastic(min=2, max=4)
>>> lost_ranks([(3, -9), (0, 1)], {0: ["shardax.errors.CollectiveTimeoutError: psum ..."]})
(3,)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..errors import LaunchError
from ._launcher import Deadline, _on_terminal, _run_once
from ._memory import MEMORY_ENV, HostMemory
from ._spec import LaunchSpec, free_port, validate_ranks
from ._stream import describe_returncode, extract_traceback

__all__ = ["ELASTIC_ENV", "Elastic", "Job", "check_elastic", "lost_ranks", "parse_elastic"]

ELASTIC_ENV = "SHARDAX_ELASTIC"
"""Set in every rank of an elastic job: ``MIN:MAX``, the bounds on its size."""
PEER_ERRORS = (
    "CollectiveTimeoutError",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "did not arrive within",  # a rendezvous (a checkpoint's) some rank never joined
    "Timed out waiting",  # gloo's own words for a peer that never answered
)
"""What a rank's traceback says when it failed because a peer went away."""


@attrs.frozen
class Elastic:
    """``--elastic MIN:MAX``: the job runs on MAX ranks at first and goes on
    with as few as MIN after losing some.

    >>> str(Elastic(2, 4))
    '2:4'
    """

    min: int
    max: int

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


def parse_elastic(value: str | Sequence[int]) -> Elastic:
    """``"MIN:MAX"`` or ``(MIN, MAX)`` as an :class:`Elastic`, checked.

    >>> parse_elastic((1, 3))
    Elastic(min=1, max=3)
    >>> parse_elastic("4:2")
    Traceback (most recent call last):
    ...
    shardax.errors.LaunchError: --elastic 4:2: MIN 4 is more than MAX 2; write MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4
    """
    text = value if isinstance(value, str) else ":".join(map(str, value))
    lo, colon, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        bounds = None
    if not colon or bounds is None:
        raise LaunchError(
            f"--elastic {text}: write MIN:MAX, the fewest ranks the job may go on with and the "
            "ranks it starts, e.g. 2:4"
        )
    if bounds[0] < 1:
        raise LaunchError(f"--elastic {text}: MIN must be at least 1, got {bounds[0]}")
    if bounds[0] > bounds[1]:
        raise LaunchError(
            f"--elastic {text}: MIN {bounds[0]} is more than MAX {bounds[1]}; write MIN:MAX with "
            "1 <= MIN <= MAX, e.g. 2:4"
        )
    return Elastic(*bounds)


def check_elastic(
    value: str | Sequence[int] | None, world_size: int, max_restarts: int
) -> Elastic | None:
    """``launch``'s ``elastic=`` checked against the job it belongs to."""
    if value is None:
        return None
    elastic = parse_elastic(value)
    if elastic.max != world_size:
        raise LaunchError(
            f"--elastic {elastic}: MAX is the number of ranks the job starts, which is "
            f"{world_size} (nodes x --nproc-per-node); use --elastic {min(elastic.min, world_size)}"
            f":{world_size}"
        )
    if max_restarts < 1:
        raise LaunchError(
            f"--elastic {elastic} restarts the job on the ranks that remain: give --max-restarts "
            "N (N >= 1), the most restarts the job may take"
        )
    return elastic


def lost_ranks(
    failures: Sequence[tuple[int, int]], tails: Mapping[int, Sequence[str]]
) -> tuple[int, ...]:
    """The failed ranks that lose their slots (see the module): killed by a
    signal, or failed with an error of their own; ``tails``: their stderr.

    >>> lost_ranks([(1, 1)], {1: ["Traceback (most recent call last):", "ValueError: boom"]})
    (1,)
    >>> lost_ranks([(1, 1)], {1: ["RuntimeError: Connection closed by peer [127.0.0.1]:1"]})
    ()
    """
    out = []
    for rank, _ in failures:  # a peer's error, then a signal (an abort in teardown): a survivor
        said = "\n".join(extract_traceback(tails.get(rank, ())) or tails.get(rank, ())[-5:])
        if not any(marker in said for marker in PEER_ERRORS):
            out.append(rank)
    return tuple(out)


@attrs.frozen(kw_only=True)
class Job:
    """Everything :func:`~shardax.launch.launch` was asked, checked."""

    cmd: tuple[str, ...]
    nproc_per_node: int
    master_addr: str
    master_port: int | None
    log_ranks: tuple[int, ...] | None
    kill_grace: float
    base_env: dict[str, str]
    num_nodes: int
    node_rank: int
    devices: tuple[int, ...] | None
    max_restarts: int
    stop_on_stdin_eof: bool
    deadline: Deadline | None
    elastic: Elastic | None
    rejoin_timeout: float

    def spec(self, nproc: int, port: int | None, devices: Sequence[int] | None) -> LaunchSpec:
        """This node's launch of ``nproc`` ranks (a job of one node or the
        same ranks on every node)."""
        return LaunchSpec(
            cmd=self.cmd,
            nproc_per_node=nproc,
            master_addr=self.master_addr,
            master_port=free_port() if port is None else port,
            num_nodes=self.num_nodes,
            node_rank=self.node_rank,
            devices=devices,
        )

    def run(
        self, spec: LaunchSpec, restart: int, memory: HostMemory | None, slots: Sequence[int],
        stop_check: Callable[[], str | None] | None = None,
    ) -> Any:  # fmt: skip
        """One try of ``spec`` on ``slots`` (each rank its slot's host
        memory): :func:`_run_once`'s ``(outcome, code, sink, tails)``."""
        extra = [{MEMORY_ENV: str(memory.slot(k))} if memory else {} for k in slots]
        return _run_once(spec, self.shown(spec.ranks, spec.world_size), self.kill_grace,
                         self.env(restart), self.stop_on_stdin_eof, self.deadline,
                         extra_env=extra, stop_check=stop_check)  # fmt: skip

    def env(self, restart: int) -> dict[str, str]:
        """What every rank of a try gets beyond :func:`rank_env`'s."""
        env = {**self.base_env, "SHARDAX_RESTART_COUNT": str(restart)}
        if self.elastic is not None:
            env[ELASTIC_ENV] = str(self.elastic)
        if _on_terminal():  # the ranks' pipes end on one: they may draw progress bars
            env.setdefault("SHARDAX_TTY", "1")
        return env

    def shown(self, ranks: Sequence[int], world_size: int) -> frozenset[int] | range:
        """The ranks of this try whose output is shown."""
        if self.log_ranks is None:
            return ranks  # type: ignore[return-value]
        if self.elastic is None:
            return validate_ranks(self.log_ranks, world_size, "log_ranks")
        validate_ranks(self.log_ranks, self.elastic.max, "log_ranks")
        return frozenset(self.log_ranks) & frozenset(ranks)  # a smaller world: those left


def run_job(job: Job) -> int:
    """Run the job to its end, restarting it as ``max_restarts`` and
    ``elastic`` say; the exit code."""
    job.spec(job.nproc_per_node, job.master_port or 1, job.devices)  # refuses a bad job first
    if job.elastic is not None and job.num_nodes > 1:
        from ._rendezvous import run_nodes_elastic  # several nodes: they agree on each try

        return run_nodes_elastic(job)
    memory = HostMemory.create(job.nproc_per_node) if job.max_restarts else None
    slots = list(range(job.nproc_per_node))
    restart = 0
    try:
        while True:
            devices = None if job.devices is None else [job.devices[k] for k in slots]
            spec = job.spec(len(slots), job.master_port, devices)
            outcome, code, sink, tails = job.run(spec, restart, memory, slots)
            if not outcome.failures or restart >= job.max_restarts:
                return code
            restart += 1
            rank, returncode = outcome.failures[0]
            if job.elastic is None:
                sink.message(
                    f"shardax launch: restarting every rank (restart {restart} of "
                    f"{job.max_restarts}) because rank {rank} failed "
                    f"({describe_returncode(returncode)})"
                )
                continue
            lost = lost_ranks(outcome.failures, tails)
            left = [k for i, k in enumerate(slots) if i not in lost]
            why = describe_lost(outcome.failures, lost)
            if len(left) < job.elastic.min:
                sink.message(
                    f"shardax launch: {why}; {len(left)} rank(s) remain, fewer than --elastic "
                    f"{job.elastic}'s minimum of {job.elastic.min}: the job stopped"
                )
                return code
            if memory is not None:
                memory.drop(slots[i] for i in lost)
            slots = left
            sink.message(
                f"shardax launch: {why}; restarting on {len(left)} rank(s) (restart {restart} "
                f"of {job.max_restarts}, --elastic {job.elastic}; slots "
                f"{','.join(map(str, left))} of 0-{job.nproc_per_node - 1})"
            )
    finally:
        if memory is not None:
            memory.close()


def describe_lost(failures: Sequence[tuple[int, int]], lost: Sequence[int]) -> str:
    """The failures of a try, in words: who lost a slot, and how.

    >>> describe_lost([(3, -9)], (3,))
    'rank 3 was lost (killed by SIGKILL)'
    >>> describe_lost([(1, 1)], ())
    'rank 1 failed (exit code 1) because a peer went away: no slot was lost'
    """
    if not lost:
        rank, code = failures[0]
        return (
            f"rank {rank} failed ({describe_returncode(code)}) because a peer went away: no slot "
            "was lost"
        )
    codes = dict(failures)
    how = {r: describe_returncode(codes[r]).split(" (exit code")[0] for r in lost}
    return ", ".join(f"rank {r} was lost ({how[r]})" for r in lost)
