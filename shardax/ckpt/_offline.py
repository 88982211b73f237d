"""Offline tools over a checkpoint directory, with no process group:
``verify``, ``reshard``, ``consolidate`` and ``import_dense``.

Each streams: tensors move in row blocks of at most ``buffer_bytes`` (one
row at least), read with :func:`fill` from exactly the stored boxes they
overlap and written with :class:`ShardWriter`, so memory stays bounded by
the buffer, not by the model. Outputs appear atomically (a temporary
sibling renamed into place), as with ``save``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .._tree import render_path
from ..errors import CheckpointError
from ..mesh._mesh import AbstractMesh
from ..shard._layout import Layout
from ..shard._matching import Rule, Rules, is_rules
from ..shard._spec import P, PartitionSpec
from ._format import (
    _BY_CODE,
    INDEX,
    Box,
    Index,
    TensorEntry,
    ValueEntry,
    dtype_name,
    live_dir,
    parse_dtype,
    read_index,
    write_index,
)
from ._load import decided, fill, spec_by_rules
from ._model import MODEL_KEY
from ._safetensors import Files, ShardWriter, read_header, read_region, row_blocks
from ._save import (
    RNG_PREFIX,
    _commit,
    _file,
    _fsync_dir,
    _prepare,
    box_name,
    distinct_boxes,
    flatten,
)

__all__ = [
    "as_rules",
    "consolidate",
    "dense_total_bytes",
    "import_dense",
    "reshard",
    "total_bytes",
    "total_tensors",
    "verify",
]

BUFFER = 64 << 20
Progress = Callable[[int], None]
"""Called with the number of bytes just processed."""


def _noop(_: int) -> None:
    pass


def as_rules(rules: Rules | Rule | Sequence[Rule] | Mapping[str, Any]) -> Rules:
    """Rules from ``Rules``, a ``Rule``, a list of them, or a mapping of
    regex pattern → spec (a ``P`` or a JSON-style list: ``["dp", null]``,
    ``[["dp", "tp"], null]`` for several axes on one dim).

    >>> as_rules({r".*\\.weight": ["tp", None]})
    Rules(Rule('.*\\\\.weight', P('tp', None)))
    """
    if isinstance(rules, Rules):
        return rules
    if is_rules(rules):
        return Rules(rules)
    if isinstance(rules, Mapping):
        made = []
        for pattern, spec in rules.items():
            if not isinstance(spec, (PartitionSpec, list, tuple)):
                raise CheckpointError(
                    f"the spec for {pattern!r} is {spec!r}; write it as a list with one entry per "
                    'dim: an axis name, null, or a list of axis names (["dp", null])'
                )
            entries = [tuple(e) if isinstance(e, list) else e for e in spec]
            made.append(Rule(pattern, spec if isinstance(spec, PartitionSpec) else P(*entries)))
        return Rules(*made)
    raise CheckpointError(
        f"expected Rules, a Rule, a list of Rule or a mapping pattern → spec; got {rules!r}"
    )


@attrs.frozen
class _Source:
    """Where tensors come from: a checkpoint (its index and files) or a dense
    file; ``region(path, offsets, out)`` fills ``out`` from it."""

    entries: dict[str, TensorEntry | ValueEntry]
    keys: dict[str, tuple[Any, ...]]
    region: Callable[[str, Sequence[int], torch.Tensor], None]
    metadata: dict[str, Any]
    close: Callable[[], None]


def _checkpoint_source(files: Files, index: Index, limit: int) -> _Source:
    return _Source(
        dict(index.leaves),
        dict(index.keys),
        lambda path, offsets, out: fill(files, path, index.leaves[path], offsets, out, limit=limit),
        dict(index.metadata),
        files.close,
    )


def _blocks(
    offsets: Sequence[int], sizes: Sequence[int], item: int, limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row blocks of the region ``offsets``/``sizes`` of at most ``limit`` bytes."""
    return row_blocks(offsets, sizes, math.prod(sizes[1:]) * item, limit)


