"""``shardax ckpt import --from-deepspeed``: the command's work, apart from
its click options (``_cli.py``).

The run config the state is shaped for is read by the ``shardax`` command
itself (``config`` is a layer above ``ckpt``): it hands its subcommands a
reader under ``ctx.meta[RUN_CONFIG]`` — ``reader(path)`` reads an hjson
file, ``reader(dict)`` converts a DeepSpeed config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, ConfigError
from ..mesh._mesh import AbstractMesh
from ..shard._matching import Rules
from ._deepspeed import DEEPSPEED_KEY, import_deepspeed
from ._deepspeed_read import DeepSpeedCheckpoint, read_deepspeed
from ._format import dtype_name, read_index

__all__ = ["RUN_CONFIG", "differences", "import_deepspeed_command"]

RUN_CONFIG = "shardax.run_config"
"""The click ``ctx.meta`` key of the ``shardax`` command's run-config reader."""

_HOW = (
    "convert it with `shardax config from-deepspeed ds_config.json -o run.hjson` (--lossy to "
    "drop what it names) and pass --config run.hjson"
)


def _run_config(reader: Callable[[Any], Any] | None, config: str | None, ds: Any) -> Any:
    if reader is None:
        raise CheckpointError(
            "--from-deepspeed reads its run config through the shardax command: run it as "
            "`shardax ckpt import --from-deepspeed ...`"
        )
    if config is not None:
        return reader(config)
    if not isinstance(ds.ds_config, dict):
        raise CheckpointError(
            f"{ds.path} records no DeepSpeed config to convert (its ds_config is "
            f"{type(ds.ds_config).__name__}): {_HOW}"
        )
    try:
        return reader(dict(ds.ds_config))
    except ConfigError as e:
        raise CheckpointError(
            f"the DeepSpeed config {ds.path} recorded does not convert as it is ({e}): {_HOW}"
        ) from None


def differences(ds: DeepSpeedCheckpoint, run: Any) -> list[str]:
    """Where the run config's optimizer differs from the one DeepSpeed ran
    (betas, eps, weight decay; per parameter group): the state is imported
    all the same — a run may change them on purpose — but the curve will
    not continue DeepSpeed's.

    >>> from types import SimpleNamespace as NS
    >>> ds = NS(param_groups=[{"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
    ...                        "names": ["w"]}])
    >>> run = NS(optimizer=NS(type="adamw", betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1))
    >>> differences(ds, run)
    ['betas: DeepSpeed ran (0.9, 0.95) (1 params), the run config says (0.9, 0.999)']
    """
    o = run.optimizer
    if o.type not in ("adam", "adamw", "lamb"):
        return []
    ours = {"betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    out = []
    for key, value in ours.items():
        theirs = [(g.get(key), len(g.get("names", []))) for g in ds.param_groups if key in g]
        for v, n in theirs:
            v = tuple(v) if isinstance(v, (list, tuple)) else v
            if v != value:
                out.append(f"{key}: DeepSpeed ran {v} ({n} params), the run config says {value}")
    return out


def import_deepspeed_command(
    reader: Callable[[Any], Any] | None,
    src: str,
    dst: str,
    config: str | None,
    mesh: AbstractMesh | None,
    rules: Rules | None,
    buffer_bytes: int,
) -> list[str]:
    """Import ``src`` into ``dst`` for the run config ``config`` (default:
    the checkpoint's own DeepSpeed config, converted); the lines to print."""
    ds = read_deepspeed(src)
    run = _run_config(reader, config, ds)
    out = import_deepspeed(ds, dst, config=run, mesh=mesh, rules=rules, buffer_bytes=buffer_bytes)
    index = read_index(out)
    lines = [f"note: {d}" for d in differences(ds, run)]
    shape = ", ".join(f"{k}={v}" for k, v in index.mesh.items())
    lines.append(
        f"wrote {out}: DeepSpeed ZeRO-{ds.zero_stage} ({dtype_name(ds.dtype)} on {ds.world_size} "
        f"ranks, step {ds.global_steps}) as {len(index.tensors())} tensors laid out for {shape}; "
        f"resume it with the run config {config or '(the converted DeepSpeed config)'}"
    )
    scale = index.metadata[DEEPSPEED_KEY].get("loss_scale")
    if scale:
        lines.append(
            f"fp16 loss scale {scale['scale']:g}: sx.optim.DynamicLossScale(**sx.ckpt.read_index("
            f"path).metadata['{DEEPSPEED_KEY}']['loss_scale']) goes on as DeepSpeed's would"
        )
    return lines
