"""Run configs: one hjson file (JSON with comments, unquoted keys, optional
commas) describing a training run — mesh, parallelism presets, optimizer,
schedule, precision, batch sizes, checkpointing, monitoring — parsed into
frozen attrs values with one source of defaults (the class fields), then
turned into calls: ``Mesh(...)``, ``rules.zero(...)``, ``optim.adamw(...)``.

>>> config = RunConfig.from_text('''
... // ZeRO-3 over every rank, 16 sequences a step
... mesh: {dp: -1}
... parallel: {zero: 3}
... optimizer: {type: "adamw", lr: 3e-3, weight_decay: 0.1}
... batch: {global: 16, micro: 4}
... ''')
>>> config.parallel.zero, config.optimizer.lr
(3, 0.003)
>>> config.batch.resolve(dp_size=2)
ResolvedBatch(global_size=16, micro=4, accumulation=2)

Unknown keys are errors that name the key, its place and the keys allowed
there; batch sizes that do not add up name all three and the world size.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import attrs

from .errors import ConfigError

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ResolvedBatch",
    "RunConfig",
    "ScheduleConfig",
    "from_deepspeed",
    "load_config",
]

OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "adagrad", "rmsprop", "lamb")
SCHEDULES = ("constant", "warmup_constant", "warmup_cosine", "warmup_linear", "one_cycle")
PRECISIONS = ("fp32", "bf16", "fp16")
WRITERS = ("stdout", "csv", "jsonl", "tensorboard")


def _in(choices: tuple[str, ...]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{attribute.name} is one of {choices}; got {value!r}{hint}")

    return check


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not value > 0):
        raise ConfigError(f"{attribute.name} must be positive; got {value!r}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0; got {value!r}")


def _as_int(name: str) -> Callable[[Any], int]:
    """A converter to an integer that refuses ``true``, ``2.5``, ``"3"``,
    ``1e400`` and anything beyond int64, naming the key."""

    def convert(value: Any) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**63:
            raise ConfigError(f"{name} is an integer; got {value!r}")
        return value

    return convert


def _as_float(name: str) -> Callable[[Any], float]:
    """A converter to a finite number that refuses ``true``, strings, NaN and
    infinities (``1e400`` parses as one), naming the key."""

    def convert(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} is a number; got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} is a finite number; got {value!r}")
        return float(value)

    return convert


def _as_bool(name: str) -> Callable[[Any], bool]:
    def convert(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} is true or false; got {value!r}")
        return value

    return convert


def _as_str(name: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{name} is a string; got {value!r}")
        return value

    return convert


def _optional(convert: Callable[[str], Callable[[Any], Any]], name: str) -> Callable[[Any], Any]:
    """``convert(name)``, letting ``None`` (the key's "not set") through."""
    inner = convert(name)
    return lambda value: None if value is None else inner(value)


def _list_of(convert: Callable[[str], Callable[[Any], Any]], name: str) -> Callable[[Any], tuple]:
    """A list whose items each pass ``convert``, named ``name[i]`` in errors."""

    def check(value: Any) -> tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} is a list; got {value!r}")
        return tuple(convert(f"{name}[{i}]")(v) for i, v in enumerate(value))

    return check


@attrs.frozen
class ParallelConfig:
    """Which presets shard the model: ``zero`` (0–3) over ``zero_axis``;
    ``tp`` — the mesh axis of ``rules.megatron`` (``sequence_parallel`` for
    Megatron-SP); ``sp`` — the axis of ``rules.ulysses``; ``bucket_bytes``
    of gradient reductions; ``prefetch`` of ZeRO-3 gathers."""

    zero: int = attrs.field(default=0, converter=_as_int("zero"))
    zero_axis: str = attrs.field(default="dp", converter=_as_str("zero_axis"))
    tp: str | None = attrs.field(default=None, converter=_optional(_as_str, "tp"))
    sequence_parallel: bool = attrs.field(default=False, converter=_as_bool("sequence_parallel"))
    sp: str | None = attrs.field(default=None, converter=_optional(_as_str, "sp"))
    bucket_bytes: int = attrs.field(
        default=25 * 2**20, converter=_as_int("bucket_bytes"), validator=_positive
    )
    prefetch: bool = attrs.field(default=True, converter=_as_bool("prefetch"))

    def __attrs_post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero is a ZeRO stage 0..3; got {self.zero!r}")
        if self.sequence_parallel and self.tp is None:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp (the tensor axis)")


@attrs.frozen
class OptimizerConfig:
    """The optimizer (``type``) and its hyperparameters."""

    type: str = attrs.field(default="adamw", validator=_in(OPTIMIZERS))
    lr: float = attrs.field(default=1e-3, converter=_as_float("lr"), validator=_positive)
    betas: tuple[float, float] = attrs.field(
        default=(0.9, 0.999), converter=_list_of(_as_float, "betas")
    )
    eps: float = attrs.field(default=1e-8, converter=_as_float("eps"))
    weight_decay: float = attrs.field(
        default=0.0, converter=_as_float("weight_decay"), validator=_non_negative
    )
    momentum: float = attrs.field(default=0.0, converter=_as_float("momentum"))
    clip_global_norm: float | None = attrs.field(
        default=None, converter=_optional(_as_float, "clip_global_norm"), validator=_positive
    )

    def __attrs_post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"optimizer.betas is two numbers; got {self.betas!r}")


