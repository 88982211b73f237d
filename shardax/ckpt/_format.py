"""The checkpoint format: one ``index.json`` and safetensors files of boxes.

A *box* is a block of a global tensor (its offsets and sizes per dim) stored
as one safetensors tensor. Each leaf of the saved pytree is either a tensor
entry (global shape, dtype, the spec and mesh it was saved from, and the
boxes that tile it, each distinct box stored once) or a JSON value. Every
box carries CRC-32 checksums of its bytes in ``CHUNK``-sized pieces, so a
reader that needs part of a box verifies just the pieces it reads.

This module is pure data: value objects and JSON in and out; the
safetensors files are written and read in :mod:`._safetensors`. Nothing
here unpickles or runs code.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import attrs
import torch

from ..errors import CheckpointError
from ..shard._spec import Blocks, P, PartitionSpec

__all__ = [
    "CHUNK",
    "FORMAT",
    "INDEX",
    "VERSION",
    "Box",
    "Index",
    "TensorEntry",
    "ValueEntry",
    "read_index",
    "write_index",
]

FORMAT = "shardax-checkpoint"
VERSION = 1
INDEX = "index.json"
CHUNK = 1 << 20  # bytes per checksum piece
_MAX_HEADER = 100 << 20

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_CODE = {v: k for k, v in _DTYPES.items()}
_BY_NAME = {str(k).removeprefix("torch."): k for k in _DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the index's spelling)."""
    if dtype not in _DTYPES:
        raise CheckpointError(
            f"checkpoints cannot hold {dtype} tensors; supported: {sorted(_BY_NAME)}"
        )
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"`` or ``"torch.bfloat16"`` → ``torch.bfloat16``."""
    short = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
    key = str(name).removeprefix("torch.")
    key = short.get(key, key)
    if key not in _BY_NAME:
        raise CheckpointError(
            f"unknown dtype {name!r}; use one of {sorted(_BY_NAME)} or fp32/bf16/fp16"
        )
    return _BY_NAME[key]


