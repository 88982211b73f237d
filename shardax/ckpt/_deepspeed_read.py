"""Reading a DeepSpeed ZeRO checkpoint back into the model's own tensors.

DeepSpeed (`deepspeed/runtime/engine.py`'s ``save_checkpoint``) writes a tag
directory (``global_step100``) beside a ``latest`` file naming it:

- ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or one
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (ZeRO-3): the
  module's state dict (under ZeRO-3 empty placeholders), ``param_shapes``
  (the order the flat partitions hold the parameters in), buffers, tied
  names, frozen parameters, the LR scheduler, step counts and the config;
- ``[bf16_|fp16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, one per
  data-parallel rank: that rank's flat fp32 partition of the master weights
  and its optimizer's state over it (``exp_avg``, ``exp_avg_sq``, ``step``),
  and the loss scaler.

ZeRO-1/2 (and ``BF16_Optimizer``) split each parameter group's flat vector
(parameters end to end, with alignment padding) into equal pieces, one per
rank; ZeRO-3 splits every parameter into ``ceil(numel / ranks)`` pieces,
each rank's pieces end to end. The same layouts hold the optimizer's state.
:func:`read_deepspeed` undoes them, by parameter name.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..errors import CheckpointError
from ._deepspeed_pickle import load_pickle, scaler_fields
from ._deepspeed_universal import is_universal, read_universal

__all__ = ["DeepSpeedCheckpoint", "locate", "read_deepspeed"]

_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_EXPERTS = re.compile(r"^(?:expp_rank_\d+_|layer_\d+_expert_\d+_).*\.pt$")


@attrs.frozen(repr=False)
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint by parameter name, as
    :func:`read_deepspeed` reads it.

    Attributes:
        path: the tag directory read (``.../global_step100``).
        zero_stage: 1, 2 or 3 (``BF16_Optimizer``'s checkpoints: 1).
        world_size: the data-parallel ranks that wrote it.
        dtype: the model's parameter dtype in the run (fp32, bf16, fp16).
        params: the fp32 master weights, by the model's names and shapes (a
            tied parameter once, under its first name; frozen parameters,
            which have no master, as the module held them).
        buffers: the module's persistent buffers.
        state: the optimizer's state by its own key (``exp_avg``,
            ``exp_avg_sq``, …), each by parameter name in the parameter's
            shape, fp32; frozen parameters have none.
        steps: the optimizer's step count (torch's ``step``) by parameter.
        global_steps: DeepSpeed's step counter (skipped fp16 steps included).
        skipped_steps: the steps DeepSpeed skipped for an fp16 overflow.
        lr_scheduler: the LR scheduler's state dict (None without one).
        loss_scaler: the loss scaler's fields (``cur_scale``, and for
            dynamic scaling ``cur_iter``, ``last_overflow_iter``, …).
        param_groups: the optimizer's hyperparameters per group, each with
            ``names``: its parameters.
        shared: tied names: the name DeepSpeed did not store → the one it did.
        frozen: the parameters without optimizer state.
        ds_config: the DeepSpeed config the run used (as saved).
        ds_version: the DeepSpeed version that wrote it.
    """

    path: Path
    zero_stage: int
    world_size: int
    dtype: torch.dtype
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]]
    steps: dict[str, int]
    global_steps: int
    skipped_steps: int
    lr_scheduler: dict[str, Any] | None
    loss_scaler: dict[str, Any]
    param_groups: list[dict[str, Any]]
    shared: dict[str, str]
    frozen: tuple[str, ...]
    ds_config: Any
    ds_version: str | None

    @property
    def exp_avg(self) -> dict[str, torch.Tensor]:
        """Adam's first moment by parameter name (empty for other optimizers)."""
        return self.state.get("exp_avg", {})

    @property
    def exp_avg_sq(self) -> dict[str, torch.Tensor]:
        """Adam's second moment by parameter name."""
        return self.state.get("exp_avg_sq", {})

    @property
    def updates(self) -> int:
        """The optimizer updates applied: torch's ``step`` (the largest of
        the groups'), else DeepSpeed's steps less the skipped ones."""
        if self.steps:
            return max(self.steps.values())
        return self.global_steps - self.skipped_steps

    @property
    def schedule_step(self) -> int:
        """The LR schedule's position, counted as shardax counts it (updates
        applied): DeepSpeed's schedulers' ``last_batch_iteration + 1``, a
        torch scheduler's ``last_epoch``; without one, :attr:`updates`."""
        s = self.lr_scheduler or {}
        if isinstance(s.get("last_batch_iteration"), int):
            return s["last_batch_iteration"] + 1
        if isinstance(s.get("last_epoch"), int):
            return s["last_epoch"]
        return self.updates

    def __repr__(self) -> str:
        return (
            f"DeepSpeedCheckpoint('{self.path}', zero_stage={self.zero_stage}, "
            f"world_size={self.world_size}, dtype={self.dtype}, params={len(self.params)}, "
            f"state={sorted(self.state)}, global_steps={self.global_steps})"
        )


