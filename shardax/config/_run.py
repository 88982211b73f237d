"""``RunConfig``: a whole run (mesh, sections, steps, seed), read from
data or hjson text, and turned into calls (mesh, rules, schedule, optimizer,
loss scale, the printed plan)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from ..errors import ConfigError
from ._fields import COMPRESSED, _as_int, _positive
from ._hjson import (
    _first_key,
    _keyed,
    _line_of,
    _plain,
    _unknown,
    parse,
)
from ._makers import build_optimizer, build_schedule
from ._sections import (
    _RENAMES,
    _SECTIONS,
    BatchConfig,
    CheckpointConfig,
    MemoryConfig,
    MonitorConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ScheduleConfig,
    _section,
)


def _mesh(value: Any) -> dict[str, int]:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"mesh maps axis names to sizes, e.g. {{dp: -1, tp: 2}}; got {value!r}")
    out = {}
    for axis, size in value.items():
        if not isinstance(axis, str) or isinstance(size, bool) or not isinstance(size, int):
            raise ConfigError(
                f"mesh.{axis}: an axis size is an integer (-1: the rest); got {size!r}"
            )
        out[axis] = size
    return out


@attrs.frozen
class RunConfig:
    """A whole run: ``mesh`` (axis → size, ``-1`` for the rest), the
    sections, ``steps`` and ``seed``.

    >>> RunConfig.from_dict({"optimizer": {"typ": "adamw"}})
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: config: unknown key optimizer.typ (did you mean 'type'?); optimizer takes betas, bias_correction, clip_global_norm, eps, freeze_step, lamb, lr, momentum, muon, type, weight_decay, zero_one
    """

    mesh: dict[str, int] = attrs.field(factory=lambda: {"dp": -1}, converter=_mesh)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    schedule: ScheduleConfig = attrs.field(factory=ScheduleConfig)
    precision: PrecisionConfig = attrs.field(factory=PrecisionConfig)
    batch: BatchConfig = attrs.field(factory=lambda: BatchConfig(micro=8, accumulation=1))
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    monitor: MonitorConfig = attrs.field(factory=MonitorConfig)
    memory: MemoryConfig = attrs.field(factory=MemoryConfig)
    steps: int = attrs.field(default=1000, converter=_as_int("steps"), validator=_positive)
    seed: int = attrs.field(default=0, converter=_as_int("seed"))

    def __attrs_post_init__(self) -> None:
        s = self.schedule
        total = s.total_steps if s.total_steps is not None else self.steps
        decays = s.type in ("warmup_cosine", "warmup_linear")
        if s.warmup_steps > total or (decays and s.warmup_steps and s.warmup_steps >= total):
            where = "schedule.total_steps" if s.total_steps is not None else "steps"
            than = "less than" if decays else "at most"
            raise ConfigError(
                f"schedule.warmup_steps ({s.warmup_steps}) must be {than} the total steps "
                f"({where} = {total}): the warm-up would not end within the run"
                + (" and leave steps to decay" if decays else "")
                + "; lower warmup_steps or raise the total"
            )
        _check_axes(self)
        if self.parallel.pp is not None:
            _check_pipeline(self)
        p = self.parallel
        if self.optimizer.type in COMPRESSED and (p.zero or p.pp or p.ep):
            raise ConfigError(
                f"optimizer.type {self.optimizer.type} averages each rank's own momentum, whole, "
                "over the data axes, as DeepSpeed's 1-bit optimizers (ZeRO-0 only): use "
                f"parallel.zero: 0 without pp or ep (got zero {p.zero}, pp {p.pp!r}, ep {p.ep!r})"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> RunConfig:
        """Build from parsed hjson/JSON; every unknown key is an error."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{source}: a config is an object of sections; got {type(data).__name__}"
            )
        top = {"mesh", "steps", "seed", *_SECTIONS}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in top:
                raise _keyed(_unknown(source, key, "", sorted(top)), key)
            if key in _SECTIONS:
                kwargs[key] = _section(source, key, _SECTIONS[key], value)
            else:
                kwargs[key] = value
        try:
            return cls(**kwargs)
        except ConfigError as err:
            key = err.key_path or _first_key(str(err), top)
            raise _keyed(f"{source}: {err}", key) from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_text(cls, text: str, source: str = "config") -> RunConfig:
        """Parse hjson (or JSON) text."""
        data = parse(
            text,
            source,
            unreadable="not valid hjson",
            twice="the later value would silently replace the earlier one; keep one",
        )
        try:
            return cls.from_dict(_plain(data), source)
        except ConfigError as err:
            path = err.key_path
            line = _line_of(text, tuple(path.split("."))) if path else None
            if line is None or not str(err).startswith(f"{source}: "):
                raise
            raise _keyed(str(err).replace(f"{source}: ", f"{source}:{line}: ", 1), path) from None

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, in the file's key names (every value,
        defaults included: the resolved config)."""
        out: dict[str, Any] = {"mesh": dict(self.mesh), "steps": self.steps, "seed": self.seed}
        for name in _SECTIONS:
            section = attrs.asdict(getattr(self, name), recurse=False)
            renamed = {v: k[1] for k, v in _RENAMES.items() if k[0] == name}
            out[name] = {renamed.get(k, k): list(v) if isinstance(v, tuple) else v
                         for k, v in section.items()}  # fmt: skip
        return out

    # -- into calls -------------------------------------------------------------

    def abstract_mesh(self, world_size: int) -> Any:
        """The mesh on ``world_size`` ranks (``-1`` resolved), for planning."""
        from ..mesh import AbstractMesh
        from ..mesh._mesh import _validate_shape

        try:
            names, sizes = _validate_shape(self.mesh, world=world_size)
        except ValueError as err:
            raise ConfigError(f"mesh {self.mesh!r} on {world_size} rank(s): {err}") from None
        return AbstractMesh(dict(zip(names, sizes, strict=True)))

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes each batch is split over: the data axis
        (``parallel.zero_axis``), after ``parallel.replicate`` where there
        are replicas (HSDP), and, with experts, ``parallel.ep`` — whose
        ranks take their own rows too (DeepSpeed's expert-data groups).

        >>> RunConfig.from_dict({"mesh": {"dp": 2, "ep": 2}, "parallel": {"ep": "ep"}}).data_axes
        ('dp', 'ep')
        >>> hsdp = {"mesh": {"replicate": 2, "dp": 4}, "parallel": {"zero": 3, "replicate": "replicate"}}
        >>> RunConfig.from_dict(hsdp).data_axes
        ('replicate', 'dp')
        """
        p = self.parallel
        if p.ep is None:
            inner: tuple[str, ...] = (p.zero_axis,)
        else:
            inner = tuple(a for a in (p.zero_axis, p.ep) if a in self.mesh)
        if p.node is not None:
            inner = (p.node, *inner)
        return inner if p.replicate is None else (p.replicate, *inner)

    @property
    def batch_spec(self) -> Any:
        """The spec a batch is split by (``sx.data.Sampler``,
        ``sx.data.shard_batch``): its examples over :attr:`data_axes` and,
        with ``parallel.cp``, its sequence (dim 1) zigzag over the ``cp``
        axis, which balances causal ring attention's work over the ranks (a
        data axis the mesh lacks splits nothing).

        >>> RunConfig().batch_spec
        P('dp')
        >>> RunConfig.from_dict({"mesh": {"dp": 2, "cp": 2}, "parallel": {"cp": "cp"}}).batch_spec
        P('dp', zigzag('cp'))
        """
        from ..shard import P, zigzag

        examples = tuple(a for a in self.data_axes if a in self.mesh) or None
        cp = self.parallel.cp
        return P(examples) if cp is None else P(examples, zigzag(cp))

    @property
    def _zero_axes(self) -> str | tuple[str, ...]:
        """What ``rules.zero`` shards over: the data axis, or with experts
        every data axis; and the ``cp`` axis with context parallelism — its
        ranks hold the same parameters and sum their gradients, as data
        ranks do (torchtitan's FSDP over dp_shard × cp)."""
        p = self.parallel
        inner = tuple(a for a in self.data_axes if a != p.replicate)  # not over the replicas
        axes = inner if p.ep is not None else tuple(a for a in (p.node, p.zero_axis) if a)
        if p.cp is not None:
            axes = (*axes, p.cp)
        return axes if len(axes) > 1 else axes[0]

    @property
    def _token_axes(self) -> tuple[str, ...]:
        """The axes the batch's tokens are split over: :attr:`data_axes`
        (the examples) and ``parallel.cp`` (the sequence)."""
        cp = self.parallel.cp
        return self.data_axes if cp is None else (*self.data_axes, cp)

    def dp_size(self, world_size: int) -> int:
        """The data-parallel size on ``world_size`` ranks: the size of the
        mesh's :attr:`data_axes` (1 for an axis the mesh lacks)."""
        mesh = self.abstract_mesh(world_size)
        return math.prod(mesh.size(a) for a in self.data_axes if a in mesh.axis_names)

    def make_rules(self, names: Any = None) -> Any:
        """The rules the presets give: ``rules.zero`` (+ ``rules.experts``,
        ``rules.megatron`` / ``rules.ulysses`` / ``rules.context_parallel``
        with ``names``, ``rules.remat``, ``rules.offload``).

        >>> run = RunConfig.from_dict({"mesh": {"dp": 2, "cp": 2},
        ...                            "parallel": {"zero": 3, "cp": "cp"}})
        >>> rules = run.make_rules()  # parameters split over dp and cp, the ring over cp
        >>> [r.within for r in rules.modules if r.within is not None]
        [Ring('cp')]
        >>> rules.spec_for("wte.weight", (256, 64), run.abstract_mesh(4))
        P(('dp', 'cp'))
        """
        from .. import rules

        p = self.parallel
        zeropp = {"quantize_weights": True} if p.quantize_weights else {}
        if p.quantize_grads:
            zeropp["quantize_grads"] = True
        if p.secondary:  # hpZ: within the node, the data axis
            zeropp["secondary"] = p.zero_axis
        if p.persist_below:
            zeropp["persist_below"] = p.persist_below
        if p.keep_gathered:
            zeropp["keep_gathered"] = True
        out = rules.zero(p.zero, self._zero_axes, **zeropp) + _memory_rules(self.memory)
        extra = {} if names is None else {"names": names}
        if p.tp is not None:
            out = rules.megatron(p.tp, sequence_parallel=p.sequence_parallel, **extra) + out
        if self.parallel.sp is not None:
            out = rules.ulysses(self.parallel.sp, **extra) + out
        if p.cp is not None:  # ring attention around (inside it, Ulysses' all-to-alls: USP)
            out = rules.context_parallel(p.cp, **extra) + out
        if p.ep is not None:  # first: the experts' own layout, inside each expert tp's
            out = rules.experts(p.ep, tp=p.tp, batch=self._token_axes) + out
        return out

    def make_schedule(self) -> Callable[[int], float]:
        """The learning rate at each step (0-based)."""
        return build_schedule(self.schedule, self.optimizer.lr, self.steps)

    def make_optimizer(self, accumulation: int = 1, *, clip: bool = True) -> Any:
        """The optimizer on :meth:`make_schedule`: clipping first (``clip``),
        fp32 master weights for bf16/fp16 params, :func:`optim.MultiSteps`
        over ``accumulation`` micro-steps.

        Under a pipeline (``parallel.pp``) each rank holds its stages'
        gradients only: clip them with ``pipeline.clip_by_global_norm``
        (the whole model's norm) and pass ``clip=False``."""
        return build_optimizer(self, accumulation, clip)

    @property
    def unreduced_axes(self) -> tuple[str, ...]:
        """The axes ``value_and_grad(unreduced=...)`` leaves the gradients
        partial over: the data axes, for the 1-bit optimizers (which average
        them themselves); else none.

        >>> RunConfig.from_dict({"optimizer": {"type": "onebit_adam", "freeze_step": 10}}).unreduced_axes
        ('dp',)
        >>> RunConfig().unreduced_axes
        ()
        """
        if self.optimizer.type not in COMPRESSED:
            return ()
        return tuple(a for a in self.data_axes if a in self.mesh)

    def make_pipeline(self, world_size: int) -> Any:
        """The pipeline schedule (``parallel.pp_schedule`` over the ``pp``
        axis's ranks, ``pp_micro_batches`` or twice as many), or None
        without ``parallel.pp``."""
        from .. import pipeline

        p = self.parallel
        if p.pp is None:
            return None
        ranks = self.abstract_mesh(world_size).size(p.pp)
        micro = p.pp_micro_batches or 2 * ranks
        return pipeline.schedule(p.pp_schedule, ranks, micro, virtual=p.pp_virtual)

    def make_input_cast(self) -> Callable[[Any], Any]:
        """With ``precision.cast_inputs`` (DeepSpeed's ``fp16.auto_cast``, on
        the forward's positional inputs), a function casting the floating
        tensors in what it is given (tuples, lists, dicts) to the params'
        dtype, the rest as it is; else the identity.

        >>> import torch
        >>> cast = RunConfig.from_dict({"precision": {"params": "fp16", "cast_inputs": True}}
        ...                            ).make_input_cast()
        >>> x, ids = cast((torch.ones(2), torch.arange(2)))
        >>> x.dtype, ids.dtype
        (torch.float16, torch.int64)
        """
        return _input_cast(self.precision.params if self.precision.cast_inputs else None)

    def make_loss_scale(self) -> Any:
        """A :class:`optim.DynamicLossScale` for fp16 (fixed when
        ``dynamic`` is off), else None."""
        from .. import optim

        p = self.precision
        if p.params != "fp16":
            return None
        if not p.dynamic:
            return optim.DynamicLossScale(p.loss_scale, growth_interval=2**31 - 1)
        return optim.DynamicLossScale(
            p.loss_scale,
            growth_interval=p.growth_interval,
            backoff_factor=p.backoff_factor,
            hysteresis=p.hysteresis,
            min_scale=min(p.min_loss_scale, p.loss_scale),
        )

    def plan(self, world_size: int) -> str:
        """The resolved plan on ``world_size`` ranks, as ``shardax config
        check`` prints it."""
        return _plan_text(self, world_size)