@attrs.frozen
class ScheduleConfig:
    """The learning-rate schedule (its peak is ``optimizer.lr``):
    ``warmup_steps`` from ``init_lr`` (``warmup: "linear"`` or DeepSpeed's
    ``"log"``), then constant, cosine or linear decay to ``end_lr`` at
    ``total_steps`` (default: the run's steps), or the 1cycle policy."""

    type: str = attrs.field(default="constant", validator=_in(SCHEDULES))
    warmup_steps: int = attrs.field(
        default=0, converter=_as_int("warmup_steps"), validator=_non_negative
    )
    total_steps: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "total_steps"), validator=_positive
    )
    init_lr: float = attrs.field(default=0.0, converter=_as_float("init_lr"))
    end_lr: float = attrs.field(default=0.0, converter=_as_float("end_lr"))
    warmup: str = attrs.field(default="linear", validator=_in(("linear", "log")))
    pct_start: float = attrs.field(default=0.3, converter=_as_float("pct_start"))
    div_factor: float = attrs.field(default=25.0, converter=_as_float("div_factor"))
    final_div_factor: float = attrs.field(default=1e4, converter=_as_float("final_div_factor"))


@attrs.frozen
class PrecisionConfig:
    """The params' dtype; master weights in fp32 for bf16/fp16; dynamic
    loss scaling for fp16 (``loss_scale``: initial scale, ``None`` for
    dynamic from 2**16, or a fixed number with ``dynamic: false``), with
    DeepSpeed's ``hysteresis`` and ``min_loss_scale`` as options."""

    params: str = attrs.field(default="fp32", validator=_in(PRECISIONS))
    master_weights: bool = attrs.field(default=True, converter=_as_bool("master_weights"))
    loss_scale: float = attrs.field(
        default=2.0**16, converter=_as_float("loss_scale"), validator=_positive
    )
    dynamic: bool = attrs.field(default=True, converter=_as_bool("dynamic"))
    growth_interval: int = attrs.field(
        default=2000, converter=_as_int("growth_interval"), validator=_positive
    )
    backoff_factor: float = attrs.field(default=0.5, converter=_as_float("backoff_factor"))
    hysteresis: int = attrs.field(default=1, converter=_as_int("hysteresis"), validator=_positive)
    min_loss_scale: float = attrs.field(
        default=0.0, converter=_as_float("min_loss_scale"), validator=_non_negative
    )


class ResolvedBatch(NamedTuple):
    """Batch sizes that add up: ``global_size == micro * accumulation * dp``."""

    global_size: int
    micro: int
    accumulation: int


@attrs.frozen
class BatchConfig:
    """``global`` (sequences per optimizer step, all ranks), ``micro`` (per
    data-parallel rank and micro-step) and ``accumulation`` (micro-steps per
    step): give any two and :meth:`resolve` computes the third."""

    global_size: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "global"), validator=_positive
    )
    micro: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "micro"), validator=_positive
    )
    accumulation: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "accumulation"), validator=_positive
    )

    def resolve(self, dp_size: int) -> ResolvedBatch:
        """The three sizes for ``dp_size`` data-parallel ranks.

        >>> BatchConfig(global_size=24, micro=3).resolve(dp_size=4)
        ResolvedBatch(global_size=24, micro=3, accumulation=2)
        >>> BatchConfig(global_size=24, micro=3, accumulation=3).resolve(dp_size=4)
        Traceback (most recent call last):
        ...
        shardax.errors.ConfigError: batch sizes do not add up: global 24 != micro 3 x accumulation 3 x data-parallel size 4 (= 36); give two of global/micro/accumulation and the third follows
        """
        g, m, a = self.global_size, self.micro, self.accumulation
        if sum(v is not None for v in (g, m, a)) < 2:
            if g is None and m is None:
                raise ConfigError("batch needs two of global, micro and accumulation; got none")
            a = a or 1
        if g is None:
            g = m * a * dp_size
        elif m is None:
            if g % (a * dp_size):
                raise ConfigError(
                    f"batch global {g} is not divisible by accumulation {a} x data-parallel size "
                    f"{dp_size}: no whole micro batch; change global or accumulation"
                )
            m = g // (a * dp_size)
        elif a is None:
            if g % (m * dp_size):
                raise ConfigError(
                    f"batch global {g} is not divisible by micro {m} x data-parallel size "
                    f"{dp_size}: no whole number of accumulation steps"
                )
            a = g // (m * dp_size)
        if g != m * a * dp_size:
            raise ConfigError(
                f"batch sizes do not add up: global {g} != micro {m} x accumulation {a} x "
                f"data-parallel size {dp_size} (= {m * a * dp_size}); give two of "
                "global/micro/accumulation and the third follows"
            )
        return ResolvedBatch(g, m, a)


@attrs.frozen
class CheckpointConfig:
    """Sharded checkpoints into ``dir`` every ``every`` steps (0: at the
    end only), keeping ``keep``, saved in the background when ``async_save``."""

    dir: str = attrs.field(default="checkpoints/run", converter=_as_str("dir"))
    every: int = attrs.field(default=0, converter=_as_int("every"), validator=_non_negative)
    keep: int = attrs.field(default=2, converter=_as_int("keep"), validator=_positive)
    async_save: bool = attrs.field(default=True, converter=_as_bool("async_save"))


