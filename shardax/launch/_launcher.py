"""Spawn the ranks and supervise them: fail fast, forward signals, leave no
process behind.

Each rank starts in its own session (so its own process group) and, on
Linux, with ``PR_SET_PDEATHSIG=SIGKILL``, so it dies with the launcher even
when the launcher is SIGKILLed; a small watchdog process then kills what the
ranks started. Stopping a rank signals its whole process
group (the rank and every child it started): SIGTERM, then SIGKILL after a
grace period. Ranks are reaped only once their group has been stopped, so a
rank's pid (its process group id) cannot be reused while we still signal it.
With a ``timeout``, the job's time is limited as a whole: when it passes,
the ranks still running are stopped the same way.

>>> import sys
>>> launch([sys.executable, "-c", "import os; print(os.environ['WORLD_SIZE'])"],
...        nproc_per_node=1)
[rank 0] 1
0
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs

from ..errors import LaunchError
from ._spec import DEFAULT_MASTER_ADDR, LaunchSpec, _to_cmd, rank_env
from ._stream import (
    RankOutput,
    Sink,
    describe_returncode,
    exit_code,
    format_failure,
    format_timeout,
)

__all__ = ["launch"]

POLL_S = 0.05  # how often the supervisor looks at the ranks
REAP_TIMEOUT_S = 5.0  # how long to wait for a SIGKILLed rank to be reapable
DRAIN_TIMEOUT_S = 2.0  # how long to wait for the last output of stopped ranks
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
TIMEOUT_EXIT_CODE = 124  # the job ran past its --timeout (as coreutils' timeout exits)
_SIGKILL = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL
_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


@attrs.frozen
class _Outcome:
    """How supervision ended: the failed ranks (first failure first), or the
    signal that stopped the launcher, or the ranks still running when the
    job's time ran out, or none of these (all ranks exited 0)."""

    failures: tuple[tuple[int, int], ...] = ()  # (rank, returncode)
    signum: int | None = None
    timed_out: tuple[int, ...] = ()  # the ranks (or processes) still running
    remote: str | None = None  # another node's failure (--elastic over several nodes)


@attrs.frozen
class Deadline:
    """The job's overall time limit (``--timeout``): ``seconds`` from the
    monotonic time ``start``."""

    seconds: float
    start: float = attrs.field(factory=time.monotonic)

    @classmethod
    def of(cls, timeout: float | None) -> Deadline | None:
        """The deadline ``timeout`` seconds from now (None: no limit).

        >>> Deadline.of(None) is None, Deadline.of(5).seconds
        (True, 5.0)
        """
        if timeout is None:
            return None
        bad = isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        if bad or not timeout > 0:
            raise LaunchError(
                f"timeout must be a number of seconds > 0 (or None: no limit), got {timeout!r}"
            )
        return cls(float(timeout))

    def passed(self) -> bool:
        """Whether the limit is reached."""
        return time.monotonic() - self.start >= self.seconds