def _check_axes(run: RunConfig) -> None:
    """Every axis a preset names is one of the mesh's, and every mesh axis
    of size > 1 is some preset's (else its ranks would repeat each other)."""
    p, axes = run.parallel, sorted(run.mesh)
    named = [("parallel.zero_axis", p.zero_axis if p.zero else None),
             ("parallel.tp", p.tp), ("parallel.sp", p.sp), ("parallel.pp", p.pp),
             ("parallel.ep", p.ep), ("parallel.cp", p.cp),
             ("parallel.replicate", p.replicate), ("parallel.node", p.node)]  # fmt: skip
    for key, axis in named:
        if axis is not None and axis not in run.mesh:
            close = difflib.get_close_matches(axis, axes, n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{key} names mesh axis {axis!r}{hint}, but the mesh {run.mesh} has axes "
                f"{axes}; add it to mesh or name one of those"
            )
    # the data axis splits the batch even at ZeRO-0
    used = {p.zero_axis, p.tp, p.sp, p.pp, p.ep, p.cp, p.replicate, p.node}
    idle = [a for a, n in run.mesh.items() if n != 1 and a not in used]
    if idle:
        raise ConfigError(
            f"mesh axis {idle[0]!r} (size {run.mesh[idle[0]]}) of {run.mesh} is used by no "
            f"preset: its ranks would only repeat each other's work. Name it as "
            f"parallel.tp (tensor parallelism), parallel.sp (Ulysses), parallel.pp "
            f"(pipeline), parallel.ep (experts) or parallel.cp (context parallelism), "
            f"make it the data axis (parallel.zero_axis) or the replicas' "
            f"(parallel.replicate, hybrid sharding) or the one across nodes (parallel.node), "
            f"or give it size 1"
        )