@attrs.frozen
class MonitorConfig:
    """What is measured and where it goes: every ``log_every`` steps, to
    ``writers`` (in ``dir``); ``timers`` (forward/backward/optimizer/
    communication breakdown), ``comm`` (per-collective log), ``memory``;
    ``peak_tflops`` per rank for MFU. All off but stdout by default."""

    log_every: int = attrs.field(default=25, converter=_as_int("log_every"), validator=_positive)
    writers: tuple[str, ...] = attrs.field(
        default=("stdout",), converter=_list_of(_as_str, "writers")
    )
    dir: str = attrs.field(default="runs/run", converter=_as_str("dir"))
    timers: bool = attrs.field(default=False, converter=_as_bool("timers"))
    comm: bool = attrs.field(default=False, converter=_as_bool("comm"))
    memory: bool = attrs.field(default=False, converter=_as_bool("memory"))
    peak_tflops: float | None = attrs.field(
        default=None, converter=_optional(_as_float, "peak_tflops"), validator=_positive
    )
    progress: bool = attrs.field(default=False, converter=_as_bool("progress"))

    def __attrs_post_init__(self) -> None:
        for w in self.writers:
            _in(WRITERS)(self, attrs.fields(MonitorConfig).writers, w)


_SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "precision": PrecisionConfig,
    "batch": BatchConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
}
_RENAMES = {("batch", "global"): "global_size"}  # a Python keyword in the file


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
    shardax.errors.ConfigError: config: unknown key optimizer.typ (did you mean 'type'?); optimizer takes betas, clip_global_norm, eps, lr, momentum, type, weight_decay
    """

    mesh: dict[str, int] = attrs.field(factory=lambda: {"dp": -1}, converter=_mesh)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    schedule: ScheduleConfig = attrs.field(factory=ScheduleConfig)
    precision: PrecisionConfig = attrs.field(factory=PrecisionConfig)
    batch: BatchConfig = attrs.field(factory=lambda: BatchConfig(micro=8, accumulation=1))
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    monitor: MonitorConfig = attrs.field(factory=MonitorConfig)
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
        p, axes = self.parallel, sorted(self.mesh)
        named = [("parallel.zero_axis", p.zero_axis if p.zero else None),
                 ("parallel.tp", p.tp), ("parallel.sp", p.sp)]  # fmt: skip
        for key, axis in named:
            if axis is not None and axis not in self.mesh:
                close = difflib.get_close_matches(axis, axes, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"{key} names mesh axis {axis!r}{hint}, but the mesh {self.mesh} has axes "
                    f"{axes}; add it to mesh or name one of those"
                )
        used = {p.zero_axis, p.tp, p.sp}  # the data axis splits the batch even at ZeRO-0
        idle = [a for a, n in self.mesh.items() if n != 1 and a not in used]
        if idle:
            raise ConfigError(
                f"mesh axis {idle[0]!r} (size {self.mesh[idle[0]]}) of {self.mesh} is used by no "
                f"preset: its ranks would only repeat each other's work. Name it as "
                f"parallel.tp (tensor parallelism) or parallel.sp (Ulysses), make it the "
                f"data axis (parallel.zero_axis), or give it size 1"
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
            key = getattr(err, "key_path", None) or _first_key(str(err), top)
            raise _keyed(f"{source}: {err}", key) from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_text(cls, text: str, source: str = "config") -> RunConfig:
        """Parse hjson (or JSON) text."""
        import hjson

        try:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError as err:
            raise ConfigError(f"{source}: not valid hjson: {err}") from None
        except (OverflowError, ValueError):  # hjson's own reader fails on 1e400
            raise ConfigError(f"{source}:{_overflow(text)}") from None
        except _DuplicateKey as dup:
            line = _line_of(text, (dup.key,), occurrence=2)
            raise ConfigError(
                f"{source}:{line}: duplicate key {dup.key!r}: the later value would silently "
                "replace the earlier one; keep one"
            ) from None
        try:
            return cls.from_dict(_plain(data), source)
        except ConfigError as err:
            path = getattr(err, "key_path", None)
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
        from .mesh import AbstractMesh
        from .mesh._mesh import _validate_shape

        try:
            names, sizes = _validate_shape(self.mesh, world=world_size)
        except ValueError as err:
            raise ConfigError(f"mesh {self.mesh!r} on {world_size} rank(s): {err}") from None
        return AbstractMesh(dict(zip(names, sizes, strict=True)))

    def dp_size(self, world_size: int) -> int:
        """The data-parallel size on ``world_size`` ranks: the mesh's
        ``parallel.zero_axis`` size (1 when the mesh lacks that axis)."""
        mesh = self.abstract_mesh(world_size)
        axis = self.parallel.zero_axis
        return mesh.size(axis) if axis in mesh.axis_names else 1

    def make_rules(self, names: Any = None) -> Any:
        """The rules the presets give: ``rules.zero`` (+ ``rules.megatron`` /
        ``rules.ulysses`` with ``names``)."""
        from . import rules

        out = rules.zero(self.parallel.zero, self.parallel.zero_axis)
        extra = {} if names is None else {"names": names}
        if self.parallel.tp is not None:
            out = (
                rules.megatron(
                    self.parallel.tp, sequence_parallel=self.parallel.sequence_parallel, **extra
                )
                + out
            )
        if self.parallel.sp is not None:
            out = rules.ulysses(self.parallel.sp, **extra) + out
        return out

    def make_schedule(self) -> Callable[[int], float]:
        """The learning rate at each step (0-based)."""
        from . import optim

        s, peak = self.schedule, self.optimizer.lr
        total = s.total_steps or self.steps
        if s.type == "constant":
            return optim.constant_schedule(peak)
        if s.type == "one_cycle":
            return optim.one_cycle_schedule(
                peak, total, pct_start=s.pct_start, div_factor=s.div_factor,
                final_div_factor=s.final_div_factor,
            )  # fmt: skip
        if s.warmup == "linear" and s.type == "warmup_cosine":
            return optim.warmup_cosine_decay_schedule(
                peak, s.warmup_steps, total, init_value=s.init_lr, end_value=s.end_lr
            )
        if s.warmup == "linear" and s.type == "warmup_linear":
            return optim.warmup_linear_decay_schedule(
                peak, s.warmup_steps, total, init_value=s.init_lr, end_value=s.end_lr
            )
        return _warmup_then(s, peak, total)

    def make_optimizer(self, accumulation: int = 1) -> Any:
        """The optimizer on :meth:`make_schedule`: clipping first, fp32
        master weights for bf16/fp16 params, :func:`optim.MultiSteps` over
        ``accumulation`` micro-steps."""
        from . import optim

        o, lr = self.optimizer, self.make_schedule()
        b1, b2 = o.betas
        makers: dict[str, Callable[[], Any]] = {
            "adamw": lambda: optim.adamw(lr, b1=b1, b2=b2, eps=o.eps, weight_decay=o.weight_decay),
            "adam": lambda: optim.adam(lr, b1=b1, b2=b2, eps=o.eps, weight_decay=o.weight_decay),
            "lion": lambda: optim.lion(lr, b1=b1, b2=b2, weight_decay=o.weight_decay),
            "sgd": lambda: optim.sgd(lr, momentum=o.momentum, weight_decay=o.weight_decay),
            "adagrad": lambda: optim.adagrad(lr, eps=o.eps, weight_decay=o.weight_decay),
            "rmsprop": lambda: optim.rmsprop(
                lr, eps=o.eps, weight_decay=o.weight_decay, momentum=o.momentum
            ),
            "lamb": lambda: optim.lamb(lr, b1=b1, b2=b2, eps=o.eps, weight_decay=o.weight_decay),
        }
        opt = makers[o.type]()
        if o.clip_global_norm:
            opt = optim.chain(optim.clip_by_global_norm(o.clip_global_norm), opt)
        if self.precision.params != "fp32" and self.precision.master_weights:
            opt = optim.with_master_weights(opt)
        if accumulation > 1:
            opt = optim.MultiSteps(opt, accumulation)
        return opt

    def make_loss_scale(self) -> Any:
        """A :class:`optim.DynamicLossScale` for fp16 (fixed when
        ``dynamic`` is off), else None."""
        from . import optim

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
        mesh = self.abstract_mesh(world_size)
        batch = self.batch.resolve(self.dp_size(world_size))
        p, o, s = self.parallel, self.optimizer, self.schedule
        presets = [f"rules.zero({p.zero}, {p.zero_axis!r})"]
        if p.tp:
            presets.append(f"rules.megatron({p.tp!r}, sequence_parallel={p.sequence_parallel})")
        if p.sp:
            presets.append(f"rules.ulysses({p.sp!r})")
        lr = self.make_schedule()
        total = s.total_steps or self.steps
        return "\n".join(
            [
                f"mesh: {mesh!r} on {world_size} rank(s)",
                f"presets: {' + '.join(presets)}; gradient buckets {p.bucket_bytes / 2**20:g} MiB",
                f"batch: global {batch.global_size} = micro {batch.micro} x accumulation "
                f"{batch.accumulation} x data-parallel {self.dp_size(world_size)}",
                f"optimizer: {o.type}(lr={o.lr:g}, betas={tuple(o.betas)}, eps={o.eps:g}, "
                f"weight_decay={o.weight_decay:g})"
                + (
                    f", clipped at global norm {o.clip_global_norm:g}" if o.clip_global_norm else ""
                ),
                f"schedule: {s.type} (warmup {s.warmup_steps} steps, {s.warmup}); lr at steps "
                f"0, {s.warmup_steps}, {total - 1}: {lr(0):.3g}, {lr(s.warmup_steps):.3g}, "
                f"{lr(total - 1):.3g}",
                f"precision: {self.precision.params}"
                + (" with fp32 master weights" if self.precision.params != "fp32" else "")
                + (", dynamic loss scale" if self.precision.params == "fp16" else ""),
                f"steps: {self.steps}, seed {self.seed}",
                f"checkpoint: {self.checkpoint.dir} every {self.checkpoint.every or 'end'}, "
                f"keep {self.checkpoint.keep}",
                f"monitor: every {self.monitor.log_every} steps to {', '.join(self.monitor.writers)}",
            ]
        )


def _warmup_then(s: ScheduleConfig, peak: float, total: int) -> Callable[[int], float]:
    """Warmup (linear or DeepSpeed's log) to ``peak``, then constant, cosine
    or linear decay to ``end_lr`` at ``total``."""
    warm, init, end = s.warmup_steps, s.init_lr, s.end_lr
    if s.type != "warmup_constant" and not total > warm:
        raise ConfigError(f"schedule.total_steps ({total}) must exceed warmup_steps ({warm})")

    def schedule(step: int) -> float:
        if step < warm:
            f = math.log(step + 1) / math.log(warm + 1) if s.warmup == "log" else step / warm
            return init + (peak - init) * f
        if s.type == "warmup_constant":
            return peak
        f = min(1.0, (step - warm) / (total - warm))
        if s.type == "warmup_cosine":
            return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * f))
        return peak + (end - peak) * f

    return schedule


def _section(source: str, name: str, cls: type, value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: {name} is an object of settings; got {value!r}")
    fields = {f.name for f in attrs.fields(cls)}
    file_names = {_RENAMES.get((name, k), k): k for k in value}
    allowed = sorted(({k for k in fields} - set(_RENAMES.values())) | {
        k[1] for k in _RENAMES if k[0] == name
    })  # fmt: skip
    kwargs = {}
    for field, key in file_names.items():
        if field not in fields:
            raise _keyed(_unknown(source, key, f"{name}.", allowed), f"{name}.{key}")
        kwargs[field] = value[key]
    try:
        return cls(**kwargs)
    except ConfigError as err:
        key = _first_key(str(err), set(value))
        raise _keyed(f"{source}: {name}.{err}", f"{name}.{key}" if key else None) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}: {name}: {err}") from None


def _keyed(message: str, key_path: str | None) -> ConfigError:
    """A ConfigError that knows the key path it is about (so that a file's
    line can be named)."""
    err = ConfigError(message)
    err.key_path = key_path  # type: ignore[attr-defined]
    return err


def _first_key(message: str, keys: Any) -> str | None:
    """The key a value error names first (``lr is a number; ...``), if it is one of ``keys``."""
    word = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return word if word in keys else None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _overflow(text: str) -> str:
    """``LINE: message`` for the first number in ``text`` that is no finite float."""
    import re

    for m in re.finditer(r"(?<![\w.])[-+]?\d+(?:\.\d*)?[eE][-+]?\d+", text):
        if not math.isfinite(float(m.group())):
            line = text.count("\n", 0, m.start()) + 1
            return f"{line}: the number {m.group()} is too large (not a finite number)"
    return " a number could not be read (out of range)"


def _line_of(text: str, path: tuple[str, ...], occurrence: int = 1) -> int | None:
    """The line of ``text`` where the key ``path`` (section, key) is written
    (its ``occurrence``-th time for the last part); None if not found."""
    import re

    pos = 0
    for i, key in enumerate(path):
        pattern = re.compile(rf'(?:^|[{{,\s])["\']?{re.escape(key)}["\']?\s*:', re.M)
        found = list(pattern.finditer(text, pos))
        want = occurrence if i == len(path) - 1 else 1
        if len(found) < want:
            return None
        pos = found[want - 1].end()
    return text.count("\n", 0, pos) + 1


def _unknown(source: str, key: str, prefix: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = prefix.rstrip(".") or "the top level"
    return f"{source}: unknown key {prefix}{key}{hint}; {where} takes {', '.join(allowed)}"


def _plain(value: Any) -> Any:
    """hjson's ordered dicts and Decimal-free values as plain Python."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load_config(path: str | Path) -> RunConfig:
    """Read a run config from an hjson (or JSON) file.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "run.hjson"
    >>> _ = path.write_text("steps: 10\\nparallel: {zero: 2}\\n")
    >>> load_config(path).parallel.zero
    2
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {str(path)!r}: {err.strerror or err}") from None
    return RunConfig.from_text(text, str(path))


# -- DeepSpeed configs ------------------------------------------------------------------

_DS_IGNORED = {
    "zero_optimization.overlap_comm": "always on: gradient buckets reduce while backward runs",
    "zero_optimization.contiguous_gradients": "not needed: gradients land in their buckets",
    "zero_optimization.reduce_scatter": "always on: ZeRO-2/3 reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "always on: ZeRO-3 all-gathers parameters per unit",
    "zero_optimization.allgather_bucket_size": "ZeRO-3 gathers one unit (a block) at a time",
    "zero_optimization.stage3_prefetch_bucket_size": "ZeRO-3 prefetches the next unit",
    "zero_optimization.stage3_max_live_parameters": "ZeRO-3 keeps at most two units gathered",
    "zero_optimization.stage3_max_reuse_distance": "ZeRO-3 re-gathers for backward",
    "zero_optimization.stage3_param_persistence_threshold": "every parameter is sharded",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "checkpoints are sharded; `shardax ckpt consolidate` writes the full weights"
    ),
    "zero_optimization.sub_group_size": "the optimizer steps every shard at once",
    "zero_optimization.round_robin_gradients": "not needed without optimizer offload",
    "wall_clock_breakdown": "mapped to monitor.timers",
    "prescale_gradients": "gradients are averaged once, after reduction",
    "gradient_predivide_factor": "gradients are averaged once, after reduction",
}


def from_deepspeed(
    ds: Mapping[str, Any], *, lossy: bool = False
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A shardax run config (as file data) from a DeepSpeed config, and every
    DeepSpeed key it did not map, with the reason.

    The conversion never changes what the run computes silently: a key whose
    loss would change the math — an optimizer, scheduler or parameter of
    them that shardax cannot express, a loss-scaling rule it does not have,
    a key it does not know, fp16 and bf16 both enabled — is a
    :class:`ConfigError` naming it, unless ``lossy`` (``--lossy``), which
    drops it and lists it with the others. Keys that only tune DeepSpeed's
    own machinery (buckets, overlap, offload, logging) are listed, never an
    error.

    Batch keys (``"auto"`` leaves a size to be computed), ``zero_optimization``
    (stage, reduce bucket size; offload is listed as unmapped), ``bf16`` /
    ``fp16`` (loss scale: 0 is dynamic, ``initial_scale_power``,
    ``loss_scale_window``), ``optimizer`` (DeepSpeed's Adam is AdamW unless
    ``adam_w_mode`` is false), ``scheduler`` (WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle), ``gradient_clipping``, ``steps_per_print``,
    ``wall_clock_breakdown``, ``comms_logger`` and the monitors.

    >>> data, unmapped = from_deepspeed({"train_batch_size": 32, "zero_optimization": {"stage": 2},
    ...     "fp16": {"enabled": True, "loss_scale": 0}, "zero_allow_untested_optimizer": True})
    >>> data["batch"], data["parallel"], data["precision"]["params"]
    ({'global': 32}, {'zero': 2}, 'fp16')
    >>> unmapped
    [('zero_allow_untested_optimizer', 'no effect here: shardax runs any optimizer')]
    >>> from_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}})
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: DeepSpeed config: cannot convert without changing what the run computes: optimizer.type='OneBitAdam' (shardax has adamw, adam, lion, sgd, adagrad, rmsprop, lamb); pass --lossy (lossy=True) to drop them, listed in the output
    """
    out: dict[str, Any] = {}
    unmapped: list[tuple[str, str]] = []
    changes: list[str] = []  # dropped keys that change the math

    def put(section: str, key: str, value: Any) -> None:
        out.setdefault(section, {})[key] = value

    def skip(key: str, why: str, math: bool = True) -> None:
        """Drop ``key``; ``math``: the run would compute something else."""
        unmapped.append((key, why if not math or not lossy else f"{why} [changes the math]"))
        if math:
            changes.append(f"{key} ({why})")

    def harmless(key: str, why: str) -> None:
        skip(key, why, math=False)

    enabled = [k for k in ("fp16", "bf16") if _ds_enabled(ds.get(k))]
    if len(enabled) == 2:
        raise ConfigError(
            "DeepSpeed config: fp16 and bf16 are both enabled; DeepSpeed itself refuses this. "
            "Enable one of them"
        )

    for key, value in ds.items():
        if key in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        ):
            name = {"train_batch_size": "global", "train_micro_batch_size_per_gpu": "micro",
                    "gradient_accumulation_steps": "accumulation"}[key]  # fmt: skip
            if value != "auto":
                put("batch", name, int(value))
        elif key == "zero_optimization":
            _ds_zero(value, put, skip)
        elif key in ("bf16", "fp16"):
            _ds_precision(key, value, put, skip)
        elif key == "optimizer":
            _ds_optimizer(value, put, skip)
        elif key == "scheduler":
            _ds_scheduler(value, ds, put, skip)
        elif key == "gradient_clipping":
            if value not in (0, 0.0, "auto"):
                put("optimizer", "clip_global_norm", float(value))
        elif key == "steps_per_print":
            put("monitor", "log_every", int(value))
        elif key == "wall_clock_breakdown":
            if value:
                put("monitor", "timers", True)
        elif key == "comms_logger":
            if isinstance(value, Mapping) and value.get("enabled"):
                put("monitor", "comm", True)
                for k in value:
                    if k != "enabled":
                        skip(f"comms_logger.{k}", "the comm log records every collective", False)
        elif key in ("tensorboard", "csv_monitor"):
            if isinstance(value, Mapping) and value.get("enabled"):
                writer = "tensorboard" if key == "tensorboard" else "csv"
                writers = out.setdefault("monitor", {}).setdefault("writers", ["stdout"])
                writers.append(writer)
                if value.get("output_path"):
                    job = value.get("job_name", "")
                    put(
                        "monitor",
                        "dir",
                        str(Path(value["output_path"]) / job) if job else value["output_path"],
                    )
        elif key in ("wandb", "comet"):
            harmless(key, f"no {key} writer: use tensorboard, csv or jsonl")
        elif key == "activation_checkpointing":
            harmless(key, "activation checkpointing is not a config setting in shardax yet")
        elif key in _DS_IGNORED:
            harmless(key, _DS_IGNORED[key])
        elif key in _DS_HARMLESS:
            harmless(key, _DS_HARMLESS[key])
        else:
            skip(key, "no shardax setting for it")
    if changes and not lossy:
        raise ConfigError(
            "DeepSpeed config: cannot convert without changing what the run computes: "
            + "; ".join(changes)
            + "; pass --lossy (lossy=True) to drop them, listed in the output"
        )
    return out, unmapped


