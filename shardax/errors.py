"""The typed errors shardax raises.

Every error names what was wrong (the key path, shape, spec, mesh, rank or
collective), and how to fix it. None of them is raised by ``assert``.

>>> import shardax as sx
>>> try:
...     sx.AbstractMesh({"dp": 0})
... except sx.MeshError as e:
...     print(type(e).__name__)
MeshError
"""

from __future__ import annotations

import os

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "LaunchError",
    "MeshError",
    "PlanError",
    "ScheduleError",
    "ShardingError",
    "SplitTensorError",
    "USER_ERRORS",
    "UnmatchedRulesWarning",
    "UnshardedWeightWarning",
    "debugging",
]


class ShardingError(ValueError):
    """A spec, layout or rule that does not fit a tensor or a mesh."""


class SplitTensorError(ShardingError, TypeError, AttributeError):
    """A :class:`shardax.Sharded` value — one rank's piece of a tensor split
    over mesh axes — used where a whole tensor is needed: a torch function,
    a tensor method, indexing or arithmetic. The message names the call,
    the piece's and the whole tensor's shapes, the layout and the fix:
    :func:`shardax.gather` for the whole tensor, or a function that computes
    on the pieces (:func:`shardax.vocab_parallel_cross_entropy` for logits
    split over the vocabulary). It is also a ``TypeError`` (what torch
    raises for an argument of the wrong type) and an ``AttributeError``
    (``hasattr`` stays False for tensor methods)."""


class UnmatchedRulesWarning(UserWarning):
    """Rules none of which matches any tensor they are applied to (written
    for another model's names?): every tensor would be laid out as if there
    were no rules. Strict rules make it a :class:`ShardingError`."""


class UnshardedWeightWarning(UserWarning):
    """Tensor-parallel rules (``rules.megatron``) that leave weight matrices
    whole over their axis — names that missed a role, or a model with
    layers the names do not cover: each rank would hold and compute all of
    them. The message names them; a rule that replicates a weight on
    purpose (``Rule(path, P())``, placed before the preset's rules) silences
    it. Strict rules make it a :class:`ShardingError`."""


class MeshError(ValueError):
    """A mesh that cannot be built: bad axis names or sizes, or sizes that do
    not multiply to the world size."""


class CollectiveError(RuntimeError):
    """A collective that cannot run as asked (bad arguments, a backend that
    lacks the op, a process group that failed)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective that did not complete within the timeout.

    The message names the op, the mesh axes, the ranks of the group, and which
    of them did not arrive.
    """


class CollectiveMismatchError(CollectiveError):
    """The ranks of a group issued collectives that do not fit each other: a
    different op or reduction, dtype, element count, axes or collective
    number (a rank skipped one). Raised on every rank of the group before any
    data moves; the message names each rank's op, dtype, shape, axes and,
    where known, the key path being moved."""


class ScheduleError(ValueError):
    """A pipeline schedule that cannot run as written: an action on the
    wrong rank or outside the stages and micro-batches, a micro-batch not
    forwarded or backwarded exactly once, or an order in which some rank
    would wait forever (named with the action it waits at and what for)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked: keys missing or
    unexpected, shapes that differ, a corrupt or truncated file (named with
    the tensor), an unsafe file name in an index, a save not every rank
    joined."""


class LaunchError(RuntimeError):
    """``shardax launch`` could not start or supervise the ranks."""


class ConfigError(ValueError):
    """A run config that cannot be used as written: an unknown key (named
    with its section and the keys allowed there), a bad value, batch sizes
    that do not add up (all three named with the data-parallel size).
    ``key_path`` is the key it is about (``"optimizer.lr"``), where known:
    a config file's error names its line by it."""

    def __init__(self, message: str = "", key_path: str | None = None) -> None:
        super().__init__(message)
        self.key_path = key_path


class PlanError(ValueError):
    """A planner input that cannot be used as written: a cluster description
    with a bad or unknown field (named with the value and what it takes), an
    unknown preset (named with the presets), a dtype the cluster has no rate
    for, or a probe of this machine that could not run (and why).
    ``key_path`` is the field it is about (``"intra.bandwidth"``), where
    known: a cluster file's error names its line by it."""

    def __init__(self, message: str = "", key_path: str | None = None) -> None:
        super().__init__(message)
        self.key_path = key_path


USER_ERRORS = (
    ShardingError, MeshError, CollectiveError, CheckpointError, LaunchError, ConfigError,
    ScheduleError, PlanError,
)  # fmt: skip
"""The typed errors that say what was wrong with a setting or an input (a
command line shows their message, not a traceback)."""


def debugging() -> bool:
    """Whether ``SHARDAX_DEBUG`` asks for tracebacks (anything but unset, ``0``
    or empty).

    >>> import os
    >>> debugging() == (os.environ.get("SHARDAX_DEBUG", "0") not in ("", "0"))
    True
    """
    return os.environ.get("SHARDAX_DEBUG", "0") not in ("", "0")