def _plan_text(run: RunConfig, world_size: int) -> str:
    """:meth:`RunConfig.plan`."""
    mesh = run.abstract_mesh(world_size)
    batch = run.batch.resolve(run.dp_size(world_size))
    p, o, s = run.parallel, run.optimizer, run.schedule
    presets = [f"rules.zero({p.zero}, {run._zero_axes!r})"]
    if p.replicate:
        presets[0] += f" in each replica, replicas over {p.replicate!r} (HSDP)"
    zeropp = [name for name, on in (("int8 weight gathers (qwZ)", p.quantize_weights),
              (f"a secondary copy over {p.zero_axis!r} (hpZ)", p.secondary),
              ("int4 gradient reduce-scatters (qgZ)", p.quantize_grads)) if on]  # fmt: skip
    if zeropp:
        presets[0] += " with ZeRO++: " + ", ".join(zeropp)
    if p.persist_below:
        presets[0] += f", parameters of < {p.persist_below} elements whole"
    if p.keep_gathered:
        presets[0] += ", gathered parameters kept for the backward"
    if p.tp:
        presets.append(f"rules.megatron({p.tp!r}, sequence_parallel={p.sequence_parallel})")
    if p.sp:
        presets.append(f"rules.ulysses({p.sp!r})")
    if p.cp:
        presets.append(f"rules.context_parallel({p.cp!r})")
    if p.ep:  # first, as make_rules puts them
        presets.insert(0, f"rules.experts({p.ep!r}, tp={p.tp!r}, batch={run._token_axes!r})")
    lr = run.make_schedule()
    total = s.total_steps or run.steps
    return "\n".join(
        [
            f"mesh: {mesh!r} on {world_size} rank(s)",
            f"presets: {' + '.join(presets)}; gradient buckets {p.bucket_bytes / 2**20:g} MiB",
            f"batch: global {batch.global_size} = micro {batch.micro} x accumulation "
            f"{batch.accumulation} x data-parallel {run.dp_size(world_size)}",
            f"optimizer: {o.type}(lr={o.lr:g}, betas={tuple(o.betas)}, eps={o.eps:g}, "
            f"weight_decay={o.weight_decay:g}"
            + (", bias_correction=False" if not o.bias_correction else "")
            + (f", freeze_step={o.freeze_step}" if o.freeze_step else "")
            + (f", momentum={o.momentum:g}" if o.type == "muon" else "")
            + "".join(f", {k}={v:g}" for k, v in (*o.lamb.items(), *o.zero_one.items()))
            + "".join(f", {k}={v}" for k, v in o.muon.items())
            + ")"
            + (f", clipped at global norm {o.clip_global_norm:g}" if o.clip_global_norm else "")
            + (
                " (the averaged gradient, then each rank's own)"
                if o.clip_global_norm and run.unreduced_axes
                else ""
            )
            + (
                (
                    f"; 1-bit averages over {run.unreduced_axes!r}, local steps after the "
                    "variance freezes"
                    if o.type == "zero_one_adam"
                    else f"; 1-bit momenta over {run.unreduced_axes!r} after the warm-up"
                )
                if run.unreduced_axes
                else ""
            ),
            _schedule_line(s, lr, total),
            f"precision: {run.precision.params}"
            + (" with fp32 master weights" if run.precision.params != "fp32" else "")
            + (", dynamic loss scale" if run.precision.params == "fp16" else "")
            + (", floating inputs cast to it" if run.precision.cast_inputs else ""),
            f"steps: {run.steps}, seed {run.seed}",
            f"checkpoint: {run.checkpoint.dir} every {run.checkpoint.every or 'end'}, "
            f"keep {run.checkpoint.keep}",
            f"monitor: every {run.monitor.log_every} steps to {', '.join(run.monitor.writers)}",
            *_memory_lines(run.memory),
        ]
    )