def locate(path: str | os.PathLike[str]) -> Path:
    """The tag directory of the DeepSpeed checkpoint at ``path``: ``path``
    itself, or the tag its ``latest`` (``latest_universal``) file names."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; pass a DeepSpeed checkpoint's tag directory "
            "(global_step100/) or its parent holding the `latest` file"
        )
    if _has_model_states(root) or is_universal(root):
        return root
    for name in ("latest", "latest_universal"):
        if (root / name).is_file():
            tag = (root / name).read_text().strip()
            if not tag or not (root / tag).is_dir():
                raise CheckpointError(
                    f"{root / name} names the tag {tag!r}, but {root / tag} is not a directory: "
                    "the checkpoint was not saved whole (or moved); pass a tag directory"
                )
            return root / tag
    if (root / "index.json").is_file():
        raise CheckpointError(
            f"{path} is a shardax checkpoint, not a DeepSpeed one: load it with sx.ckpt.load"
        )
    tags = sorted(p.name for p in root.iterdir() if p.is_dir() and _has_model_states(p))
    if tags:
        raise CheckpointError(
            f"{path} has no `latest` file saying which checkpoint to read; pass one of its tag "
            f"directories: {', '.join(tags)}"
        )
    raise CheckpointError(
        f"{path} is not a DeepSpeed checkpoint: it has no mp_rank_00_model_states.pt (ZeRO-1/2), "
        "zero_pp_rank_0_mp_rank_00_model_states.pt (ZeRO-3) or `latest` file; pass the "
        "directory engine.save_checkpoint wrote (or its tag directory, global_step100/)"
    )


def _has_model_states(path: Path) -> bool:
    return any(path.glob("*model_states.pt"))


def _files(tag: Path) -> tuple[dict[int, Path], dict[int, Path], str]:
    """The model-state files (by ZeRO-3 rank; ``{0: ...}`` for ZeRO-1/2),
    the optimizer files by rank, and their prefix; refusing what is not a
    plain data-parallel ZeRO checkpoint, by name."""
    model: dict[int, Path] = {}
    optim: dict[int, Path] = {}
    prefixes = set()
    for p in sorted(tag.iterdir()):
        name = p.name
        if _PIPELINE.match(name):
            raise CheckpointError(
                f"{tag} holds {name}: a pipeline-parallel checkpoint, which the import does not "
                "read; convert it with DeepSpeed's ds_to_universal.py and import the universal "
                "checkpoint, or save without pipeline parallelism"
            )
        if _EXPERTS.match(name):
            raise CheckpointError(
                f"{tag} holds {name}: a mixture-of-experts checkpoint (experts split over "
                "ranks), which the import does not read; convert it with ds_to_universal.py"
            )
        if m := _MODEL.match(name):
            mp = int(m.group(2))
            if mp != 0:
                raise CheckpointError(
                    f"{tag} holds {name}: a tensor-parallel checkpoint (model-parallel rank "
                    f"{mp}), which the import does not read; convert it with "
                    "ds_to_universal.py (it merges the tensor-parallel pieces)"
                )
            model[int(m.group(1) or 0)] = p
        elif m := _OPTIM.match(name):
            if int(m.group(3)) != 0:
                raise CheckpointError(
                    f"{tag} holds {name}: a tensor-parallel checkpoint (model-parallel rank "
                    f"{int(m.group(3))}), which the import does not read; convert it with "
                    "ds_to_universal.py"
                )
            prefixes.add(m.group(1) or "")
            optim[int(m.group(2))] = p
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{tag} mixes optimizer files of different runs: {sorted(p.name for p in optim.values())}"
        )
    if not model:
        raise CheckpointError(f"{tag} has no *model_states.pt file: not a DeepSpeed checkpoint")
    return model, optim, prefixes.pop() if prefixes else ""


def _optim_name(prefix: str, rank: int) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _check_ranks(tag: Path, files: Mapping[int, Path], world: int, what: str, name: Any) -> None:
    missing = [name(r) for r in range(world) if r not in files]
    if missing:
        raise CheckpointError(
            f"{tag} is missing {', '.join(missing)}: the checkpoint says {world} ranks wrote "
            f"{what}, and found {len(files)}; a rank's save failed or the files were not all "
            "copied"
        )
    extra = sorted(files[r].name for r in files if r >= world)
    if extra:
        raise CheckpointError(
            f"{tag} holds {', '.join(extra)} beyond the {world} ranks its files say wrote it: "
            "files of another run with more ranks (keep one checkpoint per directory), or "
            "partitions over groups of ranks (MiCS), which the import does not read"
        )


def _world(opt: Mapping[str, Any], file: Path) -> int:
    count = opt.get("partition_count")
    counts = count if isinstance(count, (list, tuple)) else [count]
    if not counts or not all(isinstance(c, int) and c > 0 for c in counts):
        raise CheckpointError(f"{file}: partition_count is {count!r}; not a ZeRO optimizer file")
    if len(set(counts)) > 1:
        raise CheckpointError(
            f"{file}: its parameter groups are split over different numbers of ranks "
            f"({count}): expert parallelism, which the import does not read"
        )
    return counts[0]


def _moments(base: Any, groups: int, file: Path) -> list[dict[str, Any]]:
    """The base optimizer's state per flat group: ``{key: tensor or step}``."""
    if isinstance(base, list):  # elastic_checkpoint: a lean state per group
        return [dict(g) for g in base]
    if not isinstance(base, Mapping) or "state" not in base:
        raise CheckpointError(f"{file}: no optimizer state (base_optimizer_state) in it")
    order = [i for g in base.get("param_groups", []) for i in g["params"]]
    if len(order) != groups:
        raise CheckpointError(
            f"{file}: the optimizer has {len(order)} flat tensors for {groups} parameter groups"
        )
    return [dict(base["state"].get(i, {})) for i in order]


