"""DeepSpeed's universal checkpoints (``ds_to_universal.py``'s output): one
folder per parameter under ``zero/`` holding its whole fp32 master
(``fp32.pt``) and optimizer state (``exp_avg.pt``, ``exp_avg_sq.pt``,
``step.pt``), the common optimizer state (``zero/optimizer_state.pt``: the
loss scaler, the hyperparameters) and the model-state files copied from the
source. From ZeRO-1/2 each file holds ``{"param": tensor, ...}`` in the
parameter's shape; from ZeRO-3 a flat tensor and no ``step.pt`` (the step is
in ``optimizer_state.pt``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ._deepspeed_pickle import load_pickle, scaler_fields

__all__ = ["is_universal", "read_universal"]

_STATES = ("exp_avg", "exp_avg_sq")


def is_universal(path: Path) -> bool:
    """Whether ``path`` is a universal checkpoint's folder."""
    return (path / "zero" / "optimizer_state.pt").is_file()


def _tensor(path: Path) -> torch.Tensor:
    value = load_pickle(path)
    if isinstance(value, Mapping):
        value = value.get("param")
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path} holds no tensor (a universal checkpoint's `param`)")
    return value.detach()


def _model_states(tag: Path) -> tuple[Mapping[str, Any], list[Mapping[str, Any]]]:
    files = sorted(tag.glob("*model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{tag} has zero/optimizer_state.pt but no *model_states.pt: an incomplete universal "
            "checkpoint (ds_to_universal.py copies the model states beside zero/)"
        )
    other_mp = [f.name for f in files if "mp_rank_00_" not in f.name]
    if other_mp:
        raise CheckpointError(
            f"{tag} holds {', '.join(other_mp)}: model states of other model-parallel ranks; "
            "the import reads data-parallel universal checkpoints"
        )
    models = [load_pickle(f) for f in files]
    return models[0], models


def _shaped(t: torch.Tensor, shape: Any, where: Path) -> torch.Tensor:
    n = math.prod(shape)
    if t.numel() < n:
        raise CheckpointError(f"{where} holds {t.numel()} elements; {tuple(shape)} needs {n}")
    return t.reshape(-1)[:n].float().view(tuple(shape)).clone() if t.shape != shape else t.float()


def read_universal(tag: Path) -> dict[str, Any]:
    """The fields of a ``DeepSpeedCheckpoint`` read from the universal
    checkpoint in ``tag``."""
    model, _ = _model_states(tag)
    common = load_pickle(tag / "zero" / "optimizer_state.pt")
    if not isinstance(common, Mapping):
        raise CheckpointError(f"{tag / 'zero' / 'optimizer_state.pt'} holds no optimizer state")
    stage = int(common.get("zero_stage", 1))
    count = common.get("partition_count", 1)
    world = max(count) if isinstance(count, (list, tuple)) else int(count)
    shapes = {k: v for group in model.get("param_shapes") or [] for k, v in group.items()}
    if not shapes:
        raise CheckpointError(f"{tag}: the model states list no param_shapes")
    inner = common.get("optimizer_state_dict") or {}  # from ZeRO-3: rank 0's whole state
    zero3_step = next((s["step"] for s in (inner.get("state") or {}).values() if "step" in s), None)
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, int] = {}
    for name, shape in shapes.items():
        folder = tag / "zero" / name
        if not (folder / "fp32.pt").is_file():
            raise CheckpointError(f"{tag} is missing zero/{name}/fp32.pt (the parameter {name!r})")
        params[name] = _shaped(_tensor(folder / "fp32.pt"), shape, folder / "fp32.pt")
        for key in _STATES:
            if (folder / f"{key}.pt").is_file():
                moment = _tensor(folder / f"{key}.pt")
                state.setdefault(key, {})[name] = _shaped(moment, shape, folder / f"{key}.pt")
        step = load_pickle(folder / "step.pt") if (folder / "step.pt").is_file() else zero3_step
        if step is not None:
            steps[name] = int(step.item() if isinstance(step, torch.Tensor) else step)
    buffers = {}
    for name in model.get("buffer_names") or ():
        buffers[name] = (model.get("module") or {}).get(name)
        if (tag / "zero" / name / "fp32.pt").is_file():
            buffers[name] = _tensor(tag / "zero" / name / "fp32.pt")
    raw_groups = common.get("param_groups") or inner.get("param_groups") or []
    by_group = [list(g) for g in model.get("param_shapes") or []]
    if len(by_group) != len(raw_groups):  # ZeRO-3's sub-groups: one group in the usual case
        by_group = [list(shapes)] + [[] for _ in raw_groups[1:]]
    dtype = next(
        (v.dtype for k, v in (model.get("module") or {}).items() if k in shapes), torch.float32
    )
    return {
        "path": tag,
        "zero_stage": stage,
        "world_size": world,
        "dtype": dtype,
        "params": params,
        "buffers": {k: v for k, v in buffers.items() if isinstance(v, torch.Tensor)},
        "state": state,
        "steps": steps,
        "global_steps": int(model.get("global_steps") or 0),
        "skipped_steps": int(model.get("skipped_steps") or 0),
        "lr_scheduler": model.get("lr_scheduler"),
        "loss_scaler": scaler_fields(common.get("loss_scaler")),
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "names": names}
            for g, names in zip(raw_groups, by_group, strict=True)
        ],
        "shared": dict(model.get("shared_params") or {}),
        "frozen": (),
        "ds_config": model.get("ds_config"),
        "ds_version": model.get("ds_version"),
    }