def _input_cast(params: str | None) -> Callable[[Any], Any]:
    """The cast of ``make_input_cast`` to the dtype of ``params`` (None: no cast)."""
    if params is None:
        return lambda inputs: inputs
    import optree
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[params]

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return lambda inputs: optree.tree_map(cast, inputs, none_is_leaf=True)


def _schedule_line(s: ScheduleConfig, lr: Callable[[int], float], total: int) -> str:
    """The plan's line for the schedule: its shape and the lr where it turns."""
    if s.type == "one_cycle_linear":
        up = s.up_steps or 0
        down = up if s.down_steps is None else s.down_steps
        decay = (f"then {s.init_lr:g} / (1 + {s.decay_rate:g} x steps after / {s.decay_steps})"
                 if s.decay_rate and s.decay_steps else "then constant")  # fmt: skip
        steps = [0, up, up + down, max(total - 1, up + down)]
        shape = f"up {up} steps, down {down}, {decay}"
    else:
        steps = [0, s.warmup_steps, total - 1]
        shape = f"warmup {s.warmup_steps} steps, {s.warmup}"
    return (f"schedule: {s.type} ({shape}); lr at steps {', '.join(map(str, steps))}: "
            + ", ".join(f"{lr(k):.3g}" for k in steps))  # fmt: skip


