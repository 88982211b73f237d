"""``load``: each rank reads, from each stored box, only the part that
overlaps its own piece of the target — for any source and target mesh."""

from __future__ import annotations

import json
import math
import os
import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optree
import torch

from .._tree import render_path
from ..errors import CheckpointError, ShardingError
from ..mesh._mesh import AbstractMesh, Mesh
from ..shard._layout import Layout
from ..shard._matching import Rules, as_rules, fit_spec, is_rules
from ..shard._memory import allocate, is_disk, kind_of, release
from ..shard._sharded import Sharded
from ..shard._spec import NamedSharding, PartitionSpec
from ._format import (
    Box,
    Index,
    TensorEntry,
    ValueEntry,
    live_dir,
    parse_dtype,
    read_index,
)
from ._safetensors import Files, intersect, read_region
from ._save import _world, flatten, wait_pending

__all__ = [
    "RNG_POLICIES", "fill", "load", "reseed", "restore_rng", "rng_policy", "spec_by_rules",
]  # fmt: skip

_LAYOUTS = (Layout, NamedSharding, PartitionSpec)


def fill(
    files: Files,
    path: str,
    entry: TensorEntry,
    offsets: Sequence[int],
    out: torch.Tensor,
    *,
    verify: bool = True,
    limit: int = 64 << 20,
) -> None:
    """Fill ``out`` with the global region of ``entry`` starting at
    ``offsets`` (``out.shape`` long), from every stored box it overlaps,
    reading at most ``limit`` bytes at a time (one row at least)."""
    sizes = tuple(out.shape)
    dtype = entry.torch_dtype
    covered = 0
    for box in entry.boxes:
        hit = intersect(box.offsets, box.sizes, offsets, sizes)
        if hit is None:
            continue
        lo, n = hit
        dst = out
        for d, (a, k) in enumerate(zip(lo, n, strict=True)):
            dst = dst.narrow(d, a - offsets[d], k)
        read_region(files, box, dtype, lo, n, dst, verify=verify, limit=limit)
        covered += math.prod(n)
    if covered != math.prod(sizes):
        raise CheckpointError(
            f"{path!r}: the checkpoint's boxes cover {covered} of the {math.prod(sizes)} elements "
            f"of region {tuple(offsets)}+{sizes}; the index is inconsistent"
        )


def _shape_of(x: Any) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return tuple(int(d) for d in shape) if shape is not None else None


def _target_layout(
    path: str, t: Any, shape: tuple[int, ...], mesh: AbstractMesh | None
) -> Layout | None:
    layout = getattr(t, "layout", None) if not isinstance(t, _LAYOUTS) else t
    layout = getattr(t, "sharding", None) if layout is None else layout
    if layout is None or isinstance(layout, torch.layout):
        return None
    if isinstance(layout, PartitionSpec):
        if mesh is None:
            raise CheckpointError(f"{path!r}: a bare spec {layout!r} needs load(..., mesh=)")
        return Layout(mesh, fit_spec(layout, shape, mesh, path=path))
    layout = layout if isinstance(layout, Layout) else Layout(layout)
    fit_spec(layout.spec, shape, layout.mesh, path=path)
    return layout


