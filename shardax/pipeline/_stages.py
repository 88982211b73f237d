"""Splitting a model into pipeline stages, without rewriting it.

A transformer is an embedding, a list of blocks, and a head: every model we
meet (the example GPT's ``blocks``, Hugging Face GPT-2's ``transformer.h``,
Llama's ``model.layers``) keeps its blocks in one ``nn.ModuleList`` and
calls them in order. :func:`split` cuts that list into consecutive runs of
blocks, one per stage. Everything outside the list (embeddings, final norm,
head, rotary tables: the *outer* parameters) lives on the first and the
last stage, which both run the model's own code around the blocks; the
gradients the two compute for them are summed. Nothing of the model is
traced or rewritten: whatever its blocks take besides the hidden state
(masks, positions, rotary embeddings) is recomputed by each stage from
the inputs, so only the hidden state crosses between stages.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from ..errors import ScheduleError
from ._schedule import Schedule

__all__ = ["Stages", "split"]


def _counts(value: Iterable[int]) -> tuple[int, ...]:
    counts = tuple(value)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ScheduleError(f"Stages: each stage has a whole number >= 1 of blocks; got {counts!r}")
    return counts


@attrs.frozen
class Stages:
    """How a model's blocks are cut: stage ``s`` runs blocks
    ``starts[s] .. starts[s] + counts[s] - 1`` of the ``nn.ModuleList`` at
    ``blocks`` (a module path); the first and the last stage also hold the
    outer parameters. ``shared``: outer tensors every stage holds — the
    buffers (rotary tables) and any outer parameter whose value reaches the
    blocks other than through the hidden state (a relative-position bias).

    >>> from shardax.pipeline import Stages
    >>> s = Stages("blocks", (2, 2))
    >>> s.block_range(1), s.stage_of("blocks.3.attn.qkv.weight"), s.stage_of("wte.weight")
    (range(2, 4), 1, None)
    """

    blocks: str
    counts: tuple[int, ...] = attrs.field(converter=_counts)
    shared: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def stages(self) -> int:
        return len(self.counts)

    @property
    def n_blocks(self) -> int:
        return sum(self.counts)

    def block_range(self, stage: int) -> range:
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def stage_of(self, key: str) -> int | None:
        """The stage of the block parameter ``key``; None for an outer one."""
        prefix = self.blocks + "."
        if not key.startswith(prefix):
            return None
        index = int(key[len(prefix) :].split(".", 1)[0])
        start = 0
        for s, n in enumerate(self.counts):
            if index < start + n:
                return s
            start += n
        raise ScheduleError(f"{key!r}: block {index} is past the {self.n_blocks} blocks split")

    def held(self, key: str, stages: Iterable[int]) -> bool:
        """Whether a rank running ``stages`` holds parameter ``key``."""
        mine = set(stages)
        s = self.stage_of(key)
        if key in self.shared:
            return True
        if s is None:
            return bool(mine & {0, self.stages - 1})
        return s in mine

    def local(self, params: Mapping[str, Any], schedule: Schedule, rank: int) -> dict[str, Any]:
        """The entries of ``params`` that pipeline rank ``rank`` holds under
        ``schedule`` (the stages placed on it)."""
        self.check(schedule)
        mine = [s for s, r in enumerate(schedule.stage_rank) if r == rank]
        return {k: v for k, v in params.items() if self.held(k, mine)}

    def check(self, schedule: Schedule) -> None:
        if schedule.stages != self.stages:
            raise ScheduleError(
                f"the model is split into {self.stages} stages but the schedule runs "
                f"{schedule.stages} (split(model, {schedule.stages}, ...), or a schedule "
                f"for {self.stages} stages)"
            )


def find_blocks(model: nn.Module) -> str:
    """The path of the model's longest ``nn.ModuleList`` (its blocks)."""
    best: tuple[int, str] | None = None
    for path, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and (best is None or len(module) > best[0])
        ):
            best = (len(module), path)
    if best is None:
        raise ScheduleError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to split into stages; "
            "name one with split(..., blocks='path.to.blocks')"
        )
    return best[1]