def _memory_rules(m: MemoryConfig) -> Any:
    """``rules.remat`` and ``rules.offload`` as ``memory`` asks (none: no rules)."""
    from .. import rules

    out = rules.Rules()
    if m.remat is not None:
        out = out + rules.remat(m.remat_modules, m.remat, every=m.remat_every)
    for role, kind in (("opt_state", m.offload_opt), ("params", m.offload_params),
                       ("grads", m.offload_grads)):  # fmt: skip
        if kind is not None:
            out = out + rules.offload(role, kind)
    return out


def _memory_lines(m: MemoryConfig) -> list[str]:
    """What ``memory`` adds to the plan: remat and offload, when set."""
    parts = []
    if m.remat is not None:
        every = f", every {m.remat_every}" if m.remat_every != 1 else ""
        parts.append(f"remat {m.remat} over {m.remat_modules!r}{every}")
    for what, kind in (("optimizer state", m.offload_opt), ("parameters", m.offload_params),
                       ("gradients", m.offload_grads)):  # fmt: skip
        if kind is not None:
            parts.append(f"{what} in {kind}")
    return [f"memory: {'; '.join(parts)}"] if parts else []


def _check_pipeline(config: RunConfig) -> None:
    """What a pipeline (``parallel.pp``) cannot be combined with yet."""
    if config.parallel.ep is not None:
        raise ConfigError(
            "parallel.pp with parallel.ep: experts inside pipeline stages are not supported "
            "yet (issue 22); drop one of them"
        )
    if config.precision.params == "fp16":
        raise ConfigError(
            "parallel.pp with fp16: dynamic loss scaling would skip steps stage by stage "
            "(an overflow seen by one stage only); use bf16 or fp32 with a pipeline"
        )
    if config.batch.accumulation not in (None, 1):
        raise ConfigError(
            f"parallel.pp with batch.accumulation {config.batch.accumulation}: a pipeline "
            "accumulates over its own micro-batches; set parallel.pp_micro_batches instead"
        )