def launch(
    cmd: Sequence[str],
    *,
    nproc_per_node: int,
    master_addr: str = DEFAULT_MASTER_ADDR,
    master_port: int | None = None,
    log_ranks: Iterable[int] | None = None,
    kill_grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    num_nodes: int = 1,
    node_rank: int = 0,
    devices: Sequence[int] | None = None,
    max_restarts: int = 0,
    stop_on_stdin_eof: bool = False,
    timeout: float | None = None,
    elastic: str | tuple[int, int] | None = None,
    rejoin_timeout: float = 30.0,
) -> int:
    """Run ``cmd`` as ``nproc_per_node`` local ranks and supervise them.

    Every line a rank writes is re-emitted prefixed ``[rank k] `` (stdout to
    stdout, stderr to stderr). If a rank exits non-zero or is killed, the
    others are stopped (SIGTERM to each rank's process group, SIGKILL after
    ``kill_grace`` seconds), a summary with the failed rank's traceback goes
    to stderr, and its exit code is returned. SIGINT, SIGTERM or SIGHUP to
    the launcher stop the ranks the same way and return 128 + the signal
    (130, 143, 129); they are only caught when called from the main thread.

    In a job of ``num_nodes`` nodes, this call is node ``node_rank``: one
    launcher per node (each started by hand, by a cluster's scheduler, or by
    ``shardax launch --launcher ssh|pdsh|slurm|mpirun``), all with the same
    ``master_addr`` and ``master_port``. Ranks of other nodes fail their
    next collective when a node stops, so every node's launcher stops too.

    Args:
        cmd: The argv every rank runs, e.g. ``[sys.executable, "train.py"]``
            (see :func:`rank_command`).
        nproc_per_node: The number of ranks on this node.
        master_addr: The address of rank 0's rendezvous store.
        master_port: Its port; ``None`` asks the OS for a free one (one
            node only: the nodes of a job must agree on it).
        log_ranks: The (global) ranks whose output is shown (``None``: all
            of this node's). A failed rank's traceback is shown regardless.
        kill_grace: Seconds between SIGTERM and SIGKILL when stopping ranks.
        env: The environment the ranks start from (default ``os.environ``);
            see :func:`rank_env` for what is added.
        num_nodes: The number of nodes in the job.
        node_rank: This node's index in ``0..num_nodes-1``.
        devices: This node's device slots, one per rank (``CUDA_VISIBLE_DEVICES``).
        max_restarts: When a rank fails, stop every rank and start the job
            again, up to this many times (the script resumes from its latest
            checkpoint); ranks see ``SHARDAX_RESTART_COUNT``, and
            ``SHARDAX_MEMORY_DIR``: host memory of their slot that outlives
            their processes (:class:`shardax.ckpt.MemoryCheckpointManager`),
            removed when the launcher exits. One node only, unless
            ``elastic``: across nodes, the launcher that starts them all
            restarts them.
        stop_on_stdin_eof: Stop every rank (as on SIGHUP) when this
            process's stdin reaches end of file: a node launcher started
            over ssh by a driver that holds its stdin open dies with it.
        timeout: The job's overall limit in seconds, restarts included
            (``None``: none). When it passes, every rank still running is
            stopped like a failure's (SIGTERM, SIGKILL after
            ``kill_grace``), a summary names them with their last lines,
            and 124 is returned.
        elastic: ``"MIN:MAX"`` (or ``(MIN, MAX)``): when ranks are lost
            (killed by a signal, or failed with an error of their own), the
            survivors are stopped and the job restarts on the ranks that
            remain, as long as they are at least MIN (MAX: the ranks started,
            every node's); ranks see ``SHARDAX_ELASTIC`` and a smaller
            ``WORLD_SIZE``. Needs ``max_restarts``. See ``docs/launch.md``.
        rejoin_timeout: With ``elastic`` over several nodes: how long the
            node launchers wait for each other when a round ends; a node
            that has not rejoined by then is lost.

    Returns:
        0 if every rank exited 0; else the first failed rank's exit code
        (128 + N if it was killed by signal N), 128 + the signal that
        stopped the launcher, or 124 if the job ran past ``timeout``.

    Raises:
        LaunchError: Bad arguments, or a rank could not be started.

    >>> import sys
    >>> launch([sys.executable, "-c", "import sys; sys.exit(3)"], nproc_per_node=1,
    ...        kill_grace=1.0)
    3
    """
    if master_port is None and num_nodes != 1:
        raise LaunchError(
            f"a job of {num_nodes} nodes needs master_port: every node's launcher must use "
            "the same one (e.g. --master-port 29500)"
        )
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if max_restarts and num_nodes != 1 and elastic is None:
        raise LaunchError(
            "max_restarts restarts the ranks of one node; a job of several nodes is restarted "
            "by the launcher that starts them all (--launcher ssh, pdsh, slurm or mpirun), or "
            "by the cluster's scheduler — or, with elastic, by the node launchers together"
        )
    if isinstance(kill_grace, bool) or not isinstance(kill_grace, (int, float)) or kill_grace < 0:
        raise LaunchError(f"kill_grace must be a number of seconds >= 0, got {kill_grace!r}")
    from ._elastic import Job, check_elastic, run_job  # the restart loops (they import this)

    job = Job(
        cmd=_to_cmd(cmd),
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        log_ranks=None if log_ranks is None else tuple(log_ranks),
        kill_grace=float(kill_grace),
        base_env=dict(os.environ if env is None else env),
        num_nodes=num_nodes,
        node_rank=node_rank,
        devices=None if devices is None else tuple(devices),
        max_restarts=max_restarts,
        stop_on_stdin_eof=stop_on_stdin_eof,
        deadline=Deadline.of(timeout),
        elastic=check_elastic(elastic, nproc_per_node * num_nodes, max_restarts),
        rejoin_timeout=rejoin_timeout,
    )
    return run_job(job)