def _ds_enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and section.get("enabled") not in (None, False, "auto")


_DS_HARMLESS = {
    "zero_allow_untested_optimizer": "no effect here: shardax runs any optimizer",
    "flops_profiler": "see shardax.monitor (throughput and MFU)",
    "memory_breakdown": "see shardax.monitor (memory=True)",
    "dump_state": "no engine state to dump",
}


def _ds_zero(zero: Any, put: Callable[..., None], skip: Callable[..., None]) -> None:
    for key, value in zero.items():
        where = f"zero_optimization.{key}"
        if key == "stage":
            put("parallel", "zero", int(value))
        elif key == "reduce_bucket_size":
            if value != "auto":
                put("parallel", "bucket_bytes", int(float(value)) * 4)  # elements of fp32 grads
        elif key in ("offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params"):
            skip(where, "shardax has no CPU/NVMe offload yet: the state stays on the device", False)
        elif where in _DS_IGNORED:
            skip(where, _DS_IGNORED[where], False)
        else:
            skip(where, "no shardax setting for it")


def _ds_precision(
    key: str, value: Any, put: Callable[..., None], skip: Callable[..., None]
) -> None:
    if (
        not isinstance(value, Mapping)
        or not value.get("enabled", False)
        or value["enabled"] == "auto"
    ):
        return
    put("precision", "params", key)
    if key == "fp16":  # DeepSpeed's defaults for what the file leaves out
        put("precision", "growth_interval", 1000)
        put("precision", "hysteresis", 2)
        put("precision", "min_loss_scale", 1.0)
    for k, v in value.items():
        where = f"{key}.{k}"
        if k == "enabled":
            continue
        if key == "fp16" and k == "loss_scale":
            if float(v) != 0:
                put("precision", "loss_scale", float(v))
                put("precision", "dynamic", False)
        elif key == "fp16" and k == "initial_scale_power":
            put("precision", "loss_scale", float(2 ** int(v)))
        elif key == "fp16" and k == "loss_scale_window":
            put("precision", "growth_interval", int(v))
        elif key == "fp16" and k == "hysteresis":
            put("precision", "hysteresis", int(v))
        elif key == "fp16" and k == "min_loss_scale":
            put("precision", "min_loss_scale", float(v))
        elif key == "fp16" and k == "consecutive_hysteresis":
            if v:
                skip(where, "the hysteresis is restored when the scale grows, not at every "
                            "finite step")  # fmt: skip
        else:
            skip(where, "no shardax setting for it")


