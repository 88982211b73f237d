"""``search``: every layout of a search space predicted, those that fit
ranked by tokens/s.

Two passes keep it fast on large clusters: every candidate is first
estimated with the ZeRO arithmetic for its state and closed forms for the
pipeline bubble; the fastest of those that nearly fit are then estimated
exactly — the state by :func:`shardax.explain` of the rank's stages (cached
per sharding), the bubble by simulating the schedule (cached per shape).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import attrs
from torch import nn

from ..config import RunConfig
from ..errors import ConfigError, PlanError
from ._cluster import Cluster
from ._cost import Estimate, predict, state_bytes
from ._model import ModelShape
from ._table import layout_name, render

__all__ = ["Ranking", "Space", "search"]

SCREEN_MARGIN = 1.15  # the arithmetic may miss a rank's share of uneven splits


def _ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class Space:
    """The layouts :func:`search` tries, each field a tuple of choices.
    ``None`` picks for the model and cluster: ``tp`` and ``sp`` (Ulysses)
    powers of two within a node dividing the heads; ``pp`` divisors of the
    blocks up to 64; ``ep``, for a mixture of experts, powers of two
    dividing the experts (not with a pipeline); ``micro`` (sequences per
    micro-batch) powers of two up to 16. ``virtual``: the stages per rank
    of the interleaved schedules; ``offload_opt``: where the optimizer
    state may live (``"host"``, ``"disk:PATH"``).

    >>> Space(zero=(3,), remat=(None,))
    Space(tp=None, pp=None, sp=None, ep=None, zero=(3,), micro=None, schedules=('1f1b', 'interleaved_1f1b', 'zbv'), virtual=(2,), remat=(None,), sequence_parallel=(False, True), offload_opt=(None, 'host'), data=('flat',))
    """

    tp: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    pp: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    sp: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    ep: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    zero: tuple[int, ...] = attrs.field(default=(0, 1, 2, 3), converter=_ints)
    micro: tuple[int, ...] | None = attrs.field(default=None, converter=_ints)
    schedules: tuple[str, ...] = attrs.field(
        default=("1f1b", "interleaved_1f1b", "zbv"), converter=tuple
    )
    virtual: tuple[int, ...] = attrs.field(default=(2,), converter=_ints)
    remat: tuple[str | None, ...] = attrs.field(
        default=(None, "save_nothing", "save_matmuls"), converter=tuple
    )
    sequence_parallel: tuple[bool, ...] = attrs.field(default=(False, True), converter=tuple)
    offload_opt: tuple[str | None, ...] = attrs.field(default=(None, "host"), converter=tuple)
    data: tuple[str, ...] = attrs.field(default=("flat",), converter=tuple)
    """How the data ranks split the state when they span nodes: ``"flat"``
    (ZeRO over all of them), ``"hsdp"`` (ZeRO-2/3 within a node, replicas
    across: ``parallel.replicate``), ``"zeropp"`` (ZeRO-3 over all of them
    with ZeRO++'s int8 weight gathers, a secondary copy in the node and
    int4 gradient reductions)."""

    @data.validator
    def _check_data(self, _: Any, value: tuple[str, ...]) -> None:
        unknown = [v for v in value if v not in ("flat", "hsdp", "zeropp")]
        if unknown or not value:
            raise PlanError(f"Space.data takes some of 'flat', 'hsdp', 'zeropp'; got {value!r}")


@attrs.frozen
class Ranking:
    """The plans that fit, fastest first (``plans``), how many layouts were
    tried and why the others were left out. ``str()`` is the table
    ``shardax plan`` prints; :meth:`why` explains one plan; :meth:`config`
    is its run config."""

    plans: tuple[Estimate, ...]
    tried: int
    left_out: dict[str, int]
    budget: float

    @property
    def best(self) -> Estimate:
        return self.plans[0]

    def config(self, i: int = 0) -> RunConfig:
        return self.plans[i].config

    def config_text(self, i: int = 0) -> str:
        """The run config of plan ``i`` as hjson, for ``examples/train_gpt.py
        --config`` and ``shardax config check``."""
        import hjson

        est = self.plans[i]
        head = (
            f"// shardax plan: {layout_name(est)}\n"
            f"// predicted {est.tokens_per_s:,.0f} tokens/s, {est.step_time:.3g} s/step, "
            f"{est.peak_memory / 2**30:.1f} GiB peak per rank on {est.world_size} devices\n"
        )
        return head + hjson.dumps(est.config.to_dict(), indent=2) + "\n"

    def why(self, i: int = 0) -> str:
        """Every part of plan ``i``'s time and memory, and what it assumed."""
        est = self.plans[i]
        lines = [f"{layout_name(est)}: {est.step_time:.4g} s per step"]
        lines += [f"  time {k}: {v:.4g} s" for k, v in est.time.items() if v]
        lines += [f"  memory {k}: {v / 2**30:.3f} GiB" for k, v in est.memory.items() if v]
        lines += [f"  off the device {k}: {v / 2**30:.3f} GiB" for k, v in est.offloaded.items()]
        lines += [f"  {note}" for note in est.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        out = render(self.plans)
        left = ", ".join(f"{n} {why}" for why, n in sorted(self.left_out.items()))
        return out + f"\n{self.tried} layouts tried" + (f"; left out: {left}" if left else "")


def search(
    model: nn.Module | None,
    cluster: Cluster,
    *,
    batch: int,
    seq: int,
    world_size: int | None = None,
    space: Space | None = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
    memory: float | None = None,
    attention: str = "flash",
    top: int = 10,
    shape: ModelShape | None = None,
) -> Ranking:
    """Search ``space`` for the fastest layouts of ``model`` (on ``meta``)
    training ``batch`` sequences of ``seq`` tokens per step on
    ``world_size`` devices of ``cluster`` (default: all), each within
    ``memory`` bytes per device (default: the cluster's device memory).

    A plan that cannot fit is a :class:`~shardax.errors.PlanError` naming
    the least memory any layout needs and what would make it fit.

    >>> import torch, shardax as sx
    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> with torch.device("meta"):
    ...     gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=8, n_embd=512, n_head=8))
    >>> ranking = sx.plan.search(gpt2, sx.plan.Cluster.load("a100-80gb"), batch=64, seq=1024)
    >>> ranking.best.world_size, ranking.tried > 100
    (8, True)
    """
    world = world_size or cluster.world_size
    shape = shape or (ModelShape.of(model) if model is not None else None)
    if shape is None:
        raise PlanError("search needs the model (on meta) or its ModelShape (shape=...)")
    space = space or Space()
    budget = float(memory if memory is not None else cluster.device_memory)
    left: dict[str, int] = {}
    screened: list[tuple[float, RunConfig]] = []
    smallest: tuple[float, Estimate] | None = None
    tried = 0
    for config in _candidates(space, shape, cluster, world, batch, precision, optimizer, left):
        tried += 1
        try:
            est = predict(config, None, cluster, seq=seq, world_size=world, shape=shape,
                          attention=attention, state=state_bytes(config, None, world, shape),
                          exact=False)  # fmt: skip
        except PlanError as err:
            _count(left, "refused by the pipeline schedule" if "pipeline" in str(err)
                   else "heads or blocks do not split")  # fmt: skip
            continue
        if smallest is None or est.peak_memory < smallest[0]:
            smallest = (est.peak_memory, est)
        if est.peak_memory > budget * SCREEN_MARGIN:
            _count(left, "over the memory")
            continue
        screened.append((est.step_time, config))
    if tried == 0:
        raise PlanError(f"no layout of the space fits {world} devices and batch {batch}: {left}")
    screened.sort(key=lambda item: item[0])
    plans = _refine(screened, model, cluster, world, seq, shape, attention, budget, top, left)
    if not plans:
        raise _no_fit(smallest, budget, world)
    return Ranking(tuple(plans), tried, left, budget)


def _count(left: dict[str, int], why: str) -> None:
    left[why] = left.get(why, 0) + 1


def _refine(
    screened: list[tuple[float, RunConfig]],
    model: nn.Module | None,
    cluster: Cluster,
    world: int,
    seq: int,
    shape: ModelShape,
    attention: str,
    budget: float,
    top: int,
    left: dict[str, int],
) -> list[Estimate]:
    """Exact estimates of the screened layouts, fastest first, until ``top``
    fit (and a few more: the exact order may differ from the screen's)."""
    states: dict[Any, dict[str, float]] = {}
    plans: list[Estimate] = []
    for _, config in screened[: max(4 * top, 40)]:
        key = _state_key(config, world)
        if key not in states:
            states[key] = state_bytes(config, model, world, shape)
        est = predict(config, model, cluster, seq=seq, world_size=world, shape=shape,
                      attention=attention, state=states[key])  # fmt: skip
        if est.peak_memory > budget:
            _count(left, "over the memory")
            continue
        plans.append(est)
    plans.sort(key=lambda e: e.step_time)
    return plans[:top]


def _state_key(config: RunConfig, world: int) -> Any:
    p, m = config.parallel, config.memory
    mesh = config.abstract_mesh(world)
    return (tuple(mesh.axis_sizes), tuple(mesh.axis_names), p.zero, p.tp, p.sp, p.pp,
            p.sequence_parallel, m.offload_opt, m.offload_params, m.offload_grads, p.replicate,
            p.node, p.secondary)  # fmt: skip


def _no_fit(smallest: tuple[float, Estimate] | None, budget: float, world: int) -> PlanError:
    if smallest is None:
        return PlanError(f"no layout could be estimated on {world} devices")
    est = smallest[1]
    need = est.peak_memory
    return PlanError(
        f"no layout fits {budget / 2**30:.1f} GiB per device on {world} devices: the smallest, "
        f"{layout_name(est)}, needs {need / 2**30:.1f} GiB per device "
        f"({', '.join(f'{k} {v / 2**30:.1f}' for k, v in est.memory.items() if v)} GiB). "
        f"To fit: about {math.ceil(world * need / budget)} devices, devices with "
        f"{need / 2**30:.0f} GiB, offloading the optimizer state (offload_opt), or a shorter "
        "sequence or smaller micro-batch"
    )


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _candidates(
    space: Space,
    shape: ModelShape,
    cluster: Cluster,
    world: int,
    batch: int,
    precision: str,
    optimizer: str,
    left: dict[str, int],
) -> Iterator[RunConfig]:
    tps = space.tp or [t for t in _powers(cluster.devices_per_node) if shape.heads % t == 0]
    pps = space.pp or [p for p in range(1, min(64, shape.layers) + 1) if shape.layers % p == 0]
    micros = space.micro or _powers(16)
    sps = space.sp or [u for u in _powers(cluster.devices_per_node) if shape.heads % u == 0]
    eps = space.ep or [e for e in _powers(shape.experts) if shape.experts % e == 0] or [1]
    for t in tps:
        for p in pps:
            for sp in sps:
                for ep in eps if p == 1 else [e for e in eps if e == 1]:  # no ep in stages yet
                    if world % (t * p * sp * ep):
                        continue
                    dp = world // (t * p * sp * ep)
                    if batch % (dp * ep):
                        _count(left, "batch not divisible by the data ranks")
                        continue
                    per_rank = batch // (dp * ep)
                    for b in micros:
                        if per_rank % b:
                            continue
                        degrees = {"pp": p, "dp": dp, "ep": ep, "sp": sp, "tp": t}
                        per_node = cluster.devices_per_node // (ep * sp * t)  # data ranks
                        for data in space.data:
                            yield from _variants(space, degrees, b, per_rank, precision,
                                                 optimizer, left, data, per_node)  # fmt: skip


def _variants(
    space: Space,
    degrees: dict[str, int],
    b: int,
    per_rank: int,
    precision: str,
    optimizer: str,
    left: dict[str, int],
    data: str = "flat",
    per_node: int = 1,
) -> Iterator[RunConfig]:
    m = per_rank // b
    t, p, sp, ep = degrees["tp"], degrees["pp"], degrees["sp"], degrees["ep"]
    rows = degrees["dp"] * ep  # the ranks that take their own rows of the batch
    mesh = {k: v for k, v in degrees.items() if v > 1 or k == "dp"}
    dp = degrees["dp"]
    if data != "flat":  # the data ranks split into those of a node and those across
        if per_node < 2 or dp <= per_node or dp % per_node:
            return  # within a node (or not in whole nodes): the flat layout's
        outer = "replicate" if data == "hsdp" else "node"
        mesh = {k: v for k, v in mesh.items() if k != "dp"}
        at = list(mesh).index("pp") + 1 if "pp" in mesh else 0
        items = list(mesh.items())
        mesh = dict([*items[:at], (outer, dp // per_node), ("dp", per_node), *items[at:]])
    looped = ("interleaved_1f1b", "looped_bfs")  # the schedules that take virtual stages
    schedules = (
        [(name, v) for name in space.schedules for v in (space.virtual if name in looped else (2,))]
        if p > 1
        else [("1f1b", 2)]
    )
    seq_pars = space.sequence_parallel if t > 1 else (False,)
    choices = itertools.product(space.zero, space.remat, seq_pars, schedules, space.offload_opt)
    for zero, remat, seq_par, (schedule, virtual), offload in choices:
        parallel: dict[str, Any] = {"zero": zero}
        if data == "hsdp":
            if zero < 2:
                continue
            parallel["replicate"] = "replicate"
        elif data == "zeropp":
            if zero < 3:
                continue
            parallel.update(node="node", secondary=True, quantize_weights=True,
                            quantize_grads=True)  # fmt: skip
        if t > 1:
            parallel.update(tp="tp", sequence_parallel=seq_par)
        if sp > 1:
            parallel["sp"] = "sp"
        if ep > 1:
            parallel["ep"] = "ep"
        if p > 1:
            parallel.update(pp="pp", pp_schedule=schedule, pp_micro_batches=m, pp_virtual=virtual)
            batch = {"global": per_rank * rows, "micro": per_rank}
        else:
            batch = {"global": per_rank * rows, "micro": b}
        data = {
            "mesh": mesh, "parallel": parallel, "batch": batch,
            "precision": {"params": precision}, "optimizer": {"type": optimizer},
            "memory": {"remat": remat, "offload_opt": offload},
        }  # fmt: skip
        try:
            yield RunConfig.from_dict(data)
        except ConfigError:
            _count(left, "refused by the run config")
