"""Rank output: re-emit every line of a rank prefixed ``[rank k] ``, and keep
the tail of its output (stderr alone, and both streams in the order they
came) so a failure can be reported with its traceback or its last lines.

One :class:`Sink` (one lock) serializes all writes of the launcher, so lines
of different ranks never interleave within a line. Each rank has two reader
threads (stdout, stderr) that drain its pipes even when its output is not
shown, so a rank never blocks on a full pipe.

>>> lines = ["step 1", "Traceback (most recent call last):", '  File "t.py", line 1',
...          "ValueError: boom"]
>>> extract_traceback(lines)[-1]
'ValueError: boom'
"""

from __future__ import annotations

import re
import shlex
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Literal

__all__ = [
    "RankOutput",
    "Sink",
    "describe_returncode",
    "exit_code",
    "extract_traceback",
    "format_failure",
    "format_timeout",
    "last_lines",
    "still_running",
]

TRACEBACK_HEAD = "Traceback (most recent call last):"
_GROUP_HEAD = "Exception Group Traceback (most recent call last):"
_CHAIN_LINES = frozenset(
    {
        "During handling of the above exception, another exception occurred:",
        "The above exception was the direct cause of the following exception:",
    }
)
MAX_LINE_BYTES = 64 * 1024  # a longer line is re-emitted in pieces of this size
TAIL_LINES = 1000  # stderr lines remembered per rank (and as many of both streams)
LINES_WITHOUT_TRACEBACK = 20  # shown for a failed rank that printed no traceback
LINES_OF_A_RUNNING_RANK = 10  # shown for each rank still running at --timeout

Which = Literal["stdout", "stderr"]