_DS_OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "lamb": "lamb", "lion": "lion", "sgd": "sgd",
                  "adagrad": "adagrad", "rmsprop": "rmsprop", "fusedadam": "adam",
                  "cpuadam": "adam", "deepspeedcpuadam": "adam"}  # fmt: skip


def _ds_optimizer(opt: Any, put: Callable[..., None], skip: Callable[..., None]) -> None:
    kind = str(opt.get("type", "")).lower().replace("_", "")
    if kind not in _DS_OPTIMIZERS:
        skip(f"optimizer.type={opt.get('type')!r}", f"shardax has {', '.join(OPTIMIZERS)}")
        return
    params = dict(opt.get("params", {}))
    name = _DS_OPTIMIZERS[kind]
    if name == "adam" and params.pop("adam_w_mode", True):
        name = "adamw"  # DeepSpeed's Adam decouples weight decay unless told not to
    put("optimizer", "type", name)
    for k, v in params.items():
        where = f"optimizer.params.{k}"
        if v == "auto":
            continue
        if k in ("lr", "eps", "weight_decay", "momentum"):
            put("optimizer", k, float(v))
        elif k == "betas":
            put("optimizer", "betas", [float(b) for b in v])
        elif k == "bias_correction" and not v:
            skip(where, "shardax's Adam always corrects the moment bias")
        elif k in ("torch_adam", "fused", "bias_correction", "amsgrad") and not v:
            continue
        else:
            skip(where, "no shardax setting for it")


