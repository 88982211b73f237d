"""Importing a DeepSpeed checkpoint as a shardax training state.

:func:`import_deepspeed` reads a DeepSpeed ZeRO checkpoint
(:func:`read_deepspeed`) and writes a shardax checkpoint of the tree a
training loop resumes from — ``{"params", "opt_state", "step"}``, the tree
``examples/train_gpt.py`` saves and ``--resume`` loads — with the optimizer
state in the exact structure of the run's own optimizer
(``RunConfig.make_optimizer()``): :func:`deepspeed_state` builds that
optimizer's ``init`` state and puts DeepSpeed's values into it. What the
tree cannot hold — the loss scaler, the LR scheduler's raw state, the
config — goes into the checkpoint's metadata under ``"deepspeed"``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optree
import torch

from ..errors import CheckpointError, ConfigError, MeshError
from ..mesh._mesh import AbstractMesh
from ..optim._accumulate import MultiStepsState
from ..optim._base import EmptyState
from ..optim._precision import MasterWeightsState
from ..optim._transforms import ScaleByAdamState, ScaleByScheduleState
from ..optim._wrappers import ApplyIfFiniteState, InjectHyperparamsState, MaskedState
from ..shard._matching import Rule, Rules
from ..shard._spec import P
from ._deepspeed_read import DeepSpeedCheckpoint, read_deepspeed
from ._format import TensorEntry, ValueEntry, dtype_name, parse_dtype
from ._offline import BUFFER, Progress, _noop, _Source, _write_sharded, as_rules
from ._save import flatten

__all__ = ["deepspeed_state", "import_deepspeed", "loss_scale_fields"]

DEEPSPEED_KEY = "deepspeed"
"""The metadata key of what an imported checkpoint keeps from DeepSpeed."""


def _counts(count: Any, ds: DeepSpeedCheckpoint) -> Any:
    """Adam's step count: per leaf (a dict by name) or one tensor."""
    if isinstance(count, Mapping):
        return {k: _like(v, ds.steps[k]) if k in ds.steps else v for k, v in count.items()}
    return _like(count, ds.updates)


def _like(init: Any, value: Any) -> torch.Tensor:
    return torch.as_tensor(value, dtype=init.dtype).reshape(init.shape).clone()


def _values(tree: Any, source: Mapping[str, torch.Tensor], path: str) -> Any:
    """``tree`` (a dict by parameter name, as ``init`` made it) with the
    names ``source`` has replaced by its values, in the tree's dtypes."""
    if not isinstance(tree, Mapping):
        raise CheckpointError(
            f"{path} is a {type(tree).__name__}; the import fills optimizer state kept by "
            "parameter name (a dict, as init(params) makes for a dict of params)"
        )
    out = {}
    for name, init in tree.items():
        if name not in source:
            out[name] = init  # a buffer or a frozen parameter: DeepSpeed has no state for it
            continue
        value = source[name]
        if tuple(value.shape) != tuple(init.shape):
            raise CheckpointError(
                f"{path}.{name}: DeepSpeed's tensor has shape {tuple(value.shape)}, the "
                f"optimizer's {tuple(init.shape)}; is the optimizer made for these parameters?"
            )
        out[name] = value.detach().to(init.dtype, copy=True)
    return out


def _has_tensors(node: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in optree.tree_leaves(node))


