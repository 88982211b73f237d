"""Importing DeepSpeed configs: ``from_deepspeed`` maps a DeepSpeed JSON
config onto run-config data (refusing what would change the math unless
lossy), ``to_hjson`` writes it with the unmapped keys as comments."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._fields import OPTIMIZERS

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


def _ds_offload(
    value: Mapping[str, Any],
    where: str,
    target: str,
    put: Callable[..., None],
    skip: Callable[..., None],
) -> None:
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
