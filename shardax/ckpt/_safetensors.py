"""The checkpoint's safetensors files: a writer that streams boxes with
their CRC-32 checksums (:class:`ShardWriter`), and the reader that fills a
region of a global tensor from the boxes that hold it, verifying just the
checksum pieces it reads (:func:`read_region`). Plain safetensors: any
safetensors reader opens the files; nothing here unpickles or runs code.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import torch

from ..errors import CheckpointError
from ..shard._memory import release_all
from ._format import _BY_CODE, _DTYPES, _MAX_HEADER, CHUNK, Box, _ints, dtype_name, safe_name

__all__ = [
    "COALESCE",
    "Crc",
    "Files",
    "ShardWriter",
    "checksums",
    "intersect",
    "read_header",
    "read_region",
    "row_blocks",
    "write_safetensors",
]


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
    from its memory; return each tensor's chunk checksums. A disk tensor
    (``rules.offload``) is handed back to its file once written: the file
    is written with one such tensor's pages in the process at a time."""
    w = ShardWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors])
    for n, t in tensors:
        w.write(n, t)
        release_all([t])
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
