"""Host memory the launcher keeps for its ranks across restarts: one
folder per slot under ``/dev/shm`` (RAM, never a disk), where in-memory
checkpoints live (:class:`shardax.ckpt.MemoryCheckpointManager`).

A rank's processes come and go — a restart stops every one of them — but
the folders belong to the node's launcher: they outlive the ranks and are
removed when the launcher exits, whatever ends it. If the launcher itself is
killed (SIGKILL, a crash), a small guard process started with the folders
removes them. A slot the launcher counts as lost (``--elastic``) loses its
folder at once, as a failed host loses its memory: what survives of that
rank's shards is the copy its peer keeps.

>>> import tempfile
>>> memory = HostMemory.create(2, Path(tempfile.mkdtemp()))  # /dev/shm by default
>>> sorted(p.name for p in memory.root.iterdir())
['slot-000', 'slot-001']
>>> memory.close()
>>> memory.root.exists()
False
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from ._launcher import _dismiss_guard

__all__ = ["MEMORY_ENV", "SHM", "HostMemory"]

MEMORY_ENV = "SHARDAX_MEMORY_DIR"
"""Set in each rank: its slot's folder of host memory (see the module)."""
SHM = Path("/dev/shm")
PREFIX = "shardax-mem-"

_GUARD = """\
import shutil, sys, time
if sys.stdin.buffer.read() != b"done":
    for attempt in range(3):  # ranks still dying may write a last file
        shutil.rmtree(sys.argv[1], ignore_errors=True)
        time.sleep(0.5)
"""


class HostMemory:
    """``root/slot-NNN`` folders in ``/dev/shm``, one per slot, owned by
    this launcher (:meth:`close` removes them; a guard does if the launcher
    dies first)."""

    def __init__(self, root: Path, guard: subprocess.Popen | None) -> None:
        self.root, self.guard = root, guard

    @classmethod
    def create(cls, slots: int, where: Path = SHM) -> HostMemory | None:
        """Folders for ``slots`` slots, or None where there is no
        ``/dev/shm`` (then the ranks get no ``SHARDAX_MEMORY_DIR``)."""
        if not where.is_dir() or not os.access(where, os.W_OK):
            return None
        root = where / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        root.mkdir(mode=0o700)
        for k in range(slots):
            (root / f"slot-{k:03d}").mkdir()
        try:
            guard = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD, str(root)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            guard = None
        return cls(root, guard)

    def slot(self, k: int) -> Path:
        """Slot ``k``'s folder."""
        return self.root / f"slot-{k:03d}"

    def drop(self, slots: Iterable[int]) -> None:
        """Forget the memory of lost slots: remove their folders."""
        for k in slots:
            shutil.rmtree(self.slot(k), ignore_errors=True)

    def close(self) -> None:
        """Remove every folder, and dismiss the guard."""
        shutil.rmtree(self.root, ignore_errors=True)
        guard, self.guard = self.guard, None
        _dismiss_guard(guard)

    def __repr__(self) -> str:
        return f"HostMemory({str(self.root)!r})"