def _ds_scheduler(
    sched: Any, ds: Mapping[str, Any], put: Callable[..., None], skip: Callable[..., None]
) -> None:
    kind = sched.get("type")
    p = dict(sched.get("params", {}))
    lr = ds.get("optimizer", {}).get("params", {}).get("lr")
    used: set[str] = set()

    def take(key: str, default: Any = None) -> Any:
        used.add(key)
        value = p.get(key, default)
        return default if value == "auto" else value

    warmup = take("warmup_type", "log")
    if kind in ("WarmupLR", "WarmupDecayLR"):
        put("schedule", "type", "warmup_constant" if kind == "WarmupLR" else "warmup_linear")
        put("schedule", "warmup_steps", int(take("warmup_num_steps", 1000)))
        put("schedule", "init_lr", float(take("warmup_min_lr", 0.0)))
        peak = take("warmup_max_lr", 0.001)
        put("optimizer", "lr", float(peak))
        put("schedule", "warmup", warmup)
        if kind == "WarmupDecayLR":
            put("schedule", "total_steps", int(take("total_num_steps")))
            put("schedule", "end_lr", 0.0)
    elif kind == "WarmupCosineLR":
        base = float(lr if lr not in (None, "auto") else 1e-3)
        put("schedule", "type", "warmup_cosine")
        put("schedule", "warmup_steps", int(take("warmup_num_steps", 1000)))
        put("schedule", "total_steps", int(take("total_num_steps")))
        put("schedule", "init_lr", base * float(take("warmup_min_ratio", 0.0)))
        put("schedule", "end_lr", base * float(take("cos_min_ratio", 1e-4)))
        put("schedule", "warmup", warmup)
    elif kind == "OneCycle":
        low, high = float(take("cycle_min_lr")), float(take("cycle_max_lr"))
        first = int(take("cycle_first_step_size", 2000))
        second = take("cycle_second_step_size") or first
        put("schedule", "type", "one_cycle")
        put("optimizer", "lr", high)
        put("schedule", "total_steps", first + int(second))
        put("schedule", "pct_start", first / (first + int(second)))
        put("schedule", "div_factor", high / low)
        put("schedule", "final_div_factor", 1.0 / float(take("decay_lr_rate", 0.0) or 1e-4))
        for k in ("cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"):
            if k in p:
                used.add(k)
                skip(f"scheduler.params.{k}", "the momentum is not cycled")
    else:
        skip(
            f"scheduler.type={kind!r}",
            "shardax maps WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle",
        )
        return
    for k in p:
        if k not in used:
            skip(f"scheduler.params.{k}", "no shardax setting for it")