def _ints(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def safe_name(name: str) -> str:
    """A file name from an index, checked to stay inside the checkpoint."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or "\\" in name or any(part in ("..", "") for part in p.parts):
        raise CheckpointError(
            f"unsafe file name {name!r} in a checkpoint index: names must be relative paths "
            "inside the checkpoint directory (no absolute paths, no '..')"
        )
    return name


@attrs.frozen
class Box:
    """One stored block of a global tensor: ``offsets``/``sizes`` per dim, the
    safetensors ``file`` and tensor ``name`` holding it, and the CRC-32 of
    each ``CHUNK`` of its bytes."""

    offsets: tuple[int, ...] = attrs.field(converter=_ints)
    sizes: tuple[int, ...] = attrs.field(converter=_ints)
    file: str = attrs.field(validator=lambda _, __, v: safe_name(v))
    name: str
    crc32: tuple[int, ...] = attrs.field(converter=_ints, default=())

    def __attrs_post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes) or any(v < 0 for v in self.offsets + self.sizes):
            raise CheckpointError(f"bad box {self.offsets} + {self.sizes} for {self.name!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def to_json(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "name": self.name,
            "crc32": list(self.crc32),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Box:
        return cls(d["offsets"], d["sizes"], d["file"], d["name"], d.get("crc32", ()))


def spec_to_json(spec: PartitionSpec) -> list[Any]:
    """A spec's entries as JSON: an axis, a list of axes, null, or
    ``{"blocks": k, "axes": [...]}`` for a blocked dim (:func:`shardax.blocks`)."""
    return [
        {"blocks": e.k, "axes": list(e.axes)}
        if isinstance(e, Blocks)
        else list(e)
        if isinstance(e, tuple)
        else e
        for e in spec
    ]


def spec_from_json(entries: Sequence[Any]) -> PartitionSpec:
    def entry(e: Any) -> Any:
        if isinstance(e, dict):
            return Blocks(int(e["blocks"]), tuple(e["axes"]))
        return tuple(e) if isinstance(e, list) else e

    return P(*(entry(e) for e in entries))


@attrs.frozen
class TensorEntry:
    """A tensor leaf: global ``shape``, ``dtype`` name, the ``spec`` (and
    ``mesh`` axis sizes) it was saved from, and its ``boxes``."""

    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: str
    spec: PartitionSpec
    mesh: dict[str, int]
    boxes: tuple[Box, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        parse_dtype(self.dtype)
        if any(d < 0 for d in self.shape):
            raise CheckpointError(f"shape {self.shape} has a negative dim")
        for b in self.boxes:
            if len(b.offsets) != len(self.shape) or any(
                o + n > d for o, n, d in zip(b.offsets, b.sizes, self.shape, strict=True)
            ):
                raise CheckpointError(
                    f"box {b.name!r} ({b.offsets} + {b.sizes}) does not fit in shape {self.shape}"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "tensor",
            "shape": list(self.shape),
            "dtype": self.dtype,
            "spec": spec_to_json(self.spec),
            "mesh": dict(self.mesh),
            "boxes": [b.to_json() for b in self.boxes],
        }


@attrs.frozen
class ValueEntry:
    """A JSON leaf (a step count, a flag, a name, None)."""

    value: Any


Entry = TensorEntry | ValueEntry


def _check_filled(entry: TensorEntry) -> None:
    """A tensor read from an index: its boxes hold every element (checked
    before anything is allocated for it)."""
    stored = sum(b.numel for b in entry.boxes)
    if stored < math.prod(entry.shape):  # checked before anything is allocated
        raise CheckpointError(
            f"its boxes hold {stored} of the {math.prod(entry.shape)} elements of shape "
            f"{entry.shape}: the index is corrupt or forged (every element of a saved tensor "
            "is stored at least once); refused before allocating anything"
        )


def _entry_from_json(e: Mapping[str, Any]) -> Entry:
    if e["kind"] == "tensor":
        entry = TensorEntry(
            e["shape"],
            str(parse_dtype(e["dtype"])).removeprefix("torch."),
            spec_from_json(e["spec"]),
            {str(k): int(v) for k, v in e["mesh"].items()},
            [Box.from_json(b) for b in e["boxes"]],
        )
        _check_filled(entry)
        return entry
    if e["kind"] == "value":
        return ValueEntry(e["value"])
    raise CheckpointError(f"unknown kind {e['kind']!r}")


@attrs.frozen
class Index:
    """A checkpoint's ``index.json``: the mesh it was written from, the user
    ``metadata``, each leaf by key path (with the ``keys`` to rebuild nested
    containers), and each rank's RNG states (``rng``: rank → boxes by name,
    plus Python's ``random`` state)."""

    mesh: dict[str, int]
    world_size: int
    metadata: dict[str, Any]
    leaves: dict[str, Entry]
    keys: dict[str, tuple[Any, ...]]
    rng: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    version: int = VERSION

    def tensors(self) -> dict[str, TensorEntry]:
        return {k: v for k, v in self.leaves.items() if isinstance(v, TensorEntry)}

    def files(self) -> set[str]:
        names = {b.file for e in self.tensors().values() for b in e.boxes}
        for states in self.rng.values():
            names.update(b.file for b in states.get("tensors", {}).values())
        return names

    def to_json(self) -> dict[str, Any]:
        leaves: dict[str, Any] = {}
        for path, e in self.leaves.items():
            body = (
                e.to_json() if isinstance(e, TensorEntry) else {"kind": "value", "value": e.value}
            )
            leaves[path] = {"keys": list(self.keys[path]), **body}
        rng = {
            str(r): {
                "python": s.get("python"),
                "tensors": {k: b.to_json() for k, b in s.get("tensors", {}).items()},
            }
            for r, s in self.rng.items()
        }
        return {
            "format": FORMAT,
            "version": self.version,
            "mesh": dict(self.mesh),
            "world_size": self.world_size,
            "metadata": self.metadata,
            "leaves": leaves,
            "rng": rng,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "index.json") -> Index:
        if not isinstance(d, Mapping) or d.get("format") != FORMAT:
            raise CheckpointError(
                f"{where} is not a shardax checkpoint index (no format={FORMAT!r})"
            )
        version = d.get("version")
        if version != VERSION:
            hint = (
                "upgrade shardax to read newer checkpoints"
                if isinstance(version, int) and version > VERSION
                else "the index is damaged or not written by shardax"
            )
            raise CheckpointError(
                f"{where} has format version {version!r}; this shardax reads version {VERSION} "
                f"({hint})"
            )
        try:
            leaves: dict[str, Entry] = {}
            keys: dict[str, tuple[Any, ...]] = {}
            for path, e in d["leaves"].items():
                keys[path] = tuple(e["keys"])
                try:
                    leaves[path] = _entry_from_json(e)
                except CheckpointError as err:
                    raise CheckpointError(f"{where}: leaf {path!r}: {err}") from None
            rng = {
                int(r): {
                    "python": s.get("python"),
                    "tensors": {k: Box.from_json(b) for k, b in s.get("tensors", {}).items()},
                }
                for r, s in d.get("rng", {}).items()
            }
            mesh = {str(k): int(v) for k, v in d["mesh"].items()}
            world = int(d["world_size"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{where} is malformed: {type(e).__name__}: {e}") from None
        return cls(mesh, world, dict(d.get("metadata") or {}), leaves, keys, rng, version)


def live_dir(path: str | os.PathLike[str]) -> Path:
    """The directory holding the checkpoint saved at ``path``: ``path``
    itself, or — when a crash interrupted a commit between its two renames
    (filesystems without an atomic exchange) — the previous checkpoint,
    still set aside as ``.NAME.old``."""
    p = Path(path)
    if not (p / INDEX).is_file():
        old = p.with_name(f".{p.name}.old")
        if (old / INDEX).is_file():
            return old
    return p


def read_index(path: str | os.PathLike[str]) -> Index:
    """Parse and validate ``path/index.json`` (never executes anything).

    >>> import tempfile, torch, shardax as sx
    >>> path = sx.ckpt.save(tempfile.mkdtemp() + "/c", {"w": torch.zeros(2, 3), "step": 4}, metadata={"run": 1})
    >>> index = sx.ckpt.read_index(path)
    >>> index.metadata, index.leaves["w"].shape, index.leaves["step"]
    ({'run': 1}, (2, 3), ValueEntry(value=4))
    """
    where = live_dir(path) / INDEX
    if not where.is_file():
        hint = (
            " (a save may have been interrupted before it committed)" if Path(path).is_dir() else ""
        )
        raise CheckpointError(f"no checkpoint at {str(path)!r}: {where} does not exist{hint}")
    if where.is_symlink() and not where.resolve().is_relative_to(where.parent.resolve()):
        raise CheckpointError(
            f"{where} is a link to {where.resolve()}, outside the checkpoint; a checkpoint's "
            "index must live in its folder (copy the file in)"
        )
    try:
        data = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {where}: {e}") from None
    return Index.from_json(data, str(where))


def write_index(path: str | os.PathLike[str], index: Index) -> None:
    """Write ``index.json`` into the directory ``path`` and fsync it."""
    where = Path(path) / INDEX
    with open(where, "w") as f:
        json.dump(index.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