def verify(
    path: str | os.PathLike[str],
    *,
    buffer_bytes: int = BUFFER,
    progress: Progress | None = None,
) -> list[str]:
    """Recompute every checksum of the checkpoint at ``path``: a list of
    problems, each naming the file and tensor (empty when all is well).

    >>> import os, tempfile, torch, shardax as sx
    >>> path = sx.ckpt.save(tempfile.mkdtemp() + "/c", {"w": torch.arange(4.0)}, rng=False)
    >>> sx.ckpt.verify(path)
    []
    >>> with open(path / "rank-00000-of-00001.safetensors", "r+b") as f:
    ...     _ = f.seek(-1, os.SEEK_END); _ = f.write(b"?")   # the last byte of w
    >>> sx.ckpt.verify(path)
    ['checksum mismatch in rank-00000-of-00001.safetensors:w@0 (bytes 0–16 of the tensor): ...']
    """
    root = live_dir(path)
    try:
        index = read_index(root)
    except CheckpointError as e:
        if not (root / INDEX).is_file():
            raise  # no checkpoint here: not a finding
        return [str(e)]  # an index that does not hold together is one
    progress = progress or _noop
    boxes = [(b, e.torch_dtype) for e in index.tensors().values() for b in e.boxes]
    boxes += [(b, torch.uint8) for s in index.rng.values() for b in s["tensors"].values()]
    problems = []
    for leaf, e in index.tensors().items():  # the boxes must tile the tensor
        covered = sum(b.numel for b in e.boxes)
        if covered != math.prod(e.shape):
            problems.append(
                f"{leaf!r}: its boxes hold {covered} of the {math.prod(e.shape)} elements of "
                f"shape {e.shape}; the index is inconsistent"
            )
    with Files(root) as files:
        for box, dtype in boxes:
            try:
                for off, size in _blocks(box.offsets, box.sizes, dtype.itemsize, buffer_bytes):
                    out = torch.empty(size, dtype=dtype)
                    read_region(files, box, dtype, off, size, out, limit=buffer_bytes)
                    progress(out.numel() * dtype.itemsize)
            except CheckpointError as e:
                if str(e) not in problems:  # a missing file fails each of its boxes alike
                    problems.append(str(e))
    return problems


def _target(
    source: _Source,
    rules: Rules,
    mesh: AbstractMesh,
    dtype: torch.dtype | None,
) -> tuple[dict[str, TensorEntry | ValueEntry], dict[int, list[tuple[str, str, Box]]]]:
    """The new index entries (checksums still empty) and, per target rank,
    the boxes it stores: ``(leaf path, tensor name, box)``."""
    leaves: dict[str, TensorEntry | ValueEntry] = {}
    owned: dict[int, list[tuple[str, str, Box]]] = {}
    world = mesh.world_size
    rules = decided(rules, source.keys, source.entries)
    for path, e in source.entries.items():
        if isinstance(e, ValueEntry):
            leaves[path] = e
            continue
        spec = spec_by_rules(rules, source.keys[path], e.shape, mesh)
        stored = []
        for owner, offsets, sizes in distinct_boxes(Layout(mesh, spec), e.shape):
            box = Box(offsets, sizes, _file(owner, world), box_name(path, offsets))
            stored.append(box)
            owned.setdefault(owner, []).append((path, box.name, box))
        saved = e.torch_dtype
        cast = dtype if dtype is not None and saved.is_floating_point else saved
        leaves[path] = TensorEntry(e.shape, dtype_name(cast), spec, mesh.shape, stored)
    return leaves, owned


def _write_sharded(
    source: _Source,
    dst: Path,
    rules: Rules,
    mesh: AbstractMesh,
    *,
    dtype: torch.dtype | None,
    rng: Mapping[int, dict[str, Any]],
    rng_files: Files | None,
    buffer_bytes: int,
    progress: Progress,
) -> Path:
    """Write ``source`` laid out by ``rules`` on ``mesh`` as a checkpoint."""
    leaves, owned = _target(source, rules, mesh, dtype)
    world = mesh.world_size
    tmp = _prepare(dst)
    sums: dict[str, tuple[int, ...]] = {}  # box names are unique
    rng_sums: dict[int, dict[str, tuple[int, ...]]] = {}  # RNG names repeat per rank
    for rank in range(world):
        boxes = owned.get(rank, [])
        rng_boxes = list(rng.get(rank, {}).get("tensors", {}).values())
        if not boxes and not rng_boxes:
            continue
        specs = [(n, leaves[p].torch_dtype, b.sizes) for p, n, b in boxes]
        specs += [(b.name, torch.uint8, b.sizes) for b in rng_boxes]
        writer = ShardWriter(tmp / _file(rank, world), specs)
        for path, name, box in boxes:
            entry = leaves[path]
            assert isinstance(entry, TensorEntry)
            item = entry.torch_dtype.itemsize
            for off, size in _blocks(box.offsets, box.sizes, item, buffer_bytes):
                out = torch.empty(size, dtype=entry.torch_dtype)
                if out.numel():
                    source.region(path, off, out)
                writer.write(name, out)
                progress(out.numel() * out.element_size())
        for b in rng_boxes:
            assert rng_files is not None
            out = torch.empty(b.sizes, dtype=torch.uint8)
            read_region(rng_files, b, torch.uint8, b.offsets, b.sizes, out)
            writer.write(b.name, out)
        written = writer.close()
        sums.update({n: c for n, c in written.items() if not n.startswith(RNG_PREFIX)})
        rng_sums[rank] = {n: c for n, c in written.items() if n.startswith(RNG_PREFIX)}
    leaves = {
        p: attrs.evolve(e, boxes=[attrs.evolve(b, crc32=sums[b.name]) for b in e.boxes])
        if isinstance(e, TensorEntry)
        else e
        for p, e in leaves.items()
    }
    kept_rng = {
        r: {
            "python": s.get("python"),
            "tensors": {
                n: attrs.evolve(b, file=_file(r, world), crc32=rng_sums[r][b.name])
                for n, b in s["tensors"].items()
            },
        }
        for r, s in rng.items()
    }
    index = Index(mesh.shape, world, source.metadata, leaves, source.keys, kept_rng)
    write_index(tmp, index)
    _fsync_dir(tmp)
    _commit(tmp, dst)
    return dst