def to_hjson(
    data: Mapping[str, Any], unmapped: list[tuple[str, str]] = (), source: str = ""
) -> str:
    """Config data as an hjson file, with the keys a conversion could not map
    as comments at the top."""
    import hjson

    head = [f"// converted from {source} by `shardax config from-deepspeed`"] if source else []
    if unmapped:
        head.append("// not mapped:")
        head += [f"//   {key}: {why}" for key, why in unmapped]
    return "\n".join([*head, hjson.dumps(data)]) + "\n"


def _load_model(spec: str) -> Any:
    """``path/to/file.py:factory`` or ``package.module:factory`` → the module
    it returns (called without arguments, under the meta device)."""
    import importlib
    import importlib.util

    import torch

    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not attr:
        raise ConfigError(f"--model {spec!r} is FILE.py:NAME or MODULE:NAME")
    if target.endswith(".py"):
        path = Path(target).resolve()
        import sys

        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"--model: cannot load {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"--model: {target!r} has no {attr!r}")
    try:
        with torch.device("meta"):
            model = factory() if not isinstance(factory, torch.nn.Module) else factory
    except TypeError as err:
        raise ConfigError(
            f"--model {spec!r}: calling {attr}() failed ({err}); name a function that builds "
            "the model without arguments"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"--model {spec!r} gave a {type(model).__name__}, not an nn.Module")
    return model