class Sink:
    """The launcher's output: ``stdout`` and ``stderr`` behind one lock.

    The streams are looked up on ``sys`` at each write unless given, so
    captured output (pytest's ``capsys``, doctest) sees the ranks' lines. A
    stream that is closed or whose reader went away (``| head``) is dropped
    silently; the ranks keep running.

    >>> import io
    >>> out = io.StringIO()
    >>> Sink(stdout=out).write("stdout", b"[rank 0] hi\\n")
    >>> out.getvalue()
    '[rank 0] hi\\n'
    """

    def __init__(self, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._broken: set[str] = set()
        self._lock = threading.Lock()
        self._redrawn = False  # the terminal's last line is a redraw (a progress bar)

    def write(self, which: Which, data: bytes, *, redraw: bool = False) -> None:
        """Write ``data`` (whole lines) to ``which`` and flush, atomically.
        With ``redraw``, ``data`` is a ``\r`` redraw of the last line; a
        line after one clears it first (``\r`` and erase to its end), on
        either stream, so a bar never runs into a line."""
        with self._lock:
            if which in self._broken:
                return
            if not redraw and self._redrawn:
                data = b"\r\x1b[K" + data
            self._redrawn = redraw
            stream = self._streams[which] or getattr(sys, which)
            try:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:  # bytes as the rank wrote them, no re-encoding
                    stream.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (OSError, ValueError):  # closed, or a broken pipe
                self._broken.add(which)

    def message(self, text: str) -> None:
        """Write the launcher's own ``text`` to stderr, ending it with a newline."""
        self.write("stderr", (text.rstrip("\n") + "\n").encode("utf-8", "replace"))


class RankOutput:
    """The reader threads of one rank, and the tail of its output.

    Args:
        rank: The rank, used in the ``[rank k] `` prefix.
        stdout: The read end of the rank's stdout pipe (binary).
        stderr: The read end of the rank's stderr pipe (binary).
        sink: Where lines go.
        show: Whether this rank's lines are re-emitted; the tails are
            kept either way.
        label: The prefix instead of ``[rank k] `` (a node's name, when the
            process is a node's launcher).
    """

    def __init__(
        self,
        rank: int,
        stdout: IO[bytes],
        stderr: IO[bytes],
        *,
        sink: Sink,
        show: bool,
        label: str | None = None,
    ) -> None:
        self.rank = rank
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._both: deque[list[str]] = deque(maxlen=TAIL_LINES)  # [stream, text]
        self._redrawn: dict[str, list[str]] = {}  # per stream: its line being redrawn
        self._tail_lock = threading.Lock()
        prefix = (f"[rank {rank}] " if label is None else label).encode()
        self._threads = [
            threading.Thread(
                target=self._pump,
                args=(pipe, which, prefix, sink, show),
                name=f"shardax-launch-rank{rank}-{which}",
                daemon=True,  # a pipe held open by an escaped process must not block exit
            )
            for pipe, which in ((stdout, "stdout"), (stderr, "stderr"))
        ]

    def start(self) -> None:
        """Start reading. Call only after every rank is spawned (see ``_launcher``)."""
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for both pipes to reach end of file;
        return whether they did."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    def stderr_tail(self) -> list[str]:
        """The last stderr lines of this rank (without line endings)."""
        with self._tail_lock:
            return list(self._tail)

    def output_tail(self) -> list[tuple[str, str]]:
        """The last lines of this rank on either stream, in the order they
        began, each with its stream: ``("stdout", "step 3")``. A line
        redrawn in place with ``\r`` (a progress bar) is one entry: its
        latest text, or the line that ended it."""
        with self._tail_lock:
            return [(which, text) for which, text in self._both]

    def _pump(self, pipe: IO[bytes], which: Which, prefix: bytes, sink: Sink, show: bool) -> None:
        try:
            for piece, is_line in _pieces(pipe):
                self._keep(which, piece.decode("utf-8", "replace").rstrip("\r\n"), is_line)
                if not is_line:  # a "\r" redraw (a progress bar): at once, over the last
                    if show:
                        sink.write(which, b"\r" + prefix + piece, redraw=True)
                    continue
                if show:
                    sink.write(which, prefix + piece)
        except (OSError, ValueError):  # the pipe was closed under us
            pass
        finally:
            pipe.close()

    def _keep(self, which: Which, text: str, is_line: bool) -> None:
        """Remember a line (or a redraw: a line redrawn in place keeps one
        entry, its latest text, which the line that ends it replaces)."""
        with self._tail_lock:
            if is_line and which == "stderr":
                self._tail.append(text)
            entry = self._redrawn.pop(which, None)
            if entry is None:
                entry = [which, text]
                self._both.append(entry)
            entry[1] = text
            if not is_line:
                self._redrawn[which] = entry


def _pieces(pipe: IO[bytes]) -> Iterator[tuple[bytes, bool]]:
    """``(piece, is_line)`` as the rank writes them: whole lines (ending in
    a newline, which is added at the end of the output if missing; a line
    longer than :data:`MAX_LINE_BYTES` in pieces of that size), and the text
    of each ``\r`` redraw (``\rstep 3/10``, as a progress bar writes it),
    handed on as soon as the next ``\r`` or newline ends it. A ``\r\n``
    ending is a line's."""
    read = getattr(pipe, "read1", None) or pipe.readline
    pending = b""
    while chunk := read(MAX_LINE_BYTES):
        pending += chunk
        while pending:
            newline, carriage = pending.find(b"\n"), pending.find(b"\r")
            if carriage != -1 and (newline == -1 or carriage < newline):
                if carriage + 1 == len(pending):
                    break  # a "\r\n" maybe: wait for the next byte
                if pending[carriage + 1 : carriage + 2] != b"\n":
                    if carriage:
                        yield pending[:carriage], False
                    pending = pending[carriage + 1 :]
                    continue
                newline = carriage + 1
            if newline == -1:
                if len(pending) >= MAX_LINE_BYTES:
                    yield pending[:MAX_LINE_BYTES] + b"\n", True
                    pending = pending[MAX_LINE_BYTES:]
                    continue
                break
            yield pending[: newline + 1], True
            pending = pending[newline + 1 :]
    if pending:
        yield (pending if pending.endswith(b"\n") else pending + b"\n"), True


_TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ")


def _is_head(line: str) -> bool:
    return line.startswith(TRACEBACK_HEAD) or line.lstrip(" +").startswith(_GROUP_HEAD)


def _last_head(lines: Sequence[str], end: int) -> int | None:
    for i in range(end - 1, -1, -1):
        if _is_head(lines[i]):
            return i
    return None


def extract_traceback(lines: Sequence[str]) -> list[str]:
    """The last Python traceback in ``lines`` through to the end, with the
    exceptions chained to it (``During handling of the above exception...``).

    Args:
        lines: Stderr lines of one rank, oldest first.

    Returns:
        The lines from the traceback's first ``Traceback (most recent call
        last):`` to the end, or ``[]`` when there is no traceback.

    >>> extract_traceback(["Traceback (most recent call last):", "KeyError: 1", "",
    ...                    "During handling of the above exception, another exception occurred:",
    ...                    "", "Traceback (most recent call last):", "ValueError: 2"])[:2]
    ['Traceback (most recent call last):', 'KeyError: 1']
    >>> extract_traceback(["Segmentation fault"])
    []

    torch.distributed's ``[rank3]: `` line prefix (its excepthook's) is dropped:

    >>> extract_traceback(["[rank3]: Traceback (most recent call last):", "[rank3]: KeyError: 1"])
    ['Traceback (most recent call last):', 'KeyError: 1']
    """
    lines = [_TORCH_PREFIX.sub("", line, count=1) for line in lines]
    start = _last_head(lines, len(lines))
    if start is None:
        return []
    while True:
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j < 0 or lines[j].strip() not in _CHAIN_LINES:
            break
        previous = _last_head(lines, j)
        if previous is None:
            break
        start = previous
    return lines[start:]


def exit_code(returncode: int) -> int:
    """The shell's exit code for a ``subprocess`` return code: the code
    itself, or 128 + N for a process killed by signal N.

    >>> exit_code(3), exit_code(-9), exit_code(-15)
    (3, 137, 143)
    """
    return returncode if returncode >= 0 else 128 - returncode


def describe_returncode(returncode: int | None) -> str:
    """How a process ended, in words, from its ``subprocess`` return code.

    >>> describe_returncode(3), describe_returncode(-9)
    ('exit code 3', 'killed by SIGKILL (exit code 137)')
    """
    if returncode is None:
        return "still running"
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} (exit code {exit_code(returncode)})"