def _on_terminal() -> bool:
    """Whether the launcher's stdout and stderr are both terminals."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


def _run_once(
    spec: LaunchSpec,
    shown: Iterable[int],
    kill_grace: float,
    base_env: Mapping[str, str],
    stop_on_stdin_eof: bool = False,
    deadline: Deadline | None = None,
    extra_env: Sequence[Mapping[str, str]] | None = None,
    stop_check: Callable[[], str | None] | None = None,
) -> tuple[_Outcome, int, Sink, dict[int, list[str]]]:
    """Start this node's ranks once and supervise them to the end: how it
    ended, the exit code, the output and the stderr tail of each failed
    rank. ``extra_env``: variables of each local rank's own; ``stop_check``:
    asked at each look at the ranks, a reason to stop them all (another
    node failed) or None."""
    shown = frozenset(shown)
    envs = [rank_env(spec, local, base_env) for local in range(spec.nproc_per_node)]
    for env, extra in zip(envs, extra_env or [{}] * len(envs), strict=True):
        env.update(extra)
    sink = Sink()
    with _record_signals() as received:
        procs = _spawn_all([spec.cmd] * len(envs), envs)
        guard = _start_guard([proc.pid for proc in procs])
        # Reader threads start only now: preexec_fn is unsafe once threads exist.
        outputs = [
            RankOutput(rank, proc.stdout, proc.stderr, sink=sink, show=rank in shown)
            for rank, proc in zip(spec.ranks, procs, strict=True)
        ]
        for output in outputs:
            output.start()
        if stop_on_stdin_eof:
            _watch_stdin(received, sink)
        try:
            outcome = _supervise(
                procs, spec.ranks, received, kill_grace, sink, deadline=deadline, stop=stop_check
            )
        except BaseException:  # a bug or an unexpected exception: still leave nothing behind
            _stop(procs, 0.0, received)
            raise
        finally:
            _dismiss_guard(guard)
    drained_by = time.monotonic() + DRAIN_TIMEOUT_S
    for output in outputs:
        output.join(max(0.0, drained_by - time.monotonic()))
    failed = {r: outputs[spec.ranks.index(r)].stderr_tail() for r, _ in outcome.failures}
    if outcome.signum is not None:
        return outcome, 128 + outcome.signum, sink, failed
    if outcome.remote is not None:
        return outcome, 1, sink, failed
    returncodes = {r: proc.returncode for r, proc in zip(spec.ranks, procs, strict=True)}
    if outcome.timed_out and deadline is not None:
        tails = {r: outputs[spec.ranks.index(r)].output_tail() for r in outcome.timed_out}
        sink.message(
            format_timeout(deadline.seconds, outcome.timed_out, returncodes, tails, spec.cmd)
        )
        return outcome, TIMEOUT_EXIT_CODE, sink, failed
    if outcome.failures:
        output = outputs[spec.ranks.index(outcome.failures[0][0])]
        sink.message(
            format_failure(
                outcome.failures,
                returncodes,
                output.stderr_tail(),
                spec.cmd,
                output.output_tail(),
            )
        )
        return outcome, exit_code(outcome.failures[0][1]), sink, failed
    return outcome, 0, sink, failed


def _watch_stdin(received: list[int], sink: Sink) -> None:
    """A thread that turns end of file on stdin into a SIGHUP for the supervisor."""

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.buffer.read(4096):
                pass
        sink.message("shardax launch: stdin closed: the launcher that started this node is gone")
        received.append(int(getattr(signal, "SIGHUP", signal.SIGTERM)))

    threading.Thread(target=watch, name="shardax-launch-stdin", daemon=True).start()


@contextlib.contextmanager
def _record_signals() -> Iterator[list[int]]:
    """While active, SIGINT/SIGTERM/SIGHUP are appended to the yielded list
    instead of acting (main thread only; elsewhere nothing is installed)."""
    received: list[int] = []
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _STOP_SIGNALS:
            previous[signum] = signal.signal(signum, lambda num, frame: received.append(num))
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # type: ignore[arg-type]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies
    (Linux ``prctl(PR_SET_PDEATHSIG)``), or ``None`` where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent, sigkill = os.getpid(), int(_SIGKILL)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(128 + sigkill)

    return preexec


_GUARD_SOURCE = """\
import os, signal, sys
if sys.stdin.buffer.read() != b"done":
    for pgid in sys.argv[1:]:
        try:
            os.killpg(int(pgid), signal.SIGKILL)
        except OSError:
            pass