def _config_cli() -> Any:
    import click

    from ._bad_setting import BadSetting

    @click.group("config")
    def config_command() -> None:
        """Check run configs and convert DeepSpeed ones."""

    @config_command.command("check")
    @click.argument("path", type=click.Path(dir_okay=False))
    @click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Plan for this many ranks.")  # fmt: skip
    @click.option("--model", default=None, metavar="FILE.py:NAME",
                  help="Also explain how the presets shard this model (built on meta).")  # fmt: skip
    def check(path: str, world_size: int, model: str | None) -> None:
        """Validate PATH and print the resolved plan."""
        try:
            config = load_config(path)
            click.echo(config.plan(world_size))
            if model is not None:
                from .shard import explain
                from .shard._params import params_of

                built = _load_model(model)
                mesh = config.abstract_mesh(world_size)
                click.echo(str(explain(params_of(built), mesh, config.make_rules())))
        except ConfigError as err:
            raise BadSetting(str(err)) from None

    @config_command.command("from-deepspeed")
    @click.argument("path", type=click.Path(dir_okay=False))
    @click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
                  help="Write the hjson here (default: stdout).")  # fmt: skip
    @click.option("--lossy", is_flag=True,
                  help="Drop keys whose loss changes what the run computes (listed in the "
                       "output's header) instead of refusing them.")  # fmt: skip
    def convert(path: str, output: str | None, lossy: bool) -> None:
        """Convert the DeepSpeed config PATH into a shardax run config; keys
        that cannot be mapped are listed (in the file and on stderr), and a
        key whose loss would change the math is an error unless --lossy."""
        import json

        try:
            ds = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise BadSetting(f"cannot read DeepSpeed config {path!r}: {err}") from None
        if not isinstance(ds, dict):
            raise BadSetting(f"{path!r} is not a JSON object")
        try:
            data, unmapped = from_deepspeed(ds, lossy=lossy)
        except ConfigError as err:
            raise BadSetting(f"{path}: {err}") from None
        try:
            RunConfig.from_text(to_hjson(data), path)  # the result must pass `config check`
        except ConfigError as err:
            raise BadSetting(f"the converted config is invalid: {err}") from None
        text = to_hjson(data, unmapped, path)
        if output is None:
            click.echo(text, nl=False)
        else:
            Path(output).write_text(text)
        for key, why in unmapped:
            click.echo(f"not mapped: {key}: {why}", err=True)

    return config_command
