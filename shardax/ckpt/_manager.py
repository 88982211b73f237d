"""``CheckpointManager``: save every N steps into numbered directories, keep
the last K, find the latest complete one and resume from it."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ._format import INDEX
from ._load import load
from ._save import AsyncSave, save, save_async, wait_pending

__all__ = ["CheckpointManager"]

_STEP = re.compile(r"step-(\d{8,})")


def _positive(name: str, allow_none: bool = False) -> Any:
    def check(_: Any, __: Any, value: Any) -> None:
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"CheckpointManager {name} must be a positive int; got {value!r}")

    return check


@attrs.frozen
class CheckpointManager:
    """Numbered checkpoints ``directory/step-00000042`` of one run.

    Args:
        directory: where the run's checkpoints live.
        every: ``save`` writes only on steps that are multiples of this.
        keep: keep the newest ``keep`` checkpoints, deleting older ones once a
            new one is committed (None keeps all).
        async_save: write in the background (see ``save_async``).

    >>> import tempfile, torch
    >>> from shardax.ckpt import CheckpointManager
    >>> mgr = CheckpointManager(tempfile.mkdtemp(), every=2, keep=2)
    >>> for step in range(1, 7):
    ...     _ = mgr.save(step, {"w": torch.full((2,), float(step)), "step": step})
    >>> mgr.steps()
    [4, 6]
    >>> step, state = mgr.restore({"w": torch.zeros(2), "step": 0})
    >>> step, state["w"]
    (6, tensor([6., 6.]))
    """

    directory: Path = attrs.field(converter=lambda p: Path(p).absolute())
    every: int = attrs.field(default=1, validator=_positive("every"))
    keep: int | None = attrs.field(default=None, validator=_positive("keep", allow_none=True))
    async_save: bool = False

    def path(self, step: int) -> Path:
        """The directory of step ``step``'s checkpoint."""
        return self.directory / f"step-{step:08d}"

    def steps(self) -> list[int]:
        """The steps with a complete (committed) checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in os.scandir(self.directory):
            m = _STEP.fullmatch(entry.name)
            if m and entry.is_dir() and os.path.exists(os.path.join(entry.path, INDEX)):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _prune(self, new: int) -> None:
        if self.keep is None:
            return
        for step in [s for s in self.steps() if s != new][: -self.keep + 1 or None]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def save(
        self,
        step: int,
        tree: Any,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> Path | AsyncSave | None:
        """Save ``tree`` as step ``step`` if ``step`` is a multiple of
        ``every`` (or ``force``); None when skipped. Collective."""
        if not force and step % self.every:
            return None
        meta = {"step": step, **(metadata or {})}
        fn = save_async if self.async_save else save
        return fn(self.path(step), tree, metadata=meta, _on_commit=lambda: self._prune(step))

    def wait(self) -> None:
        """Wait for a background save (raising its error)."""
        wait_pending()

    def restore(
        self, target: Any, *, step: int | None = None, rng: bool | str = "reseed", **kwargs: Any
    ) -> tuple[int, Any] | None:
        """``(step, tree)`` loaded from the latest complete checkpoint (or
        ``step``'s) into ``target``; None when there is none. ``rng``:
        ``"reseed"`` (the default: each rank's RNG states restored where the
        world size matches the saving run's, else seeded from the
        checkpoint and the rank, so a resume works on any number of ranks),
        ``"restore"`` (True: restored exactly, or an error on another world
        size) or ``"skip"`` (False); see :func:`~shardax.ckpt.load`.
        ``kwargs`` go to ``load``."""
        wait_pending()
        step = self.latest() if step is None else step
        if step is None:
            return None
        return step, load(self.path(step), target, rng=rng, **kwargs)