def _cat(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1).float() for p in pieces])


def _step(value: Any) -> int:
    return int(value.item() if isinstance(value, torch.Tensor) else value)


def _flat_groups(
    shapes: list, opts: list[Mapping[str, Any]], files: list[Path], flat_key: str, state_key: str
) -> tuple[list, list]:
    """Each rank's flat fp32 groups (under ``flat_key``) and its optimizer
    state's moments per group (under ``state_key``), checked against the
    model states' groups of ``param_shapes``."""
    flats = [o[flat_key] for o in opts]
    if any(len(f) != len(shapes) for f in flats):
        raise CheckpointError(
            f"{files[0]}: {len(flats[0])} flat groups for {len(shapes)} groups of param_shapes in "
            "the model states: files of different runs?"
        )
    bases = [_moments(o[state_key], len(shapes), f) for o, f in zip(opts, files, strict=True)]
    return flats, bases


def _zero12(model: Mapping[str, Any], opts: list[Mapping[str, Any]], files: list[Path]) -> Any:
    """ZeRO-1/2: each group's flat vector is its ranks' partitions end to end."""
    shapes = model["param_shapes"]
    first = opts[0]
    flats, bases = _flat_groups(shapes, opts, files, "single_partition_of_fp32_groups",
                           "base_optimizer_state")  # fmt: skip
    paddings = first.get("param_alignment_paddings")
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, int] = {}
    for g, group in enumerate(shapes):
        flat = _cat([f[g] for f in flats])
        tensor_keys = [k for k, v in bases[0][g].items() if isinstance(v, torch.Tensor) and v.ndim]
        moments = {k: _cat([b[g][k] for b in bases]) for k in tensor_keys}
        offset = 0
        for j, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            if offset + n > flat.numel():
                raise CheckpointError(
                    f"{files[0].parent}: the flat partitions of group {g} hold {flat.numel()} "
                    f"elements, fewer than its parameters need ({name} ends at {offset + n}): "
                    "files of different runs?"
                )
            params[name] = flat[offset : offset + n].view(shape).clone()
            for k, m in moments.items():
                state.setdefault(k, {})[name] = m[offset : offset + n].view(shape).clone()
            if "step" in bases[0][g]:
                steps[name] = _step(bases[0][g]["step"])
            offset += n + (paddings[g][j] if paddings else 0)
    return params, state, steps