def last_lines(output: Sequence[tuple[str, str]], n: int) -> list[str]:
    """The last ``n`` lines that say something (blank ones left out) of a
    rank's output tail (:meth:`RankOutput.output_tail`), each marked with
    its stream.

    >>> last_lines([("stdout", "step 1"), ("stderr", ""), ("stdout", "fatal: no shard 3"),
    ...             ("stderr", "step 2/10")], 2)
    ['  stdout| fatal: no shard 3', '  stderr| step 2/10']
    """
    said = [(which, text) for which, text in output if text.strip()]
    return [f"  {which}| {text}" for which, text in said[-n:]] if n > 0 else []


def format_failure(
    failures: Sequence[tuple[int, int]],
    returncodes: Mapping[int, int | None],
    stderr_tail: Sequence[str],
    cmd: Sequence[str],
    output_tail: Sequence[tuple[str, str]] = (),
) -> str:
    """The summary printed when ranks failed.

    Args:
        failures: ``(rank, returncode)`` of the ranks that failed on their
            own, the first failure first.
        returncodes: The final return code of every rank.
        stderr_tail: The last stderr lines of the first failed rank.
        cmd: The command the ranks ran.
        output_tail: The last lines of the first failed rank on both
            streams (:meth:`RankOutput.output_tail`); where absent, its
            stderr tail stands in.

    Returns:
        Lines naming the failed rank and how it ended, the other ranks, the
        command, and the rank's traceback — or, when it printed none, its
        last lines on stdout and stderr.

    >>> print(format_failure([(1, 1)], {0: -15, 1: 1},
    ...       ["Traceback (most recent call last):", "ValueError: boom"], ["python", "t.py"]))
    ... # doctest: +NORMALIZE_WHITESPACE
    ========================================================================
    shardax launch: rank 1 failed first: exit code 1
      other ranks: rank 0: killed by SIGTERM (exit code 143)
      command: python t.py
      traceback of rank 1:
    Traceback (most recent call last):
    ValueError: boom
    ========================================================================
    >>> print(format_failure([(0, 2)], {0: 2}, [""], ["python", "t.py"],
    ...       [("stdout", "fatal: no shard 3"), ("stderr", "")]))
    ... # doctest: +NORMALIZE_WHITESPACE
    ========================================================================
    shardax launch: rank 0 failed first: exit code 2
      command: python t.py
      no Python traceback; the last 1 line(s) rank 0 wrote (stdout and stderr, in order):
      stdout| fatal: no shard 3
    ========================================================================
    """
    rank, code = failures[0]
    lines = ["=" * 72, f"shardax launch: rank {rank} failed first: {describe_returncode(code)}"]
    if code == -getattr(signal, "SIGKILL", 9):
        lines.append("  (a SIGKILL nobody sent is often the out-of-memory killer: see dmesg)")
    lines += [f"  also failed: rank {r}: {describe_returncode(c)}" for r, c in failures[1:]]
    failed = {r for r, _ in failures}
    others = [
        f"rank {r}: {describe_returncode(c)}" for r, c in returncodes.items() if r not in failed
    ]
    if others:
        lines.append("  other ranks: " + "; ".join(others))
    lines.append(f"  command: {shlex.join(cmd)}")
    traceback = extract_traceback(stderr_tail)
    output = output_tail or [("stderr", line) for line in stderr_tail]
    said = last_lines(output, LINES_WITHOUT_TRACEBACK)
    if traceback:
        lines += [f"  traceback of rank {rank}:", *traceback]
    elif said:
        lines += [
            f"  no Python traceback; the last {len(said)} line(s) rank {rank} wrote "
            "(stdout and stderr, in order):",
            *said,
        ]
    else:
        lines.append(f"  rank {rank} wrote nothing (no line on stdout or stderr)")
    lines.append("=" * 72)
    return "\n".join(lines)