def _same_dir(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    rules: Rules | Rule | Sequence[Rule] | Mapping[str, Any],
    *,
    mesh: AbstractMesh | Mapping[str, int],
    dtype: torch.dtype | str | None = None,
    buffer_bytes: int = BUFFER,
    progress: Progress | None = None,
) -> Path:
    """Rewrite the checkpoint ``src`` as if it had been saved from ``mesh``
    with the specs ``rules`` give (see :func:`spec_by_rules` for how rules
    written for parameter paths reach optimizer state). Offline: no process
    group; memory is bounded by ``buffer_bytes`` (one row at least), not by
    the model. RNG states are kept when ``mesh`` has as many ranks as the
    source (so a resharded checkpoint still resumes bit for bit), dropped
    otherwise. ``dtype`` casts floating tensors.

    >>> import tempfile, torch, shardax as sx
    >>> d = tempfile.mkdtemp()
    >>> _ = sx.ckpt.save(d + "/a", {"w": torch.arange(8.0).reshape(4, 2)})
    >>> _ = sx.ckpt.reshard(d + "/a", d + "/b", {"w": ["dp", None]}, mesh={"dp": 2})
    >>> [b.sizes for b in sx.ckpt.read_index(d + "/b").leaves["w"].boxes]
    [(2, 2), (2, 2)]
    """
    src_p, dst_p = live_dir(src), Path(dst).absolute()
    mesh = mesh if isinstance(mesh, AbstractMesh) else AbstractMesh(dict(mesh))
    if dst_p.exists() and _same_dir(src_p, dst_p):
        raise CheckpointError(f"reshard writes a new checkpoint: {dst} is the source itself")
    index = read_index(src_p)
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    files = Files(src_p)
    try:
        rng = index.rng if index.world_size == mesh.world_size else {}
        return _write_sharded(
            _checkpoint_source(files, index, buffer_bytes),
            dst_p,
            as_rules(rules),
            mesh,
            dtype=cast,
            rng=rng,
            rng_files=files,
            buffer_bytes=buffer_bytes,
            progress=progress or _noop,
        )
    finally:
        files.close()


def _selected(index: Index, only: str | None) -> dict[str, str]:
    """Saved path → plain name in the consolidated file: the path below the
    key path ``only`` (the whole path without it)."""
    out = {}
    for path in index.leaves:
        keys = index.keys[path]
        if only is None:
            out[path] = path
            continue
        head = next((i for i in range(1, len(keys)) if render_path(keys[:i]) == only), None)
        if head is not None:
            out[path] = render_path(keys[head:])
        elif path == only:
            out[path] = path
    if not out:
        raise CheckpointError(
            f"--only {only!r} selects nothing; top-level keys are "
            f"{sorted({str(k[0]) for k in index.keys.values() if k})}"
        )
    return out