"""


def _start_guard(pgids: Sequence[int]) -> subprocess.Popen | None:
    """Start a watchdog that SIGKILLs the ranks' process groups if the
    launcher dies without dismissing it (SIGKILL, a crash): the death signal
    kills the ranks, this kills what they started. ``None`` if unavailable."""
    if not hasattr(os, "killpg") or not sys.executable:
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD_SOURCE, *map(str, pgids)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        return None


def _dismiss_guard(guard: subprocess.Popen | None) -> None:
    """Tell the watchdog the ranks are taken care of, and reap it."""
    if guard is None or guard.stdin is None:
        return
    with contextlib.suppress(OSError):
        guard.stdin.write(b"done")
    with contextlib.suppress(OSError):
        guard.stdin.close()
    try:
        guard.wait(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def _spawn_all(
    cmds: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str] | None],
    stdin_pipes: Sequence[bool] | None = None,
    what: str = "rank",
) -> list[subprocess.Popen]:
    """Start one process per command and environment (None: this one's),
    each in its own session; stdin is /dev/null, or a pipe we hold open."""
    # preexec_fn is unsafe once threads exist; then the watchdog alone covers
    # the launcher's death.
    preexec = _die_with_parent() if threading.active_count() == 1 else None
    pipes = stdin_pipes or [False] * len(cmds)
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env, pipe in zip(cmds, envs, pipes, strict=True):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env=env,
                    stdin=subprocess.PIPE if pipe else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
    except (OSError, subprocess.SubprocessError) as e:
        _stop(procs, 0.0, [])
        for proc in procs:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise LaunchError(
            f"could not start {what} {len(procs)} of {len(cmds)}: "
            f"{shlex.join(cmds[len(procs)])}: {reason}"
        ) from e
    return procs


def _exit_status(proc: subprocess.Popen) -> int | None:
    """The rank's return code if it has exited, else ``None``, *without*
    reaping it (so its pid, which is its process group id, stays reserved)."""
    if proc.returncode is not None:
        return proc.returncode
    if not hasattr(os, "waitid"):
        return proc.poll()
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped behind our back
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_rank(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` once to the rank's process group, and to the rank
    itself if it left that group."""
    if proc.returncode is not None:  # reaped: the pid may belong to someone else now
        return
    if not hasattr(os, "killpg"):
        with contextlib.suppress(OSError):
            proc.send_signal(signum)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) != proc.pid:
            os.kill(proc.pid, signum)


