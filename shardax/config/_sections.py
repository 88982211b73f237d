"""The sections of a run config (``parallel``, ``optimizer``, ``schedule``,
``precision``, ``batch``, ``checkpoint``, ``monitor``, ``memory``): frozen attrs values
whose fields are the one source of defaults, and building one from a file's
object of settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import attrs

from ..errors import ConfigError
from ._fields import (
    COMPRESSED,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISIONS,
    SCHEDULES,
    WRITERS,
    _as_bool,
    _as_float,
    _as_int,
    _as_str,
    _in,
    _list_of,
    _non_negative,
    _optional,
    _positive,
)
from ._hjson import _first_key, _keyed, _unknown


@attrs.frozen
class ParallelConfig:
    """Which presets shard the model: ``zero`` (0–3) over ``zero_axis``;
    ``replicate`` — a second data axis whose ranks hold replicas (hybrid
    sharding, HSDP/MiCS: ZeRO within each replica, over ``zero_axis``; the
    batch split over both, gradients summed over the replicas);
    ``node`` — an outer data axis across nodes whose ranks also split the
    parameters (ZeRO over ``node`` × ``zero_axis``, the batch over both),
    which ZeRO++'s options need: ``secondary`` (hpZ: backward gathers over
    ``zero_axis`` only, from a copy split within the node) and
    ``quantize_weights`` (qwZ: parameter gathers in int8; ZeRO-3) and
    ``quantize_grads`` (qgZ: gradients reduce-scattered in int4, within the
    node then across; ZeRO-2 or 3);
    ``persist_below`` — ZeRO-3 keeps parameters of fewer elements than this
    whole on every rank (DeepSpeed's ``stage3_param_persistence_threshold``;
    0: every parameter split); ``keep_gathered`` — ZeRO-3 keeps the forward's
    gathered parameters for the backward instead of gathering them again
    (FSDP2's ``reshard_after_forward=False``);
    ``tp`` — the mesh axis of ``rules.megatron`` (``sequence_parallel`` for
    Megatron-SP); ``sp`` — the axis of ``rules.ulysses``; ``pp`` — the
    pipeline axis, run by the ``pp_schedule`` generator (``pipeline.<name>``)
    over ``pp_micro_batches`` micro-batches (None: twice the stages) with
    ``pp_virtual`` stages per rank where the schedule takes several; ``ep``
    — the axis of ``rules.experts`` (mixture-of-experts layers: each rank
    holds its experts; the ``ep`` ranks take their own rows of the batch,
    as the data axis's do); ``cp`` — the axis of ``rules.context_parallel``
    (ring attention: the ``cp`` ranks take their own piece of each
    sequence, split zigzag, and ZeRO shards over them too, as over the data
    axis); ``bucket_bytes`` of gradient reductions; ``prefetch`` of ZeRO-3
    gathers."""

    zero: int = attrs.field(default=0, converter=_as_int("zero"))
    zero_axis: str = attrs.field(default="dp", converter=_as_str("zero_axis"))
    replicate: str | None = attrs.field(default=None, converter=_optional(_as_str, "replicate"))
    node: str | None = attrs.field(default=None, converter=_optional(_as_str, "node"))
    secondary: bool = attrs.field(default=False, converter=_as_bool("secondary"))
    quantize_weights: bool = attrs.field(default=False, converter=_as_bool("quantize_weights"))
    quantize_grads: bool = attrs.field(default=False, converter=_as_bool("quantize_grads"))
    persist_below: int = attrs.field(default=0, converter=_as_int("persist_below"))
    keep_gathered: bool = attrs.field(default=False, converter=_as_bool("keep_gathered"))
    tp: str | None = attrs.field(default=None, converter=_optional(_as_str, "tp"))
    sequence_parallel: bool = attrs.field(default=False, converter=_as_bool("sequence_parallel"))
    sp: str | None = attrs.field(default=None, converter=_optional(_as_str, "sp"))
    pp: str | None = attrs.field(default=None, converter=_optional(_as_str, "pp"))
    ep: str | None = attrs.field(default=None, converter=_optional(_as_str, "ep"))
    cp: str | None = attrs.field(default=None, converter=_optional(_as_str, "cp"))
    pp_schedule: str = attrs.field(default="1f1b", validator=_in(PP_SCHEDULES))
    pp_micro_batches: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "pp_micro_batches"), validator=_positive
    )
    pp_virtual: int = attrs.field(default=2, converter=_as_int("pp_virtual"), validator=_positive)
    bucket_bytes: int = attrs.field(
        default=25 * 2**20, converter=_as_int("bucket_bytes"), validator=_positive
    )
    prefetch: bool = attrs.field(default=True, converter=_as_bool("prefetch"))

    def __attrs_post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero is a ZeRO stage 0..3; got {self.zero!r}")
        if (self.secondary or self.quantize_weights) and self.zero != 3:
            raise ConfigError(
                "secondary and quantize_weights (ZeRO++) change how split "
                f"parameters are gathered; they need parallel.zero: 3, got {self.zero}"
            )
        if self.persist_below < 0 or (self.persist_below and self.zero != 3):
            raise ConfigError(
                "persist_below keeps parameters of fewer elements whole where ZeRO-3 would "
                f"split them: a number >= 0 with parallel.zero: 3; got {self.persist_below} "
                f"with zero {self.zero}"
            )
        if self.keep_gathered and (self.zero != 3 or self.secondary):
            raise ConfigError(
                "keep_gathered keeps the parameters ZeRO-3 gathers for the forward until the "
                "backward: it needs parallel.zero: 3, and replaces secondary (hpZ: backward "
                f"gathers from a copy in the node); got zero {self.zero}, secondary "
                f"{self.secondary}"
            )
        if self.quantize_grads and (self.zero < 2 or self.node is None):
            raise ConfigError(
                "quantize_grads (ZeRO++ qgZ) reduce-scatters gradients within each node, "
                "then across nodes: it needs parallel.zero 2 or 3 and the axis across nodes as "
                f"parallel.node (a mesh of {{'node': N, 'dp': ranks per node}}); got zero "
                f"{self.zero}, node {self.node!r}"
            )
        if self.secondary and self.node is None:
            raise ConfigError(
                "secondary (ZeRO++ hpZ) keeps a copy split over the ranks of a node: "
                "name the axis across nodes as parallel.node (a mesh of {'node': N, 'dp': "
                "ranks per node})"
            )
        if self.node is not None and self.node in (self.zero_axis, self.replicate):
            raise ConfigError(
                f"node names {self.node!r}, which is already the data axis or the "
                "replicas'; the axis across nodes needs an axis of its own"
            )
        if self.sequence_parallel and self.tp is None:
            raise ConfigError("sequence_parallel needs parallel.tp (the tensor axis)")
        named = [("zero_axis", self.zero_axis), ("tp", self.tp), ("sp", self.sp), ("pp", self.pp)]
        for key, axis in named:
            if self.ep is not None and axis == self.ep:
                raise ConfigError(
                    f"ep and parallel.{key} both name the axis {self.ep!r}: experts need "
                    "an axis of their own (a mesh of {'dp': ..., 'ep': ...} splits the data "
                    "ranks into expert groups)"
                )
        for key, axis in [*named, ("ep", self.ep), ("cp", self.cp)]:
            if self.replicate is not None and axis == self.replicate:
                raise ConfigError(
                    f"replicate and parallel.{key} both name the axis {self.replicate!r}: the "
                    "replicas need an axis of their own (a mesh of {'replicate': ..., 'dp': "
                    "...} shards over dp within each replica)"
                )
        for key, axis in [*named, ("ep", self.ep)]:
            if self.cp is not None and axis == self.cp:
                raise ConfigError(
                    f"cp and parallel.{key} both name the axis {self.cp!r}: context "
                    "parallelism needs an axis of its own (a mesh of {'dp': ..., 'cp': ...} "
                    "splits each data rank's sequences over its cp ranks)"
                )


_LAMB_KEYS = (
    "max_coeff",
    "min_coeff",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
)


def _setting(key: str, kind: Any, value: Any, positive: bool) -> Any:
    """One setting of a sub-object: one of the choices ``kind`` (a tuple),
    or a bool, an int or a float (positive where ``positive``)."""
    if isinstance(kind, tuple):
        if value not in kind:
            raise ConfigError(f"{key} is one of {kind}; got {value!r}")
        return value
    if kind is bool:
        return _as_bool(key)(value)
    number = (_as_int if kind is int else _as_float)(key)(value)
    if positive and not number > 0:
        raise ConfigError(f"{key} must be positive; got {number!r}")
    return number


def _sub_settings(name: str, kinds: dict[str, Any], positive: bool = True) -> Any:
    """The converter of an optimizer's sub-object ``name`` of the settings ``kinds``."""

    def convert(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ConfigError(f"{name} is an object of settings; got {value!r}")
        unknown = sorted(set(value) - set(kinds))
        if unknown:
            raise ConfigError(f"{name}: unknown {unknown}; it takes {', '.join(kinds)}")
        return {k: _setting(f"{name}.{k}", kinds[k], v, positive) for k, v in value.items()}

    return convert


_zero_one_settings = _sub_settings(
    "zero_one", dict.fromkeys(("var_update_scaler", "local_step_scaler", "local_step_clipper"), int)
)
_muon_settings = _sub_settings(
    "muon",
    {"scale": ("moonlight", "spectral"), "ns_steps": int, "nesterov": bool, "rms_scale": float,
     "adam_lr": float},
)  # fmt: skip
_lamb_settings = _sub_settings("lamb", dict.fromkeys(_LAMB_KEYS, float), positive=False)


@attrs.frozen
class OptimizerConfig:
    """The optimizer (``type``) and its hyperparameters; ``bias_correction``
    (adam, adamw, onebit_adam): false divides by neither moment's bias
    correction, as DeepSpeed's and apex's FusedAdam with
    ``bias_correction=False`` (and DeepSpeed's OnebitAdam, always).
    ``onebit_adam`` and ``onebit_lamb`` (DeepSpeed's OnebitAdam and
    OnebitLamb: 1-bit momenta after ``freeze_step`` warm-up steps, over the
    data axes, at ZeRO-0) take ``freeze_step``, and 1-bit LAMB its trust
    ratio's ``lamb`` settings (``max_coeff``, ``min_coeff``, ``coeff_beta``,
    ``factor_max``, ``factor_min``, ``factor_threshold``; DeepSpeed's
    names and defaults). ``zero_one_adam`` (DeepSpeed's ZeroOneAdam) takes
    ``freeze_step`` as its ``var_freeze_step`` (the last step that may
    update the variance), ``zero_one`` (``var_update_scaler``,
    ``local_step_scaler``, ``local_step_clipper``; DeepSpeed's names and
    defaults) and ``bias_correction: false`` (it corrects neither
    moment). ``muon`` (Moonlight's Muon for matrices, Adam with ``betas``
    and ``eps`` for the rest) needs ``momentum`` and takes ``muon``
    (``scale``: moonlight or spectral, ``ns_steps``, ``nesterov``,
    ``rms_scale``, ``adam_lr``: the Adam part's learning rate, the
    schedule's shape scaled to it)."""

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
    bias_correction: bool = attrs.field(default=True, converter=_as_bool("bias_correction"))
    freeze_step: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "freeze_step"), validator=_positive
    )
    lamb: dict[str, float] = attrs.field(factory=dict, converter=_lamb_settings)
    zero_one: dict[str, int] = attrs.field(factory=dict, converter=_zero_one_settings)
    muon: dict[str, Any] = attrs.field(factory=dict, converter=_muon_settings)

    def __attrs_post_init__(self) -> None:
        if len(self.betas) != 2:
            raise ConfigError(f"optimizer.betas is two numbers; got {self.betas!r}")
        onebit = self.type in COMPRESSED
        if onebit and self.freeze_step is None:
            raise ConfigError(
                f"{self.type} needs freeze_step: "
                + (
                    "the last step that may update the variance, DeepSpeed's var_freeze_step "
                    "(usually the end of the learning-rate warm-up)"
                    if self.type == "zero_one_adam"
                    else "the warm-up steps of full-precision Adam before the variance "
                    "freezes and the momenta go 1-bit (DeepSpeed suggests 15-25 % of the run)"
                )
            )
        if not onebit and self.freeze_step is not None:
            raise ConfigError(
                f"freeze_step is a setting of {', '.join(COMPRESSED)}, not {self.type}"
            )
        if self.zero_one and self.type != "zero_one_adam":
            raise ConfigError(
                f"zero_one (0/1 Adam's variance and local-step policies) is for zero_one_adam, "
                f"not {self.type}"
            )
        if self.muon and self.type != "muon":
            raise ConfigError(f"muon (Muon's settings) is for type muon, not {self.type}")
        if self.type == "muon" and not self.momentum:
            raise ConfigError(
                "muon needs momentum (Moonlight's and DeepSpeed's: 0.95): the momentum it "
                "orthogonalizes; 0 would orthogonalize each raw gradient"
            )
        if self.type == "zero_one_adam" and self.bias_correction:
            raise ConfigError(
                "zero_one_adam corrects neither moment's bias (DeepSpeed's ZeroOneAdam, "
                "whatever its flag says): set bias_correction: false"
            )
        if self.lamb and self.type != "onebit_lamb":
            raise ConfigError(
                f"lamb (the trust ratio's settings) is for onebit_lamb, not {self.type}"
            )
        if not self.bias_correction and self.type not in (
            "adam",
            "adamw",
            "onebit_adam",
            "zero_one_adam",
        ):
            raise ConfigError(
                f"bias_correction is false, a switch of adam and adamw only: {self.type} always "
                "corrects its moments' bias. Use type adam or adamw, or drop bias_correction"
            )


@attrs.frozen
class ScheduleConfig:
    """The learning-rate schedule (its peak is ``optimizer.lr``):
    ``warmup_steps`` from ``init_lr`` (``warmup: "linear"``, or ``"log"``:
    ``log(step + 1) / log(warmup_steps + 1)`` of the way), then constant,
    cosine or linear decay to ``end_lr`` at ``total_steps`` (default: the
    run's steps), or the 1cycle policy: ``one_cycle`` as torch's
    ``OneCycleLR`` (``pct_start``, ``div_factor``, ``final_div_factor``),
    ``one_cycle_linear`` as DeepSpeed's ``OneCycle`` — linearly from
    ``init_lr`` up to ``optimizer.lr`` over ``up_steps``, down again over
    ``down_steps`` (default ``up_steps``), in ``up_stairs``/``down_stairs``
    stairs if given, then ``init_lr / (1 + decay_rate * steps_after /
    decay_steps)`` (``init_lr`` where either is 0).

    ``deepspeed: true`` makes ``warmup_constant``, ``warmup_linear`` and
    ``warmup_cosine`` DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and
    ``WarmupCosineLR`` update by update (what ``from_deepspeed`` writes):
    DeepSpeed steps its scheduler after each update, so update ``k`` runs
    at iteration ``k - 1`` (the first at ``init_lr``, ``WarmupCosineLR``'s
    at 0), warms up over ``max(2, warmup_steps)`` steps (log: ``log(k) /
    log(n)``) and decays to ``end_lr`` at update ``total_steps + 1``."""

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
    up_steps: int | None = attrs.field(
        default=None, converter=_optional(_as_int, "up_steps"), validator=_positive
    )
    down_steps: int | None = attrs.field(
        default=None,
        converter=_optional(_as_int, "down_steps"),
        validator=attrs.validators.optional(_non_negative),
    )
    up_stairs: int = attrs.field(default=0, converter=_as_int("up_stairs"), validator=_non_negative)
    down_stairs: int | None = attrs.field(
        default=None,
        converter=_optional(_as_int, "down_stairs"),
        validator=attrs.validators.optional(_non_negative),
    )
    decay_rate: float = attrs.field(default=0.0, converter=_as_float("decay_rate"))
    decay_steps: int = attrs.field(
        default=0, converter=_as_int("decay_steps"), validator=_non_negative
    )
    deepspeed: bool = attrs.field(default=False, converter=_as_bool("deepspeed"))

    def __attrs_post_init__(self) -> None:
        warmups = ("warmup_constant", "warmup_linear", "warmup_cosine")
        if self.deepspeed and self.type not in warmups:
            raise ConfigError(
                f"deepspeed is a setting of schedules {', '.join(warmups)} (stepped as "
                f"DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR); schedule {self.type} does "
                "not use it: drop it or set one of those types"
            )
        if self.deepspeed and self.warmup_steps < 1:
            raise ConfigError(
                "warmup_steps is at least 1 with deepspeed (DeepSpeed's warmup_num_steps is a "
                f"positive integer); got {self.warmup_steps}"
            )
        linear = ("up_steps", "down_steps", "up_stairs", "down_stairs", "decay_rate", "decay_steps")
        if self.type == "one_cycle_linear":
            if self.up_steps is None:
                raise ConfigError(
                    "up_steps is needed by schedule one_cycle_linear: the steps of its rising "
                    "half (DeepSpeed's cycle_first_step_size)"
                )
            return
        for name in linear:
            if getattr(self, name) != attrs.fields_dict(ScheduleConfig)[name].default:
                raise ConfigError(
                    f"{name} is a setting of schedule one_cycle_linear; schedule {self.type} "
                    f"does not use it: drop it or set type: one_cycle_linear"
                )


@attrs.frozen
class PrecisionConfig:
    """The params' dtype; master weights in fp32 for bf16/fp16; dynamic
    loss scaling for fp16 (``loss_scale``: initial scale, ``None`` for
    dynamic from 2**16, or a fixed number with ``dynamic: false``), with
    DeepSpeed's ``hysteresis`` and ``min_loss_scale`` as options;
    ``cast_inputs``: the model's floating-point inputs are cast to the
    params' dtype (DeepSpeed's ``fp16.auto_cast``; see
    ``RunConfig.make_input_cast``)."""

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
    cast_inputs: bool = attrs.field(default=False, converter=_as_bool("cast_inputs"))

    def __attrs_post_init__(self) -> None:
        if self.cast_inputs and self.params == "fp32":
            raise ConfigError(
                "cast_inputs casts the model's floating-point inputs to the params' half "
                "dtype, and params is fp32: set params to fp16 (or bf16), or drop cast_inputs"
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
    communication breakdown), ``comm`` (per-collective log), ``memory``,
    ``experts`` (per-expert load and dropped fraction of MoE layers);
    ``peak_tflops`` per rank for MFU. All off but stdout by default."""

    log_every: int = attrs.field(default=25, converter=_as_int("log_every"), validator=_positive)
    writers: tuple[str, ...] = attrs.field(
        default=("stdout",), converter=_list_of(_as_str, "writers")
    )
    dir: str = attrs.field(default="runs/run", converter=_as_str("dir"))
    timers: bool = attrs.field(default=False, converter=_as_bool("timers"))
    comm: bool = attrs.field(default=False, converter=_as_bool("comm"))
    memory: bool = attrs.field(default=False, converter=_as_bool("memory"))
    experts: bool = attrs.field(default=False, converter=_as_bool("experts"))
    peak_tflops: float | None = attrs.field(
        default=None, converter=_optional(_as_float, "peak_tflops"), validator=_positive
    )
    progress: bool = attrs.field(default=False, converter=_as_bool("progress"))

    def __attrs_post_init__(self) -> None:
        for w in self.writers:
            _in(WRITERS)(self, attrs.fields(MonitorConfig).writers, w)


REMAT_POLICIES = ("save_nothing", "save_matmuls")


def _memory_kind(_: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not (value == "host" or (value.startswith("disk:") and value[5:])):
        raise ConfigError(
            f"{attribute.name} is 'host' or 'disk:PATH' (a folder for the files); got {value!r}"
        )


@attrs.frozen
class MemoryConfig:
    """Memory for compute: ``remat`` — rematerialise the modules whose path
    matches ``remat_modules`` (default: the blocks of the example GPT, of
    Llama-family and of GPT-2 models) with that policy (``save_nothing``,
    ``save_matmuls``; ``rules.remat``), every ``remat_every``-th one
    (None: keep every activation); ``offload_opt``, ``offload_params``,
    ``offload_grads`` — the memory kind of the optimizer state, of the
    parameters' shards, of the reduced gradients: ``"disk:PATH"`` or
    ``"host"`` (``rules.offload``; None: the device)."""

    remat: str | None = attrs.field(
        default=None,
        converter=_optional(_as_str, "remat"),
        validator=attrs.validators.optional(_in(REMAT_POLICIES)),
    )
    remat_modules: str = attrs.field(
        default=r"(?:.*\.)?(?:blocks|layers|h)\.\d+", converter=_as_str("remat_modules")
    )
    remat_every: int = attrs.field(default=1, converter=_as_int("remat_every"), validator=_positive)
    offload_opt: str | None = attrs.field(
        default=None, converter=_optional(_as_str, "offload_opt"), validator=_memory_kind
    )
    offload_params: str | None = attrs.field(
        default=None, converter=_optional(_as_str, "offload_params"), validator=_memory_kind
    )
    offload_grads: str | None = attrs.field(
        default=None, converter=_optional(_as_str, "offload_grads"), validator=_memory_kind
    )


_SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "precision": PrecisionConfig,
    "batch": BatchConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
    "memory": MemoryConfig,
}
_RENAMES = {("batch", "global"): "global_size"}  # a Python keyword in the file


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