def still_running(head: str, output: Sequence[tuple[str, str]]) -> list[str]:
    """``head`` and the last lines of a process still running at
    ``--timeout`` (its output tail, :meth:`RankOutput.output_tail`).

    >>> still_running("rank 1: killed by SIGTERM", [("stdout", "waiting")])
    ['rank 1: killed by SIGTERM; its last 1 line(s):', '  stdout| waiting']
    """
    said = last_lines(output, LINES_OF_A_RUNNING_RANK)
    what = f"its last {len(said)} line(s):" if said else "it wrote nothing"
    return [f"{head}; {what}", *said]


def format_timeout(
    timeout: float,
    running: Sequence[int],
    returncodes: Mapping[int, int | None],
    outputs: Mapping[int, Sequence[tuple[str, str]]],
    cmd: Sequence[str],
) -> str:
    """The summary printed when the job ran past ``shardax launch --timeout``.

    Args:
        timeout: The limit, in seconds.
        running: The ranks still running when it expired.
        returncodes: The final return code of every rank (those stopped included).
        outputs: The output tail of each rank (:meth:`RankOutput.output_tail`).
        cmd: The command the ranks ran.

    >>> print(format_timeout(5.0, [1], {0: 0, 1: -15}, {1: [("stdout", "waiting for rank 3")]},
    ...       ["python", "t.py"]))
    ... # doctest: +NORMALIZE_WHITESPACE
    ========================================================================
    shardax launch: the job ran past --timeout 5 s; 1 rank(s) were still running: rank 1
      rank 0: exit code 0
      rank 1: killed by SIGTERM (exit code 143); its last 1 line(s):
      stdout| waiting for rank 3
      command: python t.py
    ========================================================================
    """
    names = ", ".join(f"rank {r}" for r in running)
    lines = [
        "=" * 72,
        f"shardax launch: the job ran past --timeout {timeout:g} s; "
        f"{len(running)} rank(s) were still running: {names}",
    ]
    for rank, code in returncodes.items():
        if rank not in running:
            lines.append(f"  rank {rank}: {describe_returncode(code)}")
            continue
        lines += still_running(f"  rank {rank}: {describe_returncode(code)}", outputs.get(rank, ()))
    lines += [f"  command: {shlex.join(cmd)}", "=" * 72]
    return "\n".join(lines)