def _live_groups(pgids: set[int]) -> set[int] | None:
    """The process groups in ``pgids`` with a live (not zombie) member, read
    from ``/proc``; ``None`` where ``/proc`` cannot tell (non-Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    live = set()
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 2 and int(fields[2]) in pgids and fields[0] not in (b"Z", b"X"):
            live.add(int(fields[2]))
    return live


def _stop(
    procs: Sequence[subprocess.Popen], grace: float, received: list[int], seen: int | None = None
) -> None:
    """Stop every rank and its process group: SIGTERM, wait up to ``grace``
    seconds, SIGKILL, wait for the groups to empty, reap. A stop signal beyond the first ``seen`` ones (by
    default, those already received) ends the wait at once."""
    for proc in procs:
        _signal_rank(proc, signal.SIGTERM)
    deadline, seen = time.monotonic() + grace, len(received) if seen is None else seen
    while time.monotonic() < deadline and len(received) <= seen:
        if all(_exit_status(proc) is not None for proc in procs) and not _live_groups(
            {proc.pid for proc in procs}
        ):
            break
        time.sleep(POLL_S)
    for proc in procs:  # unreaped ranks keep their group ids reserved, so this is safe
        _signal_rank(proc, _SIGKILL)
    deadline = time.monotonic() + REAP_TIMEOUT_S  # until the killed are really gone
    while _live_groups({proc.pid for proc in procs}) and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
    _reap(procs)


def _reap(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=REAP_TIMEOUT_S)


def _supervise(
    procs: Sequence[subprocess.Popen],
    ranks: Sequence[int],
    received: list[int],
    grace: float,
    sink: Sink,
    names: Sequence[str] | None = None,
    deadline: Deadline | None = None,
    stop: Callable[[], str | None] | None = None,
) -> _Outcome:
    """Wait until every rank exited 0, a rank failed, a stop signal came, or
    the ``deadline`` passed; stop what is left; reap every rank. ``names``
    (default ``rank k``) name the processes in messages: the driver of
    several nodes supervises one process per node the same way. ``stop``
    gives a reason to stop every rank (another node failed), or None."""
    label = dict(zip(ranks, names, strict=True)) if names else {r: f"rank {r}" for r in ranks}
    kind = "process(es)" if names else "rank(s)"
    exited: dict[int, int] = {}
    while True:
        if received:
            signum = received[0]
            running = len(procs) - len(exited)
            sink.message(
                f"shardax launch: got {signal.Signals(signum).name}, stopping {running} "
                f"running {kind} (SIGTERM, SIGKILL after {grace:g} s)"
            )
            _stop(procs, grace, received, seen=1)  # a second signal: SIGKILL now
            return _Outcome(signum=signum)
        failures = []
        for rank, proc in zip(ranks, procs, strict=True):
            if rank not in exited and (code := _exit_status(proc)) is not None:
                exited[rank] = code
                if code != 0:
                    failures.append((rank, code))
        if failures:
            rank, code = failures[0]
            running = len(procs) - len(exited)
            stopping = f"; stopping {running} other running {kind}" if running else ""
            sink.message(
                f"shardax launch: {label[rank]} failed ({describe_returncode(code)}){stopping}"
            )
            _stop(procs, grace, received)
            return _Outcome(failures=tuple(failures))
        reason = stop() if stop is not None and len(exited) < len(procs) else None
        if reason is not None:
            running = len(procs) - len(exited)
            sink.message(f"shardax launch: {reason}; stopping {running} running {kind}")
            _stop(procs, grace, received)
            return _Outcome(remote=reason)
        if deadline is not None and len(exited) < len(procs) and deadline.passed():
            running = [rank for rank in ranks if rank not in exited]
            sink.message(
                f"shardax launch: the job ran past --timeout {deadline.seconds:g} s; stopping "
                f"{', '.join(label[r] for r in running)} (SIGTERM, SIGKILL after {grace:g} s)"
            )
            _stop(procs, grace, received)
            return _Outcome(timed_out=tuple(running))
        if len(exited) == len(procs):
            live = _live_groups({proc.pid for proc in procs})
            if live:  # a rank exited 0 but left children in its group
                left = [rank for rank, proc in zip(ranks, procs, strict=True) if proc.pid in live]
                sink.message(
                    f"shardax launch: stopping processes left behind by {', '.join(label[r] for r in left)}"
                )
                _stop(procs, grace, received)
            _reap(procs)
            return _Outcome()
        time.sleep(POLL_S)