def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    only: str | None = None,
    dtype: torch.dtype | str | None = None,
    buffer_bytes: int = BUFFER,
    progress: Progress | None = None,
    hf: bool = False,
) -> Path:
    """Write the checkpoint ``src`` as one dense safetensors file ``out``,
    streaming (memory bounded by ``buffer_bytes``, one row at least).

    ``only`` keeps the leaves under one key path (``"params"``), named
    relative to it — the plain parameter names that
    ``safetensors.torch.load_file`` gives to ``model.load_state_dict``; the
    rest (optimizer state, say) is never read. ``dtype`` casts floating
    tensors. JSON values under ``only`` go to the file's metadata.

    A checkpoint saved with ``metadata=sx.ckpt.model_metadata(model)``
    gives the model its own file: a tied parameter is written under each of
    its names and buffers outside ``state_dict()`` are left out, so
    ``model.load_state_dict(load_file(out), strict=True)`` takes it.
    ``hf=True`` makes ``out`` a folder that Hugging Face's
    ``from_pretrained`` loads: ``model.safetensors`` and the model's
    ``config.json``.

    >>> import tempfile, torch, shardax as sx, safetensors.torch
    >>> d = tempfile.mkdtemp()
    >>> tree = {"params": {"fc.weight": torch.ones(2, 2)}, "opt_state": {"mu": torch.zeros(2, 2)}}
    >>> _ = sx.ckpt.save(d + "/c", tree)
    >>> _ = sx.ckpt.consolidate(d + "/c", d + "/model.safetensors", only="params", dtype="bf16")
    >>> safetensors.torch.load_file(d + "/model.safetensors")
    {'fc.weight': tensor([[1., 1.],
            [1., 1.]], dtype=torch.bfloat16)}
    """
    root, target = live_dir(src), Path(out).absolute()
    if target.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(f"{out} is inside the checkpoint {src}; write it elsewhere")
    index = read_index(root)
    model = index.metadata.get(MODEL_KEY) or {}
    if hf:
        if not model.get("hf_config"):
            raise CheckpointError(
                f"{src} records no Hugging Face config; save it with "
                "metadata=sx.ckpt.model_metadata(model) (a transformers model) to consolidate "
                "it as a Hugging Face folder"
            )
        if target.exists() and not target.is_dir():
            raise CheckpointError(f"{out} is a file; with hf=True it is the folder to write")
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(model["hf_config"], indent=2) + "\n")
        target = target / "model.safetensors"
    elif target.is_dir():
        raise CheckpointError(f"{out} is a directory; consolidate writes one .safetensors file")
    names = _selected(index, only)
    skipped = set(model.get("not_saved", ()))
    names = {p: n for p, n in names.items() if n not in skipped}
    by_name = {n: p for p, n in names.items()}
    aliases = [(a, by_name[c]) for a, c in model.get("aliases", {}).items() if c in by_name]
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    progress = progress or _noop
    tensors, values = [], {}
    for path, name in names.items():
        e = index.leaves[path]
        if isinstance(e, ValueEntry):
            values[name] = json.dumps(e.value)
            continue
        saved = e.torch_dtype
        tensors.append(
            (path, name, cast if cast is not None and saved.is_floating_point else saved)
        )
    want_of = {p: d for p, _, d in tensors}
    tensors += [(path, alias, want_of[path]) for alias, path in aliases if path in want_of]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    writer = ShardWriter(
        tmp,
        [(n, d, index.leaves[p].shape) for p, n, d in tensors],
        metadata={"format": "pt", **values},  # "format": what transformers' loader asks for
    )
    try:
        with Files(root) as files:
            for path, name, want in tensors:
                entry = index.leaves[path]
                assert isinstance(entry, TensorEntry)
                shape = entry.shape
                start = (0,) * len(shape)
                item = entry.torch_dtype.itemsize
                for off, size in _blocks(start, shape, item, buffer_bytes):
                    block = torch.empty(size, dtype=entry.torch_dtype)
                    if block.numel():
                        fill(files, path, entry, off, block, limit=buffer_bytes)
                    writer.write(name, block.to(want))
                    progress(block.numel() * want.itemsize)
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    return target.parent if hf else target