def _zero3(model: Mapping[str, Any], opts: list[Mapping[str, Any]], files: list[Path]) -> Any:
    """ZeRO-3: in each sub-group, each parameter is ``ceil(numel / ranks)``
    elements of every rank's flat vector, at the same offset on each."""
    world = len(opts)
    shapes = model["param_shapes"]  # one ordered dict per sub-group
    flats, bases = _flat_groups(shapes, opts, files, "fp32_flat_groups", "optimizer_state_dict")
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, int] = {}
    for g, group in enumerate(shapes):
        flat = [f[g].reshape(-1).float() for f in flats]
        tensor_keys = [k for k, v in bases[0][g].items() if isinstance(v, torch.Tensor) and v.ndim]
        moments = {k: [b[g][k].reshape(-1).float() for b in bases] for k in tensor_keys}
        offset = 0
        for name, shape in group.items():
            n = math.prod(shape)
            part = math.ceil(n / world)
            if offset + part > flat[0].numel():
                raise CheckpointError(
                    f"{files[0].parent}: flat group {g} holds {flat[0].numel()} elements per "
                    f"rank, fewer than its parameters need ({name} ends at {offset + part}): "
                    "files of different runs?"
                )
            whole = torch.cat([f[offset : offset + part] for f in flat])
            params[name] = whole[:n].view(shape).clone()
            for k, per_rank in moments.items():
                whole = torch.cat([m[offset : offset + part] for m in per_rank])
                state.setdefault(k, {})[name] = whole[:n].view(shape).clone()
            if "step" in bases[0][g]:
                steps[name] = _step(bases[0][g]["step"])
            offset += part
        if offset != flat[0].numel():
            raise CheckpointError(
                f"{files[0].parent}: the parameters of flat group {g} take {offset} of its "
                f"{flat[0].numel()} elements per rank: param_shapes and the optimizer files "
                "disagree"
            )
    return params, state, steps


