"""The checkpoint format: one ``index.json`` and safetensors files of boxes.

A *box* is a block of a global tensor (its offsets and sizes per dim) stored
as one safetensors tensor. Each leaf of the saved pytree is either a tensor
entry (global shape, dtype, the spec and mesh it was saved from, and the
boxes that tile it, each distinct box stored once) or a JSON value. Every
box carries CRC-32 checksums of its bytes in ``CHUNK``-sized pieces, so a
reader that needs part of a box verifies just the pieces it reads.

This module is pure data: value objects, JSON in and out, the safetensors
writer and the region reader. Nothing here unpickles or runs code.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

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
    "read_region",
    "write_index",
    "write_safetensors",
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


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def checksums(data: memoryview) -> tuple[int, ...]:
    """CRC-32 of each ``CHUNK`` of ``data``."""
    crc = Crc()
    crc.feed(data)
    return crc.result()


class Crc:
    """CRC-32 per ``CHUNK`` of a byte stream fed piece by piece."""

    def __init__(self) -> None:
        self.done: list[int] = []
        self.crc, self.filled = 0, 0

    def feed(self, piece: memoryview) -> None:
        i = 0
        while i < len(piece):
            take = min(CHUNK - self.filled, len(piece) - i)
            self.crc = zlib.crc32(piece[i : i + take], self.crc)
            self.filled += take
            i += take
            if self.filled == CHUNK:
                self.done.append(self.crc)
                self.crc, self.filled = 0, 0

    def result(self) -> tuple[int, ...]:
        return tuple([*self.done, self.crc] if self.filled or not self.done else self.done)


class ShardWriter:
    """Write one safetensors file whose tensors (``(name, dtype, shape)``, in
    order) arrive as pieces: ``write(name, piece)`` appends ``piece``'s
    bytes to tensor ``name`` (row blocks, say), so a file is written with one
    piece in memory at a time. ``close()`` checks every byte arrived, fsyncs
    and returns each tensor's chunk checksums.

    >>> import tempfile, os, torch, safetensors.torch
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> w = ShardWriter(path, [("a", torch.float32, (4, 2))])
    >>> w.write("a", torch.zeros(3, 2)); w.write("a", torch.ones(1, 2))
    >>> sums = w.close()
    >>> safetensors.torch.load_file(path)["a"][:, 0]
    tensor([0., 0., 0., 1.])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        meta = {**(metadata or {}), "format": "pt", "writer": "shardax"}
        header: dict[str, Any] = {"__metadata__": meta}
        start = 0
        self._sizes: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            if dtype not in _DTYPES:
                dtype_name(dtype)  # raises the clear error
            n = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [start, start + n],
            }
            self._sizes.append((name, n))
            start += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._i, self._left = -1, 0
        self._crc = Crc()
        self.sums: dict[str, tuple[int, ...]] = {}
        self._advance()

    def _advance(self) -> None:
        while self._left == 0 and self._i + 1 < len(self._sizes):
            if self._i >= 0:
                self.sums[self._sizes[self._i][0]] = self._crc.result()
            self._i += 1
            self._left = self._sizes[self._i][1]
            self._crc = Crc()
        if self._left == 0 and self._i >= 0 and self._sizes[self._i][0] not in self.sums:
            self.sums[self._sizes[self._i][0]] = self._crc.result()

    def write(self, name: str, piece: torch.Tensor) -> None:
        data = _bytes(piece.detach().cpu().contiguous())
        if not len(data):
            return
        current = self._sizes[self._i][0] if 0 <= self._i < len(self._sizes) else None
        if name != current or len(data) > self._left:
            raise CheckpointError(
                f"{self.path}: got {len(data)} bytes for {name!r}; expected bytes of {current!r} "
                f"({self._left} left)"
            )
        self._crc.feed(data)
        self._f.write(data)
        self._left -= len(data)
        self._advance()

    def abort(self) -> None:
        """Close the file without the checks (the caller removes it)."""
        self._f.close()

    def close(self) -> dict[str, tuple[int, ...]]:
        missing = [n for n, _ in self._sizes if n not in self.sums]
        if missing:
            self._f.close()
            raise CheckpointError(f"{self.path}: no bytes were written for {missing}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return self.sums


def write_safetensors(
    path: str | os.PathLike[str], tensors: Sequence[tuple[str, torch.Tensor]]
) -> dict[str, tuple[int, ...]]:
    """Write ``tensors`` as one safetensors file, streaming each straight
    from its memory; return each tensor's chunk checksums."""
    w = ShardWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors])
    for n, t in tensors:
        w.write(n, t)
    return w.close()