def _dense_source(src: Path, prefix: str | None) -> _Source:
    """A dense safetensors file (read in place, never loaded whole) or a torch
    state dict (``torch.load(weights_only=True)``, memory-mapped)."""
    keys: dict[str, tuple[Any, ...]] = {}
    entries: dict[str, TensorEntry | ValueEntry] = {}
    head = (prefix,) if prefix else ()
    if src.suffix == ".safetensors":
        with open(src, "rb") as f:
            header = read_header(f, str(src))
        files = Files(src.parent)
        for name, meta in header.tensors.items():
            path = render_path((*head, name))
            shape = tuple(meta["shape"])
            dtype = _BY_CODE.get(meta["dtype"])
            if dtype is None:
                raise CheckpointError(
                    f"{src}: tensor {name!r} has dtype {meta['dtype']!r}, which shardax does not "
                    f"store; supported: {sorted(_BY_CODE)}"
                )
            box = Box((0,) * len(shape), shape, src.name, name)
            entries[path] = TensorEntry(shape, dtype_name(dtype), P(), {}, [box])
            keys[path] = (*head, name)

        def region(path: str, offsets: Sequence[int], out: torch.Tensor) -> None:
            entry = entries[path]
            assert isinstance(entry, TensorEntry)
            box = entry.boxes[0]
            read_region(files, box, entry.torch_dtype, offsets, tuple(out.shape), out, verify=False)

        return _Source(entries, keys, region, {}, files.close)
    try:
        try:
            obj = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped
            obj = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, OSError …
        raise CheckpointError(
            f"cannot read {src} as a torch state dict with weights_only=True (no code is run): {e}"
        ) from None
    paths, leaf_keys, leaves = flatten(obj)
    tensors: dict[str, torch.Tensor] = {}
    for path, k, x in zip(paths, leaf_keys, leaves, strict=True):
        path = render_path((*head, *k))
        keys[path] = (*head, *k)
        if isinstance(x, torch.Tensor):
            entries[path] = TensorEntry(tuple(x.shape), dtype_name(x.dtype), P(), {}, [])
            tensors[path] = x
        elif x is None or isinstance(x, (bool, int, float, str)):
            entries[path] = ValueEntry(x)
        else:
            raise CheckpointError(f"{src}: {path!r} holds a {type(x).__name__}, not a tensor")

    def copy(path: str, offsets: Sequence[int], out: torch.Tensor) -> None:
        t = tensors[path]
        for d, (o, n) in enumerate(zip(offsets, out.shape, strict=True)):
            t = t.narrow(d, o, n)
        out.copy_(t)

    return _Source(entries, keys, copy, {}, lambda: None)


def import_dense(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    rules: Rules | Rule | Sequence[Rule] | Mapping[str, Any],
    *,
    mesh: AbstractMesh | Mapping[str, int],
    prefix: str | None = None,
    dtype: torch.dtype | str | None = None,
    buffer_bytes: int = BUFFER,
    progress: Progress | None = None,
) -> Path:
    """Turn dense weights — a ``.safetensors`` file (read in place) or a
    torch state dict (loaded with ``weights_only=True``: no code runs) — into
    a sharded checkpoint laid out by ``rules`` on ``mesh``, to start sharded
    training from pretrained weights. ``prefix`` nests every name under one
    key (``"params"`` → ``params.fc.weight``).

    >>> import tempfile, torch, shardax as sx, safetensors.torch
    >>> d = tempfile.mkdtemp()
    >>> safetensors.torch.save_file({"fc.weight": torch.ones(4, 2)}, d + "/model.safetensors")
    >>> _ = sx.ckpt.import_dense(d + "/model.safetensors", d + "/c", {r".*": ["dp"]}, mesh={"dp": 2}, prefix="params")
    >>> sx.ckpt.read_index(d + "/c").leaves["params.fc.weight"].spec
    P('dp')
    """
    source_path, dst_p = Path(src), Path(dst).absolute()
    if not source_path.is_file():
        raise CheckpointError(f"no file at {src}")
    mesh = mesh if isinstance(mesh, AbstractMesh) else AbstractMesh(dict(mesh))
    source = _dense_source(source_path, prefix)
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    try:
        return _write_sharded(
            source,
            dst_p,
            as_rules(rules),
            mesh,
            dtype=cast,
            rng={},
            rng_files=None,
            buffer_bytes=buffer_bytes,
            progress=progress or _noop,
        )
    finally:
        source.close()


def _written_bytes(entries: Mapping[str, Any], cast: torch.dtype | None) -> int:
    total = 0
    for e in entries.values():
        if isinstance(e, TensorEntry):
            item = e.torch_dtype.itemsize
            if cast is not None and e.torch_dtype.is_floating_point:
                item = cast.itemsize
            total += math.prod(e.shape) * item
    return total


def total_bytes(
    index: Index, only: str | None = None, dtype: torch.dtype | str | None = None
) -> int:
    """The bytes a tool writes for the tensors of ``index`` (for progress
    bars): those under ``only``, floating ones cast to ``dtype``."""
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    paths = _selected(index, only) if only else index.leaves
    return _written_bytes({p: index.leaves[p] for p in paths}, cast)


def total_tensors(index: Index, only: str | None = None) -> int:
    """How many tensors ``consolidate(..., only=only)`` writes."""
    paths = _selected(index, only) if only else index.leaves
    return sum(isinstance(index.leaves[p], TensorEntry) for p in paths)


def dense_total_bytes(src: str | os.PathLike[str], dtype: torch.dtype | str | None = None) -> int:
    """The bytes ``import_dense`` writes for the dense file ``src``."""
    cast = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    source = _dense_source(Path(src), None)
    try:
        return _written_bytes(source.entries, cast)
    finally:
        source.close()