def split(
    model: nn.Module,
    stages: int | Schedule,
    *,
    blocks: str | None = None,
    balance: str | Sequence[int] = "layers",
    shared: Iterable[str] = (),
    sample: Any = None,
) -> Stages:
    """Cut ``model``'s blocks into ``stages`` consecutive runs.

    Args:
        model: the model (on ``meta`` is fine: only shapes are read).
        stages: how many stages (a schedule's ``stages``: ranks × virtual
            stages per rank), or the schedule itself: then ``"params"`` and
            ``"time"`` balance each rank's load — its stages together
            (an interleaved or V placement), not each stage's.
        blocks: the path of the ``nn.ModuleList`` of blocks; None: the
            model's longest one.
        balance: ``"layers"`` (the same number of blocks per stage: they
            must divide evenly), ``"params"`` (consecutive runs with the
            fewest parameters on the busiest stage, the outer parameters
            counted on the first and last stage), ``"time"`` (the least
            forward-and-backward time on the busiest stage, each block
            timed on ``sample``; the model must be real, not on ``meta``;
            its ``.grad`` are left as they are), or the
            number of blocks of each stage.
        shared: outer parameters every stage needs besides the buffers
            (which every stage holds): those whose values reach the blocks
            other than through the hidden state. Their gradients are summed
            over the pipeline. One left out is found by the executor's
            first step (a ``ScheduleError`` naming it, on every rank).
        sample: with ``balance="time"``, the model's input (or a tuple of
            its positional inputs) to time the blocks on.

    >>> import torch, shardax as sx
    >>> model = torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(6)))
    >>> sx.pipeline.split(model, 3)
    Stages(blocks='0', counts=(2, 2, 2), shared=())
    >>> sx.pipeline.split(model, 4)
    Traceback (most recent call last):
    ...
    shardax.errors.ScheduleError: 6 blocks do not split evenly into 4 stages; use 1, 2, 3 or 6 stages, balance='params', or give each stage's count (balance=[2, 2, 1, 1])
    """
    placement: tuple[int, ...] | None = None
    if isinstance(stages, Schedule):
        placement, stages = stages.stage_rank, stages.stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"split: stages is an int >= 1 or a Schedule; got {stages!r}")
    path = find_blocks(model) if blocks is None else blocks
    try:
        container = model.get_submodule(path)
    except AttributeError as err:
        raise ScheduleError(f"split: the model has no module {path!r} ({err})") from None
    if not isinstance(container, nn.ModuleList):
        raise ScheduleError(
            f"split: {path!r} is a {type(container).__name__}, not an nn.ModuleList"
        )
    n = len(container)
    prefix = path + "."
    common = tuple(k for k, _ in model.named_buffers() if not k.startswith(prefix))
    common += tuple(k for k in shared if k not in common)
    if stages > n:
        raise ScheduleError(f"{n} blocks cannot fill {stages} stages (at most {n}: one block each)")
    if balance == "layers":
        if n % stages:
            fits = [d for d in range(1, n + 1) if n % d == 0]
            even = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
            raise ScheduleError(
                f"{n} blocks do not split evenly into {stages} stages; use "
                f"{', '.join(map(str, fits[:-1]))} or {fits[-1]} stages, balance='params', or "
                f"give each stage's count (balance={even})"
            )
        return Stages(path, (n // stages,) * stages, common)
    if balance == "params":
        return Stages(path, _by_params(model, path, container, stages, placement), common)
    if balance == "time":
        return Stages(path, _by_time(container, model, sample, stages, placement), common)
    if isinstance(balance, str):
        raise ScheduleError(
            f"split: balance is 'layers', 'params', 'time' or a list of counts; got {balance!r}"
        )
    counts = _counts(balance)
    if len(counts) != stages or sum(counts) != n:
        raise ScheduleError(
            f"split: balance={list(counts)} must give {stages} counts summing to the {n} blocks"
        )
    return Stages(path, counts, common)


def _by_params(
    model: nn.Module,
    path: str,
    container: nn.ModuleList,
    stages: int,
    placement: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """Consecutive runs with the fewest parameters on the busiest stage,
    the outer parameters on the first and the last."""
    sizes = [float(sum(p.numel() for p in b.parameters())) for b in container]
    inside = {id(p) for p in container.parameters()}
    outer = float(sum(p.numel() for p in model.parameters() if id(p) not in inside))
    return _balance(sizes, stages, outer, outer, placement)


def _by_time(
    container: nn.ModuleList,
    model: nn.Module,
    sample: Any,
    stages: int,
    placement: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """Consecutive runs with the least forward-and-backward time on the
    busiest stage (or rank): each block timed on ``sample`` (the median of
    3 runs, after one to warm up), what runs before the first block counted on the first stage,
    after the last one (the head and the loss) on the last."""
    if sample is None:
        raise ScheduleError("split(balance='time') times the model on an input: pass sample=")
    args = sample if isinstance(sample, tuple) else (sample,)
    runs = [_timed_run(model, list(container), args) for _ in range(4)][1:]  # the first: warm-up
    median = [sorted(col)[1] for col in zip(*runs, strict=True)]
    return _balance(median[1:-1], stages, median[0], median[-1], placement)


def _timed_run(model: nn.Module, blocks: list[nn.Module], args: tuple[Any, ...]) -> list[float]:
    """One forward and backward of ``model`` on ``args``: the time of what
    runs before the first block, of each block, and after the last one,
    forward and backward together. The backward is timed where the hidden
    state's gradient arrives at each block's input (and at the last
    block's output); where a block's output carries no gradient (a block
    that does not train), each part's backward is taken as twice its
    forward."""
    forward: list[float] = []
    backward: dict[
        int, float
    ] = {}  # block i's input (n: the last block's output) -> its grad's time

    def arrived(index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            backward.setdefault(index, time.perf_counter())

        return hook

    def entered(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            forward.append(time.perf_counter())
            x = a[0] if a else kw.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(arrived(index))

        return hook

    def left(module: nn.Module, a: tuple[Any, ...], out: Any) -> None:
        forward.append(time.perf_counter())
        y = _first_tensor(out)
        if y is not None and y.requires_grad:
            y.register_hook(arrived(len(blocks)))

    handles = [
        b.register_forward_pre_hook(entered(i), with_kwargs=True) for i, b in enumerate(blocks)
    ]
    handles.append(blocks[-1].register_forward_hook(left))
    try:
        start = time.perf_counter()
        out = _first_tensor(model(*args))
        mid = time.perf_counter()
        trained = [p for p in model.parameters() if p.requires_grad]
        if out is not None and out.requires_grad:  # the model's .grad left as it was
            torch.autograd.grad(out.float().sum(), trained, allow_unused=True)
        end = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    if len(forward) != len(blocks) + 1:
        raise ScheduleError(
            f"split(balance='time'): the model called its {len(blocks)} blocks "
            f"{len(forward) - 1} times on the sample; each block is called once, in order"
        )
    marks = [start, *forward, mid]
    fwd = [b - a for a, b in itertools.pairwise(marks)]  # before, each block, after
    backward.setdefault(0, end)  # the first block's input needs no gradient: nothing before trains
    if len(backward) != len(blocks) + 1:
        return [3 * t for t in fwd]
    back = [backward[i] for i in range(len(blocks) + 1)]  # arrival at block i's input; n: output
    bwd = [end - back[0]]  # what runs before the first block: its backward comes last
    bwd += [back[i] - back[i + 1] for i in range(len(blocks))]
    bwd.append(back[len(blocks)] - mid)  # the head and the loss: the first to run backward
    return [f + b for f, b in zip(fwd, bwd, strict=True)]


def _first_tensor(out: Any) -> torch.Tensor | None:
    """The model's output tensor (the first of a tuple, or of a Hugging
    Face output's fields)."""
    if isinstance(out, torch.Tensor):
        return out
    values = (
        out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    )
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _balance(
    sizes: Sequence[float],
    stages: int,
    first: float,
    last: float,
    placement: tuple[int, ...] | None,
) -> tuple[int, ...]:
    """:func:`partition`, or — where ranks hold several stages — the cut
    whose busiest *rank* has the least load (every cut tried, up to 200,000
    of them; beyond, the stage-level partition)."""
    if placement is None or len(set(placement)) == stages:
        return partition(sizes, stages, first, last)
    n = len(sizes)
    if math.comb(n - 1, stages - 1) > 200_000:
        return partition(sizes, stages, first, last)
    prefix = [0.0, *itertools.accumulate(sizes)]
    best: tuple[float, tuple[int, ...]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        load: dict[int, float] = {}
        for s in range(stages):
            extra = (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)
            work = prefix[bounds[s + 1]] - prefix[bounds[s]] + extra
            load[placement[s]] = load.get(placement[s], 0.0) + work
        worst = max(load.values())
        if best is None or worst < best[0]:
            best = (worst, tuple(b - a for a, b in itertools.pairwise(bounds)))
    assert best is not None
    return best[1]


def partition(
    sizes: Sequence[float], stages: int, first: float = 0.0, last: float = 0.0
) -> tuple[int, ...]:
    """The counts of ``stages`` consecutive, non-empty runs of ``sizes``
    whose largest load (its sizes, plus ``first`` on the first run and
    ``last`` on the last) is the least (exact: dynamic programming).

    >>> partition([1, 1, 1, 1, 4], 2), partition([1, 1, 1, 1], 2, first=2.0)
    ((4, 1), (1, 3))
    """
    n = len(sizes)
    prefix = [0.0, *itertools.accumulate(sizes)]
    inf = float("inf")
    # best[k][i]: the least largest load of blocks [0, i) in k + 1 runs; cut[k][i]: the last run's start
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = prefix[i] + first + (last if stages == 1 else 0.0)
    for k in range(1, stages):
        extra = last if k == stages - 1 else 0.0
        for i in range(k + 1, n + 1):
            for j in range(k, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    counts, i = [], n
    for k in range(stages - 1, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    counts.append(i)
    return tuple(reversed(counts))


def stand_in(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` that takes no memory: what a stage passes for
    the parameters of blocks it skips and of outer modules it only runs to
    recompute what its blocks take (their outputs are replaced)."""
    return torch.zeros((), dtype=dtype).expand(tuple(shape))
