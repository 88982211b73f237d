"""Importing DeepSpeed configs: ``from_deepspeed`` maps a DeepSpeed config
(as data) onto run-config data, refusing what would change the math unless
lossy; ``to_hjson`` writes it with the unmapped keys as comments. Reading a
file (hjson, as DeepSpeed reads it, with lines in errors) is
``_deepspeed_file.py``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._deepspeed_data import _ds_hpz, _ds_mics, _ds_qgz
from ._deepspeed_optim import _ds_optimizer, _optimizer_name
from ._deepspeed_values import Put, Skip, _flag, _number, _section, _whole

PERSISTENCE_DEFAULT = 100_000
"""DeepSpeed's ``stage3_param_persistence_threshold`` where a config sets none."""

_DS_IGNORED = {
    "zero_optimization.overlap_comm": "always on: gradient buckets reduce while backward runs",
    "zero_optimization.contiguous_gradients": "not needed: gradients land in their buckets",
    "zero_optimization.reduce_scatter": "always on: ZeRO-2/3 reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "always on: ZeRO-3 all-gathers parameters per unit",
    "zero_optimization.allgather_bucket_size": "ZeRO-3 gathers one unit (a block) at a time",
    "zero_optimization.stage3_prefetch_bucket_size": "ZeRO-3 prefetches the next unit",
    "zero_optimization.stage3_max_live_parameters": "ZeRO-3 keeps at most two units gathered",
    "zero_optimization.stage3_max_reuse_distance": (
        "ZeRO-3 gathers again for the backward; parallel.keep_gathered: true keeps the "
        "forward's gathers instead (for the memory of every block's parameters at once)"
    ),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "checkpoints are sharded; `shardax ckpt consolidate` writes the full weights"
    ),
    "zero_optimization.sub_group_size": "the optimizer steps every shard at once",
    "zero_optimization.round_robin_gradients": "not needed without optimizer offload",
    "wall_clock_breakdown": "mapped to monitor.timers",
    "prescale_gradients": "gradients are averaged once, after reduction",
    "gradient_predivide_factor": "gradients are averaged once, after reduction",
}

_DS_HARMLESS = {
    "zero_allow_untested_optimizer": "no effect here: shardax runs any optimizer",
    "flops_profiler": "see shardax.monitor (throughput and MFU)",
    "memory_breakdown": "see shardax.monitor (memory=True)",
    "dump_state": "no engine state to dump",
}

# DeepSpeed features that change what a run trains, which shardax does not do:
# refused by key (unless every ``enabled`` in them is false).
_DS_REFUSED = {
    "compression_training": "DeepSpeed Compression (quantization-aware training, pruning, layer "
    "reduction) changes the model; shardax does not do it",
    "data_efficiency": "DeepSpeed Data Efficiency (curriculum learning, random layerwise token "
    "dropping) changes what each step trains on; shardax does not do it",
    "curriculum_learning": "curriculum learning changes what each step trains on; shardax does "
    "not do it",
    "progressive_layer_drop": "Progressive Layer Dropping skips layers while training; shardax "
    "does not do it",
    "sparse_attention": "DeepSpeed's block-sparse attention replaces the model's attention; "
    "shardax has none",
}