class _Load:
    """One load: the open files, the options, and the problems found."""

    def __init__(
        self, root: Path, index: Index, dtype: torch.dtype | None, device: Any, verify: bool
    ) -> None:
        self.index = index
        self.files = Files(root)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.verify = verify
        self.problems: list[str] = []

    def cast(self, saved: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
        if self.dtype is not None and saved.is_floating_point:
            return self.dtype
        return wanted if wanted is not None else saved

    def check(self, path: str, target: Any, mesh: AbstractMesh | None) -> None:
        """Record what makes ``target`` unable to take the saved leaf (no I/O)."""
        entry = self.index.leaves[path]
        if isinstance(entry, ValueEntry):
            if isinstance(target, (torch.Tensor, Sharded, *_LAYOUTS)):
                self.problems.append(
                    f"{path!r}: the checkpoint holds a value ({entry.value!r}), the target a tensor"
                )
            return
        shape = _shape_of(target) if not isinstance(target, _LAYOUTS) else None
        if shape is not None and shape != entry.shape:
            self.problems.append(
                f"{path!r}: shape {entry.shape} in the checkpoint, {shape} in the target"
            )
        elif target is not None and shape is None and not isinstance(target, _LAYOUTS):
            self.problems.append(
                f"{path!r}: the checkpoint holds a {entry.dtype} {entry.shape} tensor, the target "
                f"a {type(target).__name__}"
            )
        else:
            try:
                _target_layout(path, target, entry.shape, mesh)
            except (CheckpointError, ShardingError) as e:
                self.problems.append(str(e))

    def leaf(self, path: str, target: Any, mesh: AbstractMesh | None) -> Any:
        """The saved leaf read into ``target``'s layout (checked already)."""
        entry = self.index.leaves[path]
        if isinstance(entry, ValueEntry):
            return entry.value
        wanted = getattr(target, "dtype", None)
        dtype = self.cast(entry.torch_dtype, wanted if isinstance(wanted, torch.dtype) else None)
        device = self.device or getattr(target, "device", None) or torch.device("cpu")
        device = torch.device("cpu") if device.type == "meta" else device
        layout = _target_layout(path, target, entry.shape, mesh)
        if layout is None:
            out = torch.empty(entry.shape, dtype=dtype, device=device)
            fill(self.files, path, entry, (0,) * len(entry.shape), out, verify=self.verify)
            return out
        if not isinstance(layout.mesh, Mesh):
            raise CheckpointError(
                f"{path!r}: loading needs a live Mesh; {layout.mesh!r} is abstract"
            )
        rank = layout.mesh.rank
        kind = kind_of(target.local) if isinstance(target, Sharded) else "device"
        shape = layout.local_shape(entry.shape, rank)
        local = (  # where the target lives (optimizer state on disk: rules.offload)
            torch.empty(shape, dtype=dtype, device=device)
            if kind == "device"
            else allocate(shape, dtype, kind, device)
        )
        for offsets, sizes, view in layout.box_views(local, entry.shape, rank):
            if view.is_contiguous():
                fill(self.files, path, entry, offsets, view, verify=self.verify)
            else:  # a block of a blocked dim: read whole, then place
                part = torch.empty(sizes, dtype=dtype, device=device)
                fill(self.files, path, entry, offsets, part, verify=self.verify)
                view.copy_(part)
        if is_disk(local):
            release(local)  # read: to its file, out of this process
        placement = target.placement if isinstance(target, Sharded) else None
        return Sharded(local, layout, entry.shape, placement=placement)


_ROLE_OF = {"opt_state": "opt_state", "grads": "grads"}


def decided(rules: Any, keys: dict[str, tuple[Any, ...]], entries: dict[str, Any]) -> Rules:
    """``rules`` (rules or a list of them) with their deferred entries
    (``rules.megatron(names="auto")``) decided by the parameter paths of a
    checkpoint's tensors (``entries``): each leaf's last key
    (``params.<path>``, ``opt_state.0.mu.<path>``)."""
    tensors = [k for p, k in keys.items() if isinstance(entries.get(p), TensorEntry)]
    rules = as_rules(rules, paths=sorted({str(k[-1]) for k in tensors if k}))
    assert rules is not None  # callers pass rules
    return rules


def spec_by_rules(
    rules: Rules, keys: Sequence[Any], shape: Sequence[int], mesh: AbstractMesh
) -> PartitionSpec:
    """The spec ``rules`` give the saved leaf at ``keys``.

    Rules are written for parameter paths (``blocks.0.attn.weight``), while a
    training state nests them (``params.blocks.0.attn.weight``,
    ``opt_state.0.mu.blocks.0.attn.weight``): the first rule matching the
    whole path or, failing that, its longest matching suffix applies. A leaf
    under a top-level ``opt_state`` (or ``grads``) key takes that role's spec
    (``rules.zero`` shards optimizer state further); every other leaf the
    params' spec.

    >>> import shardax as sx
    >>> rules = sx.Rules(sx.Rule(r"blocks\\.\\d+\\.w", sx.P("tp")))
    >>> spec_by_rules(rules, ("opt_state", 0, "mu", "blocks.0.w"), (4, 2), sx.AbstractMesh({"tp": 2}))
    P('tp')
    """
    keys = tuple(keys)
    role = _ROLE_OF.get(keys[0], "params") if keys else "params"
    path = render_path(keys)
    for i in range(len(keys)):
        suffix = render_path(keys[i:])
        if rules.match(suffix) is not None:
            path = suffix
            break
    return rules.spec_for(path, shape, mesh, role)


def _nest(index: Index, values: dict[str, Any]) -> Any:
    """Nested dicts (lists where keys are 0..n-1) from the stored key paths."""
    root: dict[Any, Any] = {}
    for path, value in values.items():
        keys = index.keys[path]
        if not keys:
            return value
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: lists(v) for k, v in node.items()}
        if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        return out

    return lists(root)