def _groups(opt: Mapping[str, Any], shapes: list[Any], stage: int) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters per group, with the names of its
    parameters (those of its flat tensors' ``param_shapes``)."""
    base = opt.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    raw = base.get("param_groups", []) if isinstance(base, Mapping) else []
    order = {i: k for k, i in enumerate(i for g in raw for i in g["params"])}
    out = []
    for group in raw:
        names = [n for i in group["params"] if order[i] < len(shapes) for n in shapes[order[i]]]
        out.append({**{k: v for k, v in group.items() if k != "params"}, "names": names})
    return out


def _frozen(model: Mapping[str, Any], models: list[Mapping[str, Any]], known: set[str]) -> Any:
    """Parameters outside the optimizer: from ``frozen_param_fragments``
    (ZeRO-2/3; ZeRO-3's split over the ranks' files), else the module."""
    out: dict[str, torch.Tensor] = {}
    shapes = model.get("frozen_param_shapes") or {}
    for name, shape in shapes.items():
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        n = math.prod(shape)
        flat = pieces[0] if pieces[0].numel() >= n else torch.cat(pieces)
        out[name] = flat[:n].view(shape).clone()
    skip = known | set(model.get("buffer_names") or ()) | set(model.get("shared_params") or {})
    for name, value in (model.get("module") or {}).items():
        if name not in skip and name not in out and isinstance(value, torch.Tensor):
            if value.numel() == 0:
                raise CheckpointError(
                    f"{name} is in the module but in neither param_shapes nor the frozen "
                    "parameters, and its saved value is an empty ZeRO-3 placeholder"
                )
            out[name] = value.clone()
    return out


def _dtype(model: Mapping[str, Any], names: Sequence[str]) -> torch.dtype:
    module = model.get("module") or {}
    for name in names:
        if isinstance(module.get(name), torch.Tensor):
            return module[name].dtype
    return torch.float32


def read_deepspeed(path: str | os.PathLike[str]) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint at ``path`` — a tag directory or its
    parent holding ``latest`` — into the model's own tensors by name: fp32
    master weights, the optimizer's state (Adam's ``exp_avg`` and
    ``exp_avg_sq``) and step, the loss scaler and LR scheduler, the step
    counts. ZeRO-1, 2 and 3 in fp32, bf16 and fp16, and DeepSpeed's
    universal checkpoints (``ds_to_universal.py``); pipeline- and
    tensor-parallel checkpoints are refused by name (convert those to
    universal first). Every file is read with ``torch.load(weights_only=True)``
    allowing only DeepSpeed's own classes (see
    ``shardax.ckpt._deepspeed_pickle``): nothing in it runs, and DeepSpeed
    need not be installed.

    >>> import tempfile, shardax as sx
    >>> sx.ckpt.read_deepspeed(tempfile.mkdtemp())
    Traceback (most recent call last):
    ...
    shardax.errors.CheckpointError: ... is not a DeepSpeed checkpoint: it has no mp_rank_00_model_states.pt ...
    """
    tag = locate(path)
    if is_universal(tag):
        return DeepSpeedCheckpoint(**read_universal(tag))
    model_files, optim_files, prefix = _files(tag)
    if 0 not in model_files:
        raise CheckpointError(f"{tag} is missing {_model_name(0, len(model_files) > 1)}")
    model = load_pickle(model_files[0])
    if not isinstance(model, Mapping) or "module" not in model:
        raise CheckpointError(f"{model_files[0]} holds no `module`: not DeepSpeed's model states")
    dims = model.get("checkpoint_parallel_dimensions") or {}
    for key, what in (("tp_degree", "tensor"), ("pp_degree", "pipeline")):
        if isinstance(dims.get(key), int) and dims[key] > 1:
            raise CheckpointError(
                f"{model_files[0]}: a {what}-parallel checkpoint ({key}={dims[key]}), which the "
                "import does not read; convert it with ds_to_universal.py"
            )
    if model.get("param_shapes") is not None and not optim_files:
        raise CheckpointError(
            f"{tag} has no *_optim_states.pt files beside {model_files[0].name}: the optimizer's "
            "files were not copied (or not saved); the import needs them"
        )
    if model.get("param_shapes") is None:
        raise CheckpointError(
            f"{tag} was saved without ZeRO (stage 0): its optimizer state is kept by position "
            f"in {model_files[0].name}, not by parameter name, so it cannot be matched to the "
            "model's parameters; save with zero_optimization.stage 1, 2 or 3 (or convert to a "
            "universal checkpoint)"
        )
    opt_files = [optim_files[r] for r in sorted(optim_files)]
    first = _optimizer_state(opt_files[0])
    world = _world(first, opt_files[0])
    _check_ranks(tag, optim_files, world, "optimizer files", lambda r: _optim_name(prefix, r))
    saved_dp = model.get("dp_world_size")
    if isinstance(saved_dp, int) and saved_dp != world:
        raise CheckpointError(
            f"mismatched world sizes in {tag}: {model_files[0].name} says dp_world_size="
            f"{saved_dp}, the optimizer files partition_count={world}"
        )
    opts = [first] + [_optimizer_state(f) for f in opt_files[1:]]
    stage = int(first.get("zero_stage", 1))  # BF16_Optimizer (ZeRO-1) writes none
    for o, f in zip(opts, opt_files, strict=True):
        if int(o.get("zero_stage", 1)) != stage or _world(o, f) != world:
            raise CheckpointError(
                f"mismatched files in {tag}: {f.name} is ZeRO-{int(o.get('zero_stage', 1))} over "
                f"{_world(o, f)} ranks, {opt_files[0].name} ZeRO-{stage} over {world}"
            )
    models = [model]
    if stage == 3:
        _check_ranks(tag, model_files, world, "model states", lambda r: _model_name(r, True))
        models += [load_pickle(model_files[r]) for r in range(1, world)]
    read = _zero3 if stage == 3 else _zero12
    try:
        params, state, steps = read(model, opts, opt_files)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{tag}: the files do not hold what DeepSpeed's ZeRO-{stage} writes "
            f"({type(e).__name__}: {e}); a DeepSpeed version or optimizer the import does not "
            "know? Convert the checkpoint with ds_to_universal.py and import that"
        ) from None
    frozen = _frozen(model, models, set(params))
    names = list(params)
    return DeepSpeedCheckpoint(
        path=tag,
        zero_stage=stage,
        world_size=world,
        dtype=_dtype(model, names),
        params={**params, **frozen},
        buffers={n: model["module"][n] for n in model.get("buffer_names") or ()},
        state=state,
        steps=steps,
        global_steps=int(model.get("global_steps") or 0),
        skipped_steps=int(model.get("skipped_steps") or 0),
        lr_scheduler=model.get("lr_scheduler"),
        loss_scaler=scaler_fields(first.get("loss_scaler")),
        param_groups=_groups(first, model["param_shapes"], stage),
        shared=dict(model.get("shared_params") or {}),
        frozen=tuple(frozen),
        ds_config=model.get("ds_config"),
        ds_version=model.get("ds_version"),
    )


def _optimizer_state(path: Path) -> Mapping[str, Any]:
    saved = load_pickle(path)
    if not isinstance(saved, Mapping) or not isinstance(saved.get("optimizer_state_dict"), Mapping):
        raise CheckpointError(f"{path} holds no optimizer_state_dict: not a ZeRO optimizer file")
    return saved["optimizer_state_dict"]


def _model_name(rank: int, zero3: bool) -> str:
    return (
        f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if zero3 else "mp_rank_00_model_states.pt"
    )