class _Filler:
    """Walks an optimizer state as ``init`` made it and puts DeepSpeed's
    values in: Adam's moments and counts, the master weights, the schedule
    and accumulation counts; records what it filled."""

    def __init__(self, ds: DeepSpeedCheckpoint) -> None:
        self.ds = ds
        self.moments = 0

    def __call__(self, node: Any, path: str) -> Any:
        ds = self.ds
        if isinstance(node, ScaleByAdamState):
            missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in ds.state]
            if missing:
                raise CheckpointError(
                    f"{path} is Adam's state, but DeepSpeed's optimizer kept "
                    f"{sorted(ds.state) or 'no state'}, not {', '.join(missing)}: the run used "
                    "another optimizer; make the optimizer it used"
                )
            self.moments += 1
            return node._replace(
                count=_counts(node.count, ds),
                mu=_values(node.mu, ds.exp_avg, f"{path}.mu"),
                nu=_values(node.nu, ds.exp_avg_sq, f"{path}.nu"),
            )
        if isinstance(node, MasterWeightsState):
            master = _values(node.master, ds.params, f"{path}.master")
            return node._replace(
                master=master, inner_state=self(node.inner_state, f"{path}.inner_state")
            )
        if isinstance(node, ScaleByScheduleState):
            return node._replace(count=_like(node.count, ds.schedule_step))
        if isinstance(node, InjectHyperparamsState):
            inner = self(node.inner_state, f"{path}.inner_state")
            return node._replace(count=_like(node.count, ds.schedule_step), inner_state=inner)
        if isinstance(node, MultiStepsState):  # saved at an update: no micro-step pending
            inner = self(node.inner_state, f"{path}.inner_state")
            return node._replace(gradient_step=_like(node.gradient_step, ds.updates),
                                 inner_state=inner)  # fmt: skip
        if isinstance(node, (MaskedState, ApplyIfFiniteState)):
            return node._replace(inner_state=self(node.inner_state, f"{path}.inner_state"))
        if isinstance(node, EmptyState) or node is None or not _has_tensors(node):
            return node
        if type(node) in (tuple, list):
            return type(node)(self(x, f"{path}.{i}") for i, x in enumerate(node))
        raise CheckpointError(
            f"{path} is a {type(node).__name__}, which the DeepSpeed import does not know how to "
            "fill (it fills Adam's moments and counts, master weights, schedule and accumulation "
            "counts); build the state yourself from sx.ckpt.read_deepspeed(...): its .params, "
            f".state ({', '.join(sorted(ds.state)) or 'empty'}) and .steps — see docs/migrating.md"
        )


def deepspeed_state(
    ds: DeepSpeedCheckpoint,
    optimizer: Any,
    *,
    param_dtype: torch.dtype | str | None = None,
) -> dict[str, Any]:
    """The training state ``{"params", "opt_state", "step"}`` a DeepSpeed
    checkpoint continues as, for ``optimizer`` (a
    :class:`~shardax.optim.GradientTransformation`).

    ``params``: the model's parameters by name in ``param_dtype`` (default:
    the run's own dtype, ``ds.dtype``), from DeepSpeed's fp32 masters, and
    its buffers. ``opt_state``: ``optimizer.init(params)`` with DeepSpeed's
    values put in — Adam's ``exp_avg``/``exp_avg_sq`` as ``mu``/``nu`` and
    its per-parameter ``step`` as ``count``, the fp32 masters in
    ``with_master_weights``' state, the LR schedule's position in
    ``scale_by_schedule``'s count, the updates done in ``MultiSteps``'
    (saved at an update, so no micro-step is pending). ``step``: DeepSpeed's
    ``global_steps``. A state it does not know (another optimizer's) is a
    :class:`CheckpointError` naming it: map ``ds.params``, ``ds.state`` and
    ``ds.steps`` into your optimizer's state yourself (docs/migrating.md).

    >>> import torch, shardax as sx
    >>> from shardax.ckpt import DeepSpeedCheckpoint
    >>> w = torch.ones(2, 3)
    >>> ds = DeepSpeedCheckpoint(  # what read_deepspeed gives for a one-parameter model
    ...     path=None, zero_stage=2, world_size=2, dtype=torch.bfloat16, params={"w": w},
    ...     buffers={}, state={"exp_avg": {"w": w * 0.1}, "exp_avg_sq": {"w": w * 0.01}},
    ...     steps={"w": 7}, global_steps=7, skipped_steps=0, lr_scheduler=None,
    ...     loss_scaler={"cur_scale": 1.0}, param_groups=[], shared={}, frozen=(),
    ...     ds_config=None, ds_version=None)
    >>> opt = sx.optim.with_master_weights(sx.optim.adamw(1e-3))
    >>> state = sx.ckpt.deepspeed_state(ds, opt)
    >>> state["params"]["w"].dtype, state["step"]
    (torch.bfloat16, 7)
    >>> adam = state["opt_state"].inner_state[0]
    >>> int(adam.count["w"]), float(adam.mu["w"][0, 0]), state["opt_state"].master["w"].dtype
    (7, 0.10000000149011612, torch.float32)
    """
    dtype = parse_dtype(param_dtype) if isinstance(param_dtype, str) else param_dtype
    dtype = dtype or ds.dtype
    params = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ds.params.items()}
    params.update((k, v.clone()) for k, v in ds.buffers.items())
    filler = _Filler(ds)
    opt_state = filler(optimizer.init(params), "opt_state")
    if ds.exp_avg and not filler.moments:
        raise CheckpointError(
            "the optimizer's state holds no Adam moments (ScaleByAdamState) to take DeepSpeed's "
            "exp_avg and exp_avg_sq: make the optimizer the DeepSpeed run used (adam, adamw, "
            "lamb), or map ds.state into yours yourself (docs/migrating.md)"
        )
    return {"params": params, "opt_state": opt_state, "step": ds.global_steps}