def _report(problems: list[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointError(f"{what}:\n  {shown}{more}")


RNG_POLICIES = ("restore", "reseed", "skip")


def rng_policy(rng: bool | str) -> str:
    """``load``'s ``rng=`` as one of :data:`RNG_POLICIES` (True is
    ``"restore"``, False ``"skip"``).

    >>> rng_policy(True), rng_policy("reseed")
    ('restore', 'reseed')
    """
    if rng is True or rng is False:
        return "restore" if rng else "skip"
    if rng not in RNG_POLICIES:
        raise CheckpointError(
            f"rng={rng!r} is not a policy; use 'restore' (each rank's RNG state exactly as "
            "saved: the same world size), 'reseed' (restored where the world size matches, "
            "else seeded from the checkpoint and the rank) or 'skip' (left as they are)"
        )
    return rng


def _rng_problem(root: Path, index: Index, rank: int, world: int) -> str | None:
    """Why this rank's RNG state cannot be restored exactly, or None."""
    if not index.rng:
        return f"{root} holds no RNG states (it was saved with rng=False)"
    if world != index.world_size:
        return (
            f"{root} holds the RNG states of {index.world_size} rank(s) and this job has "
            f"{world}: a rank's random stream cannot be split or merged"
        )
    if rank not in index.rng:
        return f"{root} holds no RNG state for rank {rank}"
    return None


def reseed(root: Path, index: Index, rank: int) -> int:
    """Seed this rank's torch (and CUDA) and Python RNGs from the checkpoint
    and the rank (``rng="reseed"`` where the states cannot be restored):
    the same seed every time this checkpoint resumes on this rank, a
    different one on every rank. Returns the seed."""
    basis = json.dumps({"metadata": index.metadata, "world": index.world_size}, sort_keys=True)
    seed = zlib.crc32(f"{basis}/{rank}".encode()) & 0x7FFF_FFFF
    torch.manual_seed(seed)  # CUDA generators too, where present
    random.seed(seed)
    return seed


def restore_rng(root: Path, index: Index, rank: int, *, verify: bool = True) -> None:
    """Set this rank's torch, CUDA and Python RNG states from the checkpoint."""
    states = index.rng.get(rank)
    if states is None:
        raise CheckpointError(
            f"{_rng_problem(root, index, rank, index.world_size)}; load with rng='reseed' or "
            "rng='skip'"
        )
    with Files(root) as files:

        def read(box: Box) -> torch.Tensor:
            out = torch.empty(box.sizes, dtype=torch.uint8)
            read_region(files, box, torch.uint8, box.offsets, box.sizes, out, verify=verify)
            return out

        tensors = states["tensors"]
        torch.set_rng_state(read(tensors["__rng__.torch"]))
        cuda_names = [n for n in tensors if n.startswith("__rng__.cuda.")]
        cuda = [
            read(tensors[n]) for n in sorted(cuda_names, key=lambda n: int(n.rsplit(".", 1)[1]))
        ]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    if states.get("python") is not None:
        version, state, gauss = states["python"]
        random.setstate((version, tuple(state), gauss))


def load(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    mesh: AbstractMesh | None = None,
    dtype: torch.dtype | str | None = None,
    device: Any = None,
    strict: bool | str = True,
    verify: bool = True,
    rng: bool | str = False,
) -> Any:
    """Read a checkpoint into the layouts of ``target``, on any mesh.

    Each rank reads only the parts of the stored boxes that overlap its own
    pieces, whatever mesh, specs and world size the checkpoint was written
    with; no collectives are involved. Values are checked against their
    checksums as they are read (``verify=False`` skips that).

    Args:
        path: a checkpoint directory.
        target: what to load into —
            a pytree like the saved one whose leaves are ``Sharded`` (their
            layout, shape and dtype), ``Layout``/``NamedSharding`` or specs
            (with ``mesh``), tensors (meta ones too: a dense tensor of that
            dtype), None (the saved tensor, dense) or scalars (the saved
            value); or a ``Rule``/``Rules`` with ``mesh``: every saved leaf,
            laid out by the rules, as nested dicts; or None: every saved
            leaf, dense, as nested dicts.
        mesh: the mesh for specs and rules.
        dtype: cast floating tensors to this dtype (``"bf16"`` works).
        device: put loaded tensors here (default: the target's, else CPU).
        strict: target keys missing from the checkpoint and saved keys not
            in the target are errors (listed together with shape
            mismatches); ``strict=False`` leaves missing leaves as they are
            and ignores unexpected ones; ``strict="target"`` needs every
            target key but skips the saved keys the target lacks (a pipeline
            rank loads its stages' part of the model).
        verify: check checksums of the bytes read.
        rng: what becomes of this rank's RNG states (torch, CUDA, Python):
            ``"skip"`` (or False, the default) leaves them; ``"restore"``
            (or True) sets them as saved — exactly, so the run continues
            bit for bit, which needs the world size it was saved with (else
            an error naming the other two); ``"reseed"`` restores them where
            the world size matches and otherwise seeds them from the
            checkpoint and the rank (deterministic, not the uninterrupted
            run's stream).

    >>> import tempfile, torch, shardax as sx
    >>> d = tempfile.mkdtemp()
    >>> mesh = sx.Mesh({"dp": 1})
    >>> _ = sx.ckpt.save(d + "/c", {"w": sx.shard(torch.arange(4.0), mesh, sx.P("dp"))})
    >>> sx.ckpt.load(d + "/c", {"w": sx.P(None)}, mesh=mesh)["w"].local
    tensor([0., 1., 2., 3.])
    >>> sx.ckpt.load(d + "/c", {"v": None})
    Traceback (most recent call last):
    ...
    shardax.errors.CheckpointError: checkpoint ... does not match the target:
      missing from the checkpoint: 'v'
      not in the target: 'w'
    """
    policy = rng_policy(rng)
    wait_pending()
    root = live_dir(path)
    index = read_index(root)
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    job = _Load(root, index, cast, device, verify)
    try:
        reads: dict[str, Any] = {}  # saved path -> what to read it into
        if is_rules(target):
            rules = decided(target, index.keys, index.leaves)
            if mesh is None:
                raise CheckpointError("loading by rules needs load(..., mesh=)")
            for p, e in index.leaves.items():
                spec = None
                if isinstance(e, TensorEntry):
                    spec = spec_by_rules(rules, index.keys[p], e.shape, mesh)
                reads[p] = Layout(mesh, spec) if spec is not None else None

            def assemble(values: dict[str, Any]) -> Any:
                return _nest(index, values)

        elif target is None:
            reads = dict.fromkeys(index.leaves)

            def assemble(values: dict[str, Any]) -> Any:
                return _nest(index, values)

        else:
            paths, _, leaves = flatten(target)
            missing = [p for p in paths if p not in index.leaves]
            unexpected = [p for p in index.leaves if p not in set(paths)]
            if strict not in (True, False, "target"):
                raise CheckpointError(f"strict is True, False or 'target'; got {strict!r}")
            if strict:
                job.problems += [f"missing from the checkpoint: {p!r}" for p in missing]
            if strict is True:
                job.problems += [f"not in the target: {p!r}" for p in unexpected]
            reads = {p: x for p, x in zip(paths, leaves, strict=True) if p in index.leaves}
            for p, x in reads.items():
                job.check(p, x, mesh)
            _, treespec = optree.tree_flatten(
                target, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True
            )

            def assemble(values: dict[str, Any]) -> Any:
                out = [values.get(p, x) for p, x in zip(paths, leaves, strict=True)]
                return optree.tree_unflatten(treespec, out)

        _report(job.problems, f"checkpoint {root} does not match the target")
        rank, world = _world()
        problem = _rng_problem(root, index, rank, world) if policy != "skip" else None
        if problem is not None and policy == "restore":
            raise CheckpointError(
                f"rng='restore' sets each rank's RNG state as saved, but {problem}. Load with "
                "rng='reseed' (seed each rank's generators from the checkpoint and the rank: "
                "deterministic, though not the uninterrupted run's random stream) or "
                "rng='skip' (leave them as they are)"
            )
        loaded = assemble({p: job.leaf(p, x, mesh) for p, x in reads.items()})
        if policy != "skip":
            if problem is None:
                restore_rng(root, index, rank, verify=verify)
            else:
                reseed(root, index, rank)
        return loaded
    finally:
        job.files.close()