def from_deepspeed(
    ds: Mapping[str, Any], *, lossy: bool = False
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A shardax run config (as file data) from a DeepSpeed config, and every
    DeepSpeed key it did not map, with the reason.

    The conversion never changes what the run computes silently: a key whose
    loss would change the math — an optimizer, scheduler or parameter of
    them that shardax cannot express, a loss-scaling rule it does not have,
    a feature it does not do (``compression_training``, ``data_efficiency``),
    a key it does not know, fp16 and bf16 both enabled — is a
    :class:`ConfigError` naming it, unless ``lossy`` (``--lossy``), which
    drops it and lists it with the others. Keys that only tune DeepSpeed's
    own machinery (buckets, overlap, offload, logging, ``autotuning``) are
    listed, never an error. A value of the wrong type (a template's
    placeholder) is a :class:`ConfigError` naming its key.

    Batch keys (``"auto"`` leaves a size to be computed), ``zero_optimization``
    (stage, reduce bucket size, offload), ``bf16`` / ``fp16`` (loss scale: 0
    is dynamic, ``initial_scale_power``, ``loss_scale_window``,
    ``auto_cast``), ``optimizer`` (DeepSpeed's Adam is AdamW unless
    ``adam_w_mode`` is false; ``bias_correction``), ``scheduler``
    (WarmupLR, WarmupDecayLR, WarmupCosineLR as ``schedule.deepspeed``:
    update by update as DeepSpeed steps them; OneCycle with its decay
    phase), ``gradient_clipping``, ``steps_per_print``,
    ``wall_clock_breakdown``, ``comms_logger`` and the monitors.

    >>> data, unmapped = from_deepspeed({"train_batch_size": 32, "zero_optimization": {"stage": 2},
    ...     "fp16": {"enabled": True, "loss_scale": 0}, "zero_allow_untested_optimizer": True})
    >>> data["batch"], data["parallel"], data["precision"]["params"]
    ({'global': 32}, {'zero': 2}, 'fp16')
    >>> unmapped
    [('zero_allow_untested_optimizer', 'no effect here: shardax runs any optimizer')]
    >>> from_deepspeed({"optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}})
    Traceback (most recent call last):
    ...
    shardax.errors.ConfigError: DeepSpeed config: cannot convert without changing what the run computes: optimizer.type='Adafactor' (shardax has adamw, adam, lion, sgd, adagrad, rmsprop, lamb, onebit_adam, onebit_lamb, zero_one_adam, muon); pass --lossy (lossy=True) to drop them, listed in the output
    """
    return _convert(ds, lossy, lambda key: "")


def _convert(
    ds: Mapping[str, Any], lossy: bool, where: Callable[[str], str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """:func:`from_deepspeed`, a refused key's reason prefixed by ``where(key)``
    (a file's ``"line 7: "``)."""
    out: dict[str, Any] = {}
    unmapped: list[tuple[str, str]] = []
    changes: list[str] = []  # dropped keys that change the math

    def put(section: str, key: str, value: Any) -> None:
        out.setdefault(section, {})[key] = value

    def skip(key: str, why: str, math: bool = True) -> None:
        """Drop ``key``; ``math``: the run would compute something else."""
        unmapped.append((key, why if not math or not lossy else f"{why} [changes the math]"))
        if math:
            changes.append(f"{key} ({where(key)}{why})")

    def harmless(key: str, why: str) -> None:
        skip(key, why, math=False)

    sections = [ds.get(k) for k in ("fp16", "bf16")]  # each checked in its turn below
    if all(isinstance(v, Mapping) and v.get("enabled") is True for v in sections):
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
                put("batch", name, _whole(key, value, auto=True))
        elif key == "zero_optimization":
            _ds_zero(_section(key, value), put, skip)
        elif key in ("bf16", "fp16"):
            _ds_precision(key, _section(key, value), put, skip)
        elif key == "optimizer":
            _ds_optimizer(_section(key, value), put, skip)
        elif key == "scheduler":  # last: its learning rate wins over the optimizer's
            continue
        elif key == "gradient_clipping":
            if value not in (0, 0.0, "auto"):
                put("optimizer", "clip_global_norm", _number(key, value))
        elif key == "steps_per_print":
            put("monitor", "log_every", _whole(key, value))
        elif key == "wall_clock_breakdown":
            if value:
                put("monitor", "timers", True)
        elif key == "comms_logger":
            if isinstance(value, Mapping) and value.get("enabled"):
                put("monitor", "comm", True)
                for k in value:
                    if k != "enabled":
                        harmless(f"comms_logger.{k}", "the comm log records every collective")
        elif key in ("tensorboard", "csv_monitor"):
            _ds_monitor(key, value, out)
        elif key in ("wandb", "comet"):
            harmless(key, f"no {key} writer: use tensorboard, csv or jsonl")
        elif key == "activation_checkpointing":
            harmless(key, "activation checkpointing is not a config setting in shardax yet")
        elif key == "autotuning":
            harmless(key, _autotuning_note(value))
        elif key == "cuda_visible_devices":
            harmless(key, _devices_note(value))
        elif key in _DS_IGNORED:
            harmless(key, _DS_IGNORED[key])
        elif key in _DS_HARMLESS:
            harmless(key, _DS_HARMLESS[key])
        elif _switched_off(value):
            harmless(key, "switched off (every `enabled` in it is false): DeepSpeed does nothing")
        elif key in _DS_REFUSED:
            skip(key, _DS_REFUSED[key])
        else:
            skip(key, "no shardax setting for it")
    if "scheduler" in ds:  # DeepSpeed's schedulers set the lr (WarmupCosineLR scales it)
        _ds_scheduler(_section("scheduler", ds["scheduler"]), ds, put, skip)
    if changes and not lossy:
        raise ConfigError(
            "DeepSpeed config: cannot convert without changing what the run computes: "
            + "; ".join(changes)
            + "; pass --lossy (lossy=True) to drop them, listed in the output"
        )
    return out, unmapped


def _ds_enabled(section: Any, key: str = "") -> bool:
    """Whether a DeepSpeed section is on (``"auto"``: left to the default, off)."""
    if not isinstance(section, Mapping) or section.get("enabled") in (None, "auto"):
        return False
    return _flag(f"{key}.enabled", section["enabled"])


def _switched_off(value: Any) -> bool:
    """A section with ``enabled`` flags (nested too), every one of them false."""
    flags: list[Any] = []

    def walk(v: Any) -> None:
        if isinstance(v, Mapping):
            if "enabled" in v:
                flags.append(v["enabled"])
            for item in v.values():
                walk(item)
        elif isinstance(v, list):
            for item in v:
                walk(item)

    walk(value)
    return bool(flags) and all(flag is False for flag in flags)


# -- sections -------------------------------------------------------------------


def _autotuning_note(value: Any) -> str:
    return (
        "recorded for planning, changes nothing the run computes (DeepSpeed's autotuner picks "
        "micro-batch sizes and ZeRO stages by short trial runs; shardax has none yet): "
        + json.dumps(value, sort_keys=True)
    )


def _devices_note(value: Any) -> str:
    slots = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return (
        "DeepSpeed does not read this key (its launcher sets CUDA_VISIBLE_DEVICES); pick the "
        f"devices when launching: `shardax launch --devices {slots}`"
    )


def _ds_monitor(key: str, value: Any, out: dict[str, Any]) -> None:
    if not (isinstance(value, Mapping) and value.get("enabled")):
        return
    writer = "tensorboard" if key == "tensorboard" else "csv"
    monitor = out.setdefault("monitor", {})
    monitor.setdefault("writers", ["stdout"]).append(writer)
    if value.get("output_path"):
        job = value.get("job_name", "")
        monitor["dir"] = str(Path(value["output_path"]) / job) if job else value["output_path"]


def _ds_zero(zero: Mapping[str, Any], put: Put, skip: Skip) -> None:
    for key, value in zero.items():
        where = f"zero_optimization.{key}"
        if key == "stage":
            put("parallel", "zero", _whole(where, value))
        elif key == "reduce_bucket_size":
            if value != "auto":
                put("parallel", "bucket_bytes", int(_number(where, value)) * 4)  # fp32 elements
        elif key == "mics_shard_size":
            _ds_mics(_whole(where, value), where, put, skip)
        elif key == "zero_quantized_weights":
            if _flag(where, value):
                put("parallel", "quantize_weights", True)
        elif key == "zero_quantized_gradients":
            if _flag(where, value):
                _ds_qgz(zero, where, put)
        elif key == "zero_hpz_partition_size":
            _ds_hpz(_whole(where, value), where, put, skip)
        elif key == "stage3_param_persistence_threshold":
            if zero.get("stage") == 3:
                put("parallel", "persist_below", int(_number(where, value)))
            else:
                skip(where, "only ZeRO-3 splits parameters", False)
        elif key == "mics_hierarchical_params_gather":
            skip(where, "hybrid sharding gathers parameters within a replica only", False)
        elif key in ("offload_optimizer", "offload_param") and isinstance(value, Mapping):
            target = "offload_opt" if key == "offload_optimizer" else "offload_params"
            _ds_offload(value, where, target, put, skip)
        elif key in ("cpu_offload", "cpu_offload_params"):  # the old spellings
            if value is True:
                put("memory", "offload_opt" if key == "cpu_offload" else "offload_params", "host")
        elif where in _DS_IGNORED:
            skip(where, _DS_IGNORED[where], False)
        else:
            skip(where, "no shardax setting for it")
    if zero.get("stage") == 3 and "stage3_param_persistence_threshold" not in zero:
        put("parallel", "persist_below", PERSISTENCE_DEFAULT)  # DeepSpeed's, as it would run


def _ds_offload(value: Mapping[str, Any], where: str, target: str, put: Put, skip: Skip) -> None:
    """``offload_optimizer`` / ``offload_param`` — ``device: cpu | nvme``
    (``nvme_path``) — as ``memory.<target>``: host memory, or files on disk."""
    device = value.get("device", "none")
    if device == "cpu":
        put("memory", target, "host")
    elif device == "nvme":
        path = value.get("nvme_path")
        if not path:
            skip(f"{where}.device", "nvme without nvme_path: no folder for the files", False)
        else:
            put("memory", target, f"disk:{path}")
    for k in value:
        if k not in ("device", "nvme_path"):
            skip(f"{where}.{k}", "shardax streams disk state through its own read-ahead", False)


def _ds_precision(key: str, value: Mapping[str, Any], put: Put, skip: Skip) -> None:
    on = _ds_enabled(value, key)
    if key == "fp16" and "auto_cast" in value and _flag("fp16.auto_cast", value["auto_cast"]):
        # DeepSpeed's engine casts the forward's floating inputs to fp16 whenever auto_cast
        # is set (engine._cast_inputs_half), fp16 on or not
        if on:
            put("precision", "cast_inputs", True)
        else:
            skip("fp16.auto_cast", "DeepSpeed casts the model's floating inputs to fp16 even "
                 "with fp16 off; shardax casts inputs only to half-precision params")  # fmt: skip
    if not on:
        return
    put("precision", "params", key)
    if key == "fp16":  # DeepSpeed's defaults for what the file leaves out
        put("precision", "growth_interval", 1000)
        put("precision", "hysteresis", 2)
        put("precision", "min_loss_scale", 1.0)
    for k, v in value.items():
        where = f"{key}.{k}"
        if k in ("enabled", "auto_cast"):
            continue
        if key == "fp16" and k == "loss_scale":
            if _number(where, v) != 0:
                put("precision", "loss_scale", float(v))
                put("precision", "dynamic", False)
        elif key == "fp16" and k == "initial_scale_power":
            put("precision", "loss_scale", float(2 ** _whole(where, v)))
        elif key == "fp16" and k == "loss_scale_window":
            put("precision", "growth_interval", _whole(where, v))
        elif key == "fp16" and k == "hysteresis":
            put("precision", "hysteresis", _whole(where, v))
        elif key == "fp16" and k == "min_loss_scale":
            put("precision", "min_loss_scale", _number(where, v))
        elif key == "fp16" and k == "consecutive_hysteresis":
            if v:
                skip(where, "the hysteresis is restored when the scale grows, not at every "
                            "finite step")  # fmt: skip
        else:
            skip(where, "no shardax setting for it")


class _Params:
    """A scheduler's ``params``, read key by key (``"auto"``: the default);
    the keys read are remembered, the others are the unmapped ones."""

    def __init__(self, kind: str, params: Mapping[str, Any]) -> None:
        self.kind, self.params, self.used = kind, dict(params), set()

    def take(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.params.get(key, default)
        return default if value == "auto" else value

    def whole(self, key: str, default: Any = None) -> int | None:
        value = self.take(key, default)
        return None if value is None else _whole(f"scheduler.params.{key}", value)

    def total(self) -> int | None:
        """``total_num_steps``: required, as DeepSpeed's constructor requires
        it (``"auto"``: the run's steps, as the Hugging Face Trainer fills it)."""
        if "total_num_steps" not in self.params:
            raise ConfigError(
                f"scheduler.params.total_num_steps is missing: DeepSpeed's {self.kind} needs it "
                '(give the number of updates, or "auto" for the run\'s steps)',
                "scheduler.params",
            )
        return self.whole("total_num_steps")

    def number(self, key: str, default: Any = None) -> float:
        value = self.take(key, default)
        if value is None:
            raise ConfigError(
                f"scheduler.params.{key} is missing: DeepSpeed's {self.kind} needs it",
                "scheduler.params",
            )
        return _number(f"scheduler.params.{key}", value)


def _ds_scheduler(sched: Mapping[str, Any], ds: Mapping[str, Any], put: Put, skip: Skip) -> None:
    kind = sched.get("type")
    p = _Params(str(kind), _section("scheduler.params", sched.get("params", {})))
    if kind in ("WarmupLR", "WarmupDecayLR"):
        put("schedule", "type", "warmup_constant" if kind == "WarmupLR" else "warmup_linear")
        _ds_warmup(p, put, skip)
        low = p.number("warmup_min_lr", 0.0)
        put("schedule", "init_lr", low)
        if p.take("warmup_max_lr") is not None:
            put("optimizer", "lr", p.number("warmup_max_lr"))
        elif kind == "WarmupDecayLR" and "warmup_max_lr" not in p.params:
            put("optimizer", "lr", 0.001)  # WarmupDecayLR's own default, not the optimizer's lr
        # else ("auto", or WarmupLR's default None): DeepSpeed warms up to the optimizer's lr
        if kind == "WarmupDecayLR":
            put("schedule", "total_steps", p.total())
            put("schedule", "end_lr", low)  # DeepSpeed decays back to warmup_min_lr
    elif kind == "WarmupCosineLR":
        lr = (ds.get("optimizer") or {}).get("params", {}).get("lr")
        base = _number("optimizer.params.lr", lr) if lr not in (None, "auto") else 1e-3
        put("schedule", "type", "warmup_cosine")
        _ds_warmup(p, put, skip)
        put("schedule", "total_steps", p.total())
        put("schedule", "init_lr", base * p.number("warmup_min_ratio", 0.0))
        put("schedule", "end_lr", base * p.number("cos_min_ratio", 1e-4))
    elif kind == "OneCycle":
        _ds_one_cycle(p, ds, put, skip)
    else:
        skip(
            f"scheduler.type={kind!r}",
            "shardax maps WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle",
        )
        return
    for k in p.params:
        if k not in p.used:
            skip(f"scheduler.params.{k}", "no shardax setting for it")


def _ds_warmup(p: _Params, put: Put, skip: Skip) -> None:
    """What DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR share: the
    warmup (``warmup_num_steps``, ``warmup_type``), and DeepSpeed's own
    stepping (``schedule.deepspeed``: update ``k`` at the scheduler's
    iteration ``k - 1``, over ``max(2, warmup_num_steps)``)."""
    put("schedule", "deepspeed", True)
    steps = p.whole("warmup_num_steps", 1000)
    if steps < 1:  # DeepSpeed's schedulers raise ValueError
        raise ConfigError(
            f"scheduler.params.warmup_num_steps is a positive integer, as DeepSpeed's {p.kind} "
            f"requires; got {steps}",
            "scheduler.params.warmup_num_steps",
        )
    put("schedule", "warmup_steps", steps)
    warmup = p.take("warmup_type", "log")
    if warmup not in ("log", "linear"):
        put("schedule", "warmup", "log")
        skip(f"scheduler.params.warmup_type={warmup!r}", "DeepSpeed warns and warms up as log "
             "does; so does the converted schedule", False)  # fmt: skip
    else:
        put("schedule", "warmup", warmup)


def _ds_one_cycle(p: _Params, ds: Mapping[str, Any], put: Put, skip: Skip) -> None:
    """DeepSpeed's ``OneCycle`` (``deepspeed/runtime/lr_schedules.py``): the
    learning rate as ``one_cycle_linear`` — its cycle, stairs and decay
    phase; the momentum cycling refused where DeepSpeed would do it."""
    put("schedule", "type", "one_cycle_linear")
    put("schedule", "init_lr", p.number("cycle_min_lr"))
    put("optimizer", "lr", p.number("cycle_max_lr"))
    put("schedule", "up_steps", p.whole("cycle_first_step_size", 2000))
    for ds_key, key in [("cycle_second_step_size", "down_steps"),
                        ("cycle_first_stair_count", "up_stairs"),
                        ("cycle_second_stair_count", "down_stairs"),
                        ("decay_step_size", "decay_steps")]:  # fmt: skip
        value = p.whole(ds_key)
        if value is not None:
            put("schedule", key, value)
    if p.take("decay_lr_rate") is not None:
        put("schedule", "decay_rate", p.number("decay_lr_rate"))
    cycles = _flag("scheduler.params.cycle_momentum", p.take("cycle_momentum", True))
    momentum = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate")
    for k in momentum:
        p.take(k)
    name = _optimizer_name(ds.get("optimizer")) if "optimizer" in ds else "adamw"
    if cycles and name not in ("sgd", "adagrad", "rmsprop"):  # those have no betas to cycle
        name = name or "the optimizer"
        default = "" if "cycle_momentum" in p.params else "on by default: "
        skip(
            "scheduler.params.cycle_momentum",
            f"{default}DeepSpeed's OneCycle cycles {name}'s beta1 from cycle_max_mom down to "
            "cycle_min_mom and back (0.9, 0.8 by default), grows it by decay_mom_rate after "
            "the cycle, and sets beta2 to 0.99; shardax's betas are constants: set "
            "cycle_momentum to false",
        )
        return
    why = ("cycle_momentum is false" if not cycles
           else f"DeepSpeed does not cycle momentum for {name}: it has no betas")  # fmt: skip
    for k in momentum:
        if k in p.params:
            skip(f"scheduler.params.{k}", f"not used: {why}", False)


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