def loss_scale_fields(ds: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's dynamic loss scaler as the fields of a
    :class:`~shardax.optim.DynamicLossScale` that goes on as it would:
    ``DynamicLossScale(**fields)``; None for a static scale.

    DeepSpeed grows the scale at a step whose count since the last
    overflow, less one, is a positive multiple of ``scale_window``;
    ``growth_tracker`` is set so that the next growth falls on the same step
    (right after an overflow DeepSpeed waits one step longer than a
    ``DynamicLossScale`` can: there it grows one step sooner).

    >>> from shardax.ckpt._deepspeed import loss_scale_fields
    >>> class Ds: skipped_steps = 1; loss_scaler = {"cur_scale": 1024.0, "dynamic": True,
    ...     "cur_iter": 12, "last_overflow_iter": 4, "scale_factor": 2.0, "scale_window": 4,
    ...     "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 1}
    >>> loss_scale_fields(Ds())["growth_tracker"]   # DeepSpeed grows at iteration 13, 2 steps on
    2
    """
    s = ds.loss_scaler
    if not s.get("dynamic"):
        return None
    window = int(s.get("scale_window", 1000))
    since = int(s.get("cur_iter", 0)) - int(s.get("last_overflow_iter", -1)) - 1
    ahead = (-since) % window or (window if since <= 0 else 0)  # steps before the growing one
    return {
        "scale": float(s["cur_scale"]),
        "growth_interval": window,
        "growth_factor": float(s.get("scale_factor", 2.0)),
        "backoff_factor": 1.0 / float(s.get("scale_factor", 2.0)),
        "growth_tracker": max(window - ahead - 1, 0),
        "skipped": ds.skipped_steps,
        "hysteresis": int(s.get("delayed_shift", 1)),
        "min_scale": min(float(s.get("min_scale", 0.0)), float(s["cur_scale"])),
        "hysteresis_left": int(s.get("cur_hysteresis", s.get("delayed_shift", 1))),
    }


def _json(x: Any) -> Any:
    """``x`` with what JSON cannot hold (tensors, dtypes, enums) as text."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (int, float)):
        return x if x == x and abs(x) != float("inf") else str(x)
    if isinstance(x, Mapping):
        return {str(k): _json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json(v) for v in x]
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return _json(x.item())
    return repr(x)


def metadata_of(ds: DeepSpeedCheckpoint) -> dict[str, Any]:
    """What an imported checkpoint records of its DeepSpeed source."""
    groups = [{k: v for k, v in g.items() if k != "names"} for g in ds.param_groups]
    return _json({
        "source": str(ds.path.absolute()) if ds.path else None,
        "zero_stage": ds.zero_stage, "world_size": ds.world_size, "dtype": dtype_name(ds.dtype),
        "ds_version": ds.ds_version, "global_steps": ds.global_steps,
        "skipped_steps": ds.skipped_steps, "updates": ds.updates,
        "schedule_step": ds.schedule_step, "lr_scheduler": ds.lr_scheduler,
        "loss_scaler": ds.loss_scaler, "loss_scale": loss_scale_fields(ds),
        "param_groups": groups, "shared": ds.shared, "frozen": list(ds.frozen),
        "ds_config": ds.ds_config,
    })  # fmt: skip


def _tree_source(tree: Any, metadata: dict[str, Any]) -> _Source:
    """The offline writer's source for an in-memory tree."""
    entries: dict[str, Any] = {}
    keys: dict[str, tuple[Any, ...]] = {}
    tensors: dict[str, torch.Tensor] = {}
    paths, leaf_keys, leaves = flatten(tree)
    for path, k, x in zip(paths, leaf_keys, leaves, strict=True):
        keys[path] = k
        if isinstance(x, torch.Tensor):
            entries[path] = TensorEntry(tuple(x.shape), dtype_name(x.dtype), P(), {}, [])
            tensors[path] = x.detach().contiguous()
        else:
            entries[path] = ValueEntry(x)

    def copy(path: str, offsets: Sequence[int], out: torch.Tensor) -> None:
        t = tensors[path]
        for d, (o, n) in enumerate(zip(offsets, out.shape, strict=True)):
            t = t.narrow(d, o, n)
        out.copy_(t)

    return _Source(entries, keys, copy, metadata, lambda: None)


def _mesh_for(config: Any, mesh: Any, ds: DeepSpeedCheckpoint) -> AbstractMesh:
    if mesh is not None:
        return mesh if isinstance(mesh, AbstractMesh) else AbstractMesh(dict(mesh))
    if config is None:
        return AbstractMesh({"dp": ds.world_size})
    try:
        return config.abstract_mesh(ds.world_size)
    except (ConfigError, MeshError) as e:
        raise CheckpointError(
            f"the run config's mesh does not fit the {ds.world_size} ranks that wrote the "
            f"DeepSpeed checkpoint ({e}); give the mesh to write for (mesh=, --mesh)"
        ) from None


def import_deepspeed(
    src: str | os.PathLike[str] | DeepSpeedCheckpoint,
    dst: str | os.PathLike[str],
    *,
    config: Any = None,
    optimizer: Any = None,
    param_dtype: torch.dtype | str | None = None,
    mesh: AbstractMesh | Mapping[str, int] | None = None,
    rules: Rules | Rule | Sequence[Rule] | Mapping[str, Any] | None = None,
    buffer_bytes: int = BUFFER,
    progress: Progress | None = None,
) -> Path:
    """Turn the DeepSpeed ZeRO checkpoint ``src`` (a tag directory or its
    parent holding ``latest``) into a shardax checkpoint ``dst`` to continue
    training from, on any mesh (``src`` may also be what
    :func:`read_deepspeed` returned): ``{"params", "opt_state", "step"}`` as
    :func:`deepspeed_state` builds it, with DeepSpeed's loss scaler, LR
    scheduler and config in the metadata under ``"deepspeed"``
    (``metadata["deepspeed"]["loss_scale"]``: the fields of a
    ``DynamicLossScale`` going on as DeepSpeed's would). Offline, no
    process group; DeepSpeed need not be installed, and nothing in its
    pickles runs.

    ``config`` (a :class:`shardax.config.RunConfig`) makes what a run of it
    resumes with: ``config.make_optimizer(accumulation)`` (the accumulation
    its batch sizes give on ``mesh``), the precision of its params
    (``precision.params``), its rules and mesh (the mesh at the DeepSpeed
    run's number of ranks), so ``examples/train_gpt.py --config FILE
    --resume dst`` loads it as it loads its own checkpoints. Or give the
    ``optimizer`` your loop makes (and ``param_dtype``, ``mesh``,
    ``rules``); they win over the config's. The layout written only decides
    how the files are split: loading reshards to any mesh.

    >>> import tempfile, shardax as sx
    >>> sx.ckpt.import_deepspeed(tempfile.mkdtemp(), tempfile.mkdtemp() + "/c",
    ...                          optimizer=sx.optim.adamw(1e-3))
    Traceback (most recent call last):
    ...
    shardax.errors.CheckpointError: ... is not a DeepSpeed checkpoint: ...
    """
    ds = src if isinstance(src, DeepSpeedCheckpoint) else read_deepspeed(src)
    target = _mesh_for(config, mesh, ds)
    if optimizer is None:
        if config is None:
            raise CheckpointError(
                "import_deepspeed needs the optimizer the run continues with: config= (a "
                "RunConfig, e.g. sx.config.load_config('run.hjson'), or the checkpoint's own "
                "DeepSpeed config converted: sx.config.RunConfig.from_dict("
                "sx.config.from_deepspeed(sx.ckpt.read_deepspeed(src).ds_config)[0])) or "
                "optimizer= (a GradientTransformation)"
            )
        try:
            batch = config.batch.resolve(config.dp_size(target.world_size))
        except ConfigError as e:
            raise CheckpointError(f"the run config on {target!r}: {e}") from None
        optimizer = config.make_optimizer(batch.accumulation, clip=config.parallel.pp is None)
    if param_dtype is None and config is not None:
        param_dtype = config.precision.params
    if rules is None:
        rules = config.make_rules() if config is not None else Rules()
    state = deepspeed_state(ds, optimizer, param_dtype=param_dtype)
    source = _tree_source(state, {DEEPSPEED_KEY: metadata_of(ds)})
    return _write_sharded(
        source,
        Path(dst).absolute(),
        as_rules(rules),
        target,
        dtype=None,
        rng={},
        rng_files=None,
        buffer_bytes=buffer_bytes,
        progress=progress or _noop,
    )