@attrs.frozen
class _Header:
    start: int  # file offset of the byte buffer
    tensors: dict[str, dict[str, Any]]


def read_header(f: BinaryIO, where: str) -> _Header:
    """The safetensors header of an open file."""
    f.seek(0)
    head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"{where} is truncated: no safetensors header")
    n = int.from_bytes(head, "little")
    if n > _MAX_HEADER:
        raise CheckpointError(f"{where} has a {n}-byte header: not a safetensors file")
    try:
        tensors = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where} has a corrupt safetensors header: {e}") from None
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{where} has a corrupt safetensors header: not a JSON object")
    tensors.pop("__metadata__", None)
    for name, meta in tensors.items():
        ok = isinstance(meta, dict) and {"dtype", "shape", "data_offsets"} <= set(meta)
        if not ok or len(meta["data_offsets"]) != 2:
            raise CheckpointError(f"{where} has a corrupt safetensors header entry {name!r}")
    return _Header(8 + n, tensors)


class Files:
    """Open safetensors files of one checkpoint, with their headers, by name."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._open: dict[str, tuple[BinaryIO, _Header]] = {}

    def get(self, name: str) -> tuple[BinaryIO, _Header]:
        if name not in self._open:
            path = self.root / safe_name(name)
            if path.is_symlink() and not path.resolve().is_relative_to(self.root.resolve()):
                raise CheckpointError(
                    f"{path} is a link to {path.resolve()}, outside the checkpoint; copy the file in"
                )
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed in close()
            except OSError as e:
                raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
            try:
                header = read_header(f, str(path))
            except CheckpointError:
                f.close()
                raise
            end = max((int(m["data_offsets"][1]) for m in header.tensors.values()), default=0)
            size = os.fstat(f.fileno()).st_size
            if size < header.start + end:
                f.close()
                raise CheckpointError(
                    f"{path} is truncated: {size} bytes, its header describes {header.start + end}"
                )
            self._open[name] = (f, header)
        return self._open[name]

    def close(self) -> None:
        for f, _ in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _locate(files: Files, box: Box, dtype: torch.dtype) -> tuple[BinaryIO, int]:
    """The open file holding ``box`` and the file offset of its first byte,
    after checking the header agrees with the index."""
    f, header = files.get(box.file)
    where = f"{box.file}:{box.name}"
    meta = header.tensors.get(box.name)
    if meta is None:
        raise CheckpointError(f"tensor {box.name!r} is missing from {box.file}")
    begin, end = _ints(meta["data_offsets"])
    if _BY_CODE.get(meta["dtype"]) != dtype or tuple(meta["shape"]) != box.sizes:
        raise CheckpointError(
            f"{where} holds {meta['dtype']} {tuple(meta['shape'])}; the index expects "
            f"{_DTYPES.get(dtype)} {box.sizes}"
        )
    if end - begin != box.numel * dtype.itemsize:
        raise CheckpointError(
            f"{where} has {end - begin} bytes; expected {box.numel * dtype.itemsize}"
        )
    return f, header.start + begin


def _read_span(f: BinaryIO, offset: int, into: memoryview, where: str) -> None:
    got = os.preadv(f.fileno(), [into], offset)
    if got != len(into):
        raise CheckpointError(f"{where} is truncated: read {got} of {len(into)} bytes")


def _verify(box: Box, nbytes: int, lo: int, pieces: Sequence[memoryview], where: str) -> None:
    """Check the chunks of ``box`` (``nbytes`` long) that ``pieces`` (its
    bytes from ``lo``, a chunk boundary, to a chunk boundary or the end) cover."""
    first = lo // CHUNK
    crc = Crc()
    for piece in pieces:
        crc.feed(piece)
    for i, s in enumerate(crc.result()):
        c = first + i
        if c >= len(box.crc32) or box.crc32[c] != s:
            raise CheckpointError(
                f"checksum mismatch in {where} (bytes {c * CHUNK}–{min((c + 1) * CHUNK, nbytes)} "
                "of the tensor): the file is corrupt; restore it from a copy or use an older "
                "checkpoint"
            )


def intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The overlap of two boxes as ``(offsets, sizes)``, or None."""
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_size, b_off, b_size, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _strides(sizes: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def row_blocks(
    offsets: Sequence[int], sizes: Sequence[int], row_bytes: int, limit: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a region along dim 0 into blocks of at most ``limit`` bytes (at
    least one row each)."""
    if not sizes:
        yield tuple(offsets), tuple(sizes)
        return
    rows = max(1, limit // max(row_bytes, 1))
    for r in range(0, sizes[0], rows):
        n = min(rows, sizes[0] - r)
        yield (offsets[0] + r, *offsets[1:]), (n, *sizes[1:])


COALESCE = 512
"""Unneeded bytes between two rows' spans always worth reading to save a read."""


def read_region(
    files: Files,
    box: Box,
    dtype: torch.dtype,
    offsets: Sequence[int],
    sizes: Sequence[int],
    out: torch.Tensor,
    *,
    verify: bool = True,
    limit: int = 64 << 20,
) -> None:
    """Copy the global region ``offsets``/``sizes`` (inside ``box``) into
    ``out`` (a tensor of shape ``sizes``, any dtype and device).

    The region is read in blocks of whole dim-0 rows of at most ``limit``
    bytes (one row at least). In each row only the span from the region's
    first to its last byte is needed; rows whose spans lie far apart (a few
    columns of a row-major box) are read separately, so without ``verify``
    a rank reads at most about twice what it needs, never the whole box for
    a slice of it. With ``verify``, the checksum chunks (``CHUNK`` bytes) the
    spans touch are read whole and checked.
    """
    f, base = _locate(files, box, dtype)
    where = f"{box.file}:{box.name}"
    item = dtype.itemsize
    nbytes = box.numel * item
    strides = _strides(box.sizes)
    rel = [o - b for o, b in zip(offsets, box.offsets, strict=True)]
    if not sizes:  # a 0-d tensor: one element
        _read_into(f, base, box, nbytes, 0, item, (), (), out, dtype, verify, where)
        return
    row = strides[0] * item
    inner = list(zip(rel[1:], sizes[1:], strides[1:], strict=True))
    head = sum(o * s for o, _, s in inner) * item  # the region's first byte within a row
    tail = sum((o + n - 1) * s for o, n, s in inner) * item + item  # and its end
    gap = row - (tail - head)  # unneeded bytes between two rows' spans
    # Read rows together when the gaps cost at most what is needed (without
    # verify), or when they share checksum chunks anyway (with it).
    far = CHUNK if verify else max(COALESCE, tail - head)
    for blk_off, blk_size in row_blocks(rel, sizes, row, limit):
        rows = blk_size[0]
        if rows == 0 or math.prod(blk_size) == 0:
            continue
        step = rows if gap <= far else 1  # rows read together
        for g in range(0, rows, step):
            n = min(step, rows - g)
            r0 = blk_off[0] + g
            first, last = r0 * row + head, (r0 + n - 1) * row + tail
            dst = out.narrow(0, r0 - rel[0], n)
            shape = (n, *sizes[1:])
            _read_into(f, base, box, nbytes, first, last, shape, strides, dst, dtype, verify, where)


def _read_into(
    f: BinaryIO,
    base: int,
    box: Box,
    nbytes: int,
    first: int,
    last: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dst: torch.Tensor,
    dtype: torch.dtype,
    verify: bool,
    where: str,
) -> None:
    """Read bytes ``[first, last)`` of ``box`` and copy the elements at
    ``strides`` from ``first`` (``shape`` of them) into ``dst``."""
    contiguous = last - first == math.prod(shape) * dtype.itemsize
    direct = contiguous and dst.is_contiguous() and dst.dtype == dtype and dst.device.type == "cpu"
    if direct:
        body = _bytes(dst)
        tmp = None
    else:
        tmp = torch.empty(last - first, dtype=torch.uint8)
        body = _bytes(tmp)
    _read_span(f, base + first, body, where)
    if verify:
        lo, hi = first // CHUNK * CHUNK, min(-(-last // CHUNK) * CHUNK, nbytes)
        before, after = bytearray(first - lo), bytearray(hi - last)
        _read_span(f, base + lo, memoryview(before), where)
        _read_span(f, base + last, memoryview(after), where)
        _verify(box, nbytes, lo, [memoryview(before), body, memoryview(after)], where)
    if tmp is not None:
        dst.copy_(tmp.view(dtype).as_strided(shape, strides, 0))
