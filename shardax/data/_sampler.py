"""Which examples each rank loads at each step: a resumable, deterministic sampler.

Every rank computes the same global order of the examples for an epoch (a
permutation that depends only on the seed and the epoch) and cuts the same
global batch out of it at each step; then each rank keeps the part the data
axes give it — the rows :func:`shard_batch` would give it of the whole batch.
So each rank loads only its own examples, and nothing is communicated. A
sequence split (the spec's second entry) cuts each loaded example, so
:func:`batches` does it, batch by batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import optree
import torch

from ..mesh._mesh import AbstractMesh, Mesh
from ..shard._spec import PartitionSpec
from ._split import BATCH_SPEC, BatchSplit

__all__ = ["Sampler", "batches"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < minimum:
        bound = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be {bound}; got {value}")
    return int(value)


@attrs.frozen(init=False, repr=False)
class Sampler:
    """Per step, the indices of the examples this rank loads.

    Global step ``s`` is step ``s % steps_per_epoch`` of epoch
    ``s // steps_per_epoch``. Each epoch's order is a permutation drawn from
    a ``torch.Generator`` seeded from ``(seed, epoch)`` alone (never the
    global RNG), so every rank, every run and every resumed run agrees. A
    step's global batch is the next ``global_batch_size`` examples of that
    order; this rank gets its piece of it over the data axes of ``spec``
    (chunk semantics, like :func:`shard_batch`): ranks that differ only along
    other axes (``tp``) load the same examples. A second spec entry, the axes
    splitting the sequence (``P("dp", zigzag("cp"))``), does not change which
    examples a rank loads — the ``cp`` ranks of a ``dp`` coordinate load the
    same ones — but :func:`batches` cuts each loaded batch's sequence to this
    rank's part.

    Iterating yields lists of indices from ``start_step`` on, across epochs,
    without end (take what you need: ``itertools.islice``); that also makes it
    a ``batch_sampler`` for ``torch.utils.data.DataLoader``. To resume at
    global step ``s``, iterate ``iter_from(s)`` (or build the sampler with
    ``start_step=s``): it yields exactly what an uninterrupted run yields from
    step ``s`` on.

    Args:
        num_examples: the size of the dataset.
        global_batch_size: examples per step over all data ranks; a multiple
            of the data axes' size.
        mesh: the mesh (a live one, or an :class:`~shardax.AbstractMesh` with
            ``rank``).
        spec: the axes splitting the examples of each batch, e.g.
            ``P("dp")``; optionally a second entry splitting the sequence,
            e.g. ``P("dp", "cp")`` or ``P("dp", zigzag("cp"))`` (see
            :func:`shard_batch`; :func:`batches` applies it).
        shuffle: a fresh permutation each epoch; False: ``0, 1, 2, ...``.
        seed: a non-negative int.
        drop_last: drop the examples of each epoch that do not fill a
            global batch. False keeps them as a smaller last batch, split with
            chunk semantics (some ranks may get fewer examples, or none).
        start_step: the global step iteration starts at.
        rank: whose indices (default: this process's rank on a live mesh).

    Raises:
        ShardingError: the batch does not split evenly over the data axes,
            or the spec does not fit the mesh.
        ValueError: a size that is not positive, or a global batch larger
            than the dataset when ``drop_last``.
        TypeError: a size that is not an int, a flag that is not a bool.

    >>> import shardax as sx
    >>> sampler = sx.data.Sampler(10, 4, sx.Mesh({"dp": 1}), seed=1)
    >>> sampler
    Sampler(10, 4, Mesh({'dp': 1}), P('dp'), shuffle=True, seed=1, drop_last=True, start_step=0)
    >>> sampler.steps_per_epoch, sampler.epoch_of(5)
    (2, 2)
    >>> mesh = sx.AbstractMesh({"dp": 2, "tp": 2})
    >>> [sx.data.Sampler(8, 4, mesh, shuffle=False, rank=r).indices(1) for r in range(4)]
    [[4, 5], [4, 5], [6, 7], [6, 7]]
    >>> mesh = sx.AbstractMesh({"dp": 2, "cp": 2})
    >>> spec = sx.P("dp", sx.zigzag("cp"))
    >>> [sx.data.Sampler(8, 4, mesh, spec, shuffle=False, rank=r).indices(1) for r in range(4)]
    [[4, 5], [4, 5], [6, 7], [6, 7]]
    """

    num_examples: int
    global_batch_size: int
    mesh: AbstractMesh
    spec: PartitionSpec
    shuffle: bool
    seed: int
    drop_last: bool
    start_step: int
    rank: int

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        mesh: AbstractMesh,
        spec: PartitionSpec = BATCH_SPEC,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        start_step: int = 0,
        rank: int | None = None,
    ) -> None:
        n = _check_int("num_examples", num_examples, 1)
        b = _check_int("global_batch_size", global_batch_size, 1)
        seed = _check_int("seed", seed, 0)
        start_step = _check_int("start_step", start_step, 0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False; got {flag!r}")
        split = BatchSplit(mesh, spec, rank)
        split.check_divisible(b, "a global batch")
        if drop_last and b > n:
            fits = n // split.size * split.size
            fix = f"a global batch of at most {fits}" if fits else "a dataset of more examples"
            raise ValueError(
                f"a global batch of {b} examples is larger than the dataset ({n} examples), so "
                f"drop_last=True leaves no step at all; use {fix}, or drop_last=False"
            )
        self.__attrs_init__(
            n, b, mesh, split.spec, shuffle, seed, drop_last, start_step, split.rank
        )

    # -- sizes -----------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int:
        """Global batches per pass over the data."""
        if self.drop_last:
            return self.num_examples // self.global_batch_size
        return -(-self.num_examples // self.global_batch_size)

    @property
    def _split(self) -> BatchSplit:
        return BatchSplit(self.mesh, self.spec, self.rank)

    @property
    def local_batch_size(self) -> int:
        """Examples this rank loads at a full step (the global batch divided by
        the data axes' size)."""
        return self.global_batch_size // self._split.size

    def epoch_of(self, step: int) -> int:
        """The epoch global step ``step`` belongs to."""
        return _check_int("step", step, 0) // self.steps_per_epoch

    # -- indices ---------------------------------------------------------------
    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of all examples in ``epoch`` (the same on every rank).

        >>> import shardax as sx
        >>> sx.data.Sampler(5, 1, sx.Mesh({"dp": 1}), shuffle=False).permutation(3)
        tensor([0, 1, 2, 3, 4])
        """
        epoch = _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return torch.arange(self.num_examples)
        # mix (seed, epoch) into one 64-bit seed: (0, 1) and (1, 0) differ
        mixed = np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0]
        generator = torch.Generator().manual_seed(int(mixed))
        return torch.randperm(self.num_examples, generator=generator)

    def global_indices(self, step: int) -> list[int]:
        """The examples of the whole global batch at ``step`` (all ranks')."""
        return self._global(step, self.permutation(self.epoch_of(step)))

    def indices(self, step: int) -> list[int]:
        """The examples this rank loads at global step ``step``."""
        return self._local(self.global_indices(step), self._split)

    def iter_from(self, step: int) -> Iterator[list[int]]:
        """This rank's indices for global steps ``step, step + 1, ...`` (across
        epochs, without end): exactly what an uninterrupted run yields there.

        >>> import itertools, shardax as sx
        >>> sampler = sx.data.Sampler(4, 2, sx.Mesh({"dp": 1}), shuffle=False)
        >>> list(itertools.islice(sampler.iter_from(1), 3))
        [[2, 3], [0, 1], [2, 3]]
        """
        step = _check_int("step", step, 0)
        return self._iter(step)

    def __iter__(self) -> Iterator[list[int]]:
        return self._iter(self.start_step)

    def _iter(self, step: int) -> Iterator[list[int]]:
        split, epoch, order = self._split, -1, torch.empty(0, dtype=torch.long)
        for s in itertools.count(step):
            if self.epoch_of(s) != epoch:
                epoch = self.epoch_of(s)
                order = self.permutation(epoch)
            yield self._local(self._global(s, order), split)

    def _global(self, step: int, order: torch.Tensor) -> list[int]:
        start = (step % self.steps_per_epoch) * self.global_batch_size
        return order[start : start + self.global_batch_size].tolist()

    @staticmethod
    def _local(global_indices: list[int], split: BatchSplit) -> list[int]:
        start, stop = split.bounds(len(global_indices))
        return global_indices[start:stop]

    def __repr__(self) -> str:
        rank = ""
        if not (isinstance(self.mesh, Mesh) and self.mesh.rank == self.rank):
            rank = f", rank={self.rank}"
        return (
            f"Sampler({self.num_examples}, {self.global_batch_size}, {self.mesh!r}, "
            f"{self.spec!r}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, start_step={self.start_step}{rank})"
        )


def batches(
    dataset: Any,
    sampler: Sampler,
    *,
    start_step: int | None = None,
    num_steps: int | None = None,
) -> Iterator[Any]:
    """This rank's local batches: the sampler's examples, stacked leaf by leaf.

    ``dataset[i]`` is one example, a pytree of tensors (or numbers), e.g.
    ``{"x": ..., "y": ...}``; a batch is the same pytree with the examples
    stacked on a new dim 0. Single process, no workers, deterministic. When
    the sampler's spec splits the sequence too (a second entry), each batch
    keeps this rank's part of dim 1 of every leaf of two dims or more, as
    :func:`shard_batch` would (the other leaves whole).

    Args:
        dataset: indexable by int; ``len(dataset)``, when it has one, must
            equal ``sampler.num_examples``.
        sampler: which examples, step by step.
        start_step: the global step to start at (default
            ``sampler.start_step``): resume there.
        num_steps: how many batches; None: without end, over the epochs.

    >>> import torch, shardax as sx
    >>> data = [{"x": torch.tensor([i, i]), "y": torch.tensor(i)} for i in range(6)]
    >>> sampler = sx.data.Sampler(6, 2, sx.Mesh({"dp": 1}), shuffle=False)
    >>> for batch in sx.data.batches(data, sampler, start_step=2, num_steps=2):
    ...     print(batch["x"].tolist(), batch["y"].tolist())
    [[4, 4], [5, 5]] [4, 5]
    [[0, 0], [1, 1]] [0, 1]

    The sequence split zigzag over ``cp`` (rank 1 is ``dp`` 0, ``cp`` 1):

    >>> data = [{"x": torch.arange(8) + 10 * i, "y": torch.tensor(i)} for i in range(4)]
    >>> mesh, spec = sx.AbstractMesh({"dp": 2, "cp": 2}), sx.P("dp", sx.zigzag("cp"))
    >>> sampler = sx.data.Sampler(4, 4, mesh, spec, shuffle=False, rank=1)
    >>> batch = next(sx.data.batches(data, sampler))
    >>> batch["x"].tolist(), batch["y"].tolist()
    ([[2, 3, 4, 5], [12, 13, 14, 15]], [0, 1])
    """
    if not isinstance(sampler, Sampler):
        raise TypeError(f"batches needs a shardax.data.Sampler; got {sampler!r}")
    if hasattr(dataset, "__len__") and len(dataset) != sampler.num_examples:
        raise ValueError(
            f"the dataset has {len(dataset)} examples but the sampler is for "
            f"{sampler.num_examples}; build the sampler with num_examples=len(dataset)"
        )
    start = sampler.start_step if start_step is None else _check_int("start_step", start_step, 0)
    steps: Iterator[list[int]] = sampler.iter_from(start)
    if num_steps is not None:
        steps = itertools.islice(steps, _check_int("num_steps", num_steps, 0))
    split = sampler._split
    return (split.split_sequence(_stack(dataset, idx)) for idx in steps)


def _stack(dataset: Any, indices: Sequence[int]) -> Any:
    if not indices:  # a short last batch can leave a rank none: keep the shapes
        example = dataset[0]
        return optree.tree_map(lambda x: torch.as_tensor(x).unsqueeze(0)[:0], example)
    examples = [dataset[i] for i in indices]
    return optree.tree_map(lambda *xs: torch.stack([torch.as_tensor(x) for x in xs]), *examples)
