"""Memory kinds: where a role's local data lives — ``"device"`` (the
rank's device: its GPU, or RAM on a CPU rank), ``"host"`` (pinned CPU
memory beside a GPU; RAM on a CPU rank) or ``"disk:PATH"`` (files in the
folder ``PATH``) — and :class:`Offload`, the rule entry that puts a role of
matching parameters in one (``rules.offload``).

A disk tensor is an ordinary CPU tensor whose storage is a shared,
writable memory map of its own file, created in the folder and unlinked at
once (nothing is left behind, whatever ends the process). Code that reads
or writes it pages it in from the file; :func:`release` hands a range back
to the file (its pages leave the process: the written ones go to the file,
through the page cache), :func:`prefetch` asks the kernel to read a range
ahead (asynchronous readahead). The optimizer's fused step streams such
state in waves: the next wave read ahead while the kernel updates this
one, each wave released once written — so the process holds a wave or
two, not the state.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import re
import tempfile
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from ..errors import ShardingError

__all__ = [
    "KINDS", "Offload", "allocate", "as_piece_of", "check_kind", "is_disk", "kind_of",
    "offloaded", "placed", "prefetch", "prefetch_all", "release", "release_all", "restored",
]  # fmt: skip

KINDS = ("device", "host", "disk")
"""The memory kinds; ``"disk"`` is written ``"disk:PATH"`` (its folder)."""

_ROLES = ("params", "grads", "opt_state")
_PAGE = mmap.PAGESIZE


def check_kind(kind: Any) -> str:
    """``kind``, checked: ``"device"``, ``"host"`` or ``"disk:PATH"``.

    >>> check_kind("disk:/tmp/state")
    'disk:/tmp/state'
    >>> check_kind("nvme")
    Traceback (most recent call last):
    ...
    shardax.errors.ShardingError: a memory kind is 'device', 'host' or 'disk:PATH' (a folder for the files); got 'nvme'
    """
    if isinstance(kind, str) and (kind in ("device", "host") or kind.startswith("disk:")):
        if kind == "disk:":
            raise ShardingError("a disk memory kind names its folder: 'disk:PATH'")
        return kind
    raise ShardingError(
        f"a memory kind is 'device', 'host' or 'disk:PATH' (a folder for the files); got {kind!r}"
    )


def _roles(value: str | Iterable[str]) -> tuple[str, ...]:
    roles = (value,) if isinstance(value, str) else tuple(value)
    for role in roles:
        if role not in _ROLES:
            raise ShardingError(
                f"offload places the roles {_ROLES!r} (the parameters' shards, their reduced "
                f"gradients, the optimizer state with any master weights); got {role!r}"
            )
    return roles


@attrs.frozen(repr=False)
class Offload:
    """Put the ``roles`` of the parameters matching ``pattern`` (a regex
    over key paths) in memory ``kind`` (:func:`check_kind`).

    >>> Offload("opt_state", "disk:/tmp/opt")
    Offload('opt_state', 'disk:/tmp/opt')
    """

    roles: tuple[str, ...] = attrs.field(converter=_roles)
    kind: str = attrs.field(converter=check_kind)
    pattern: str = ".*"
    _regex: re.Pattern[str] = attrs.field(init=False, eq=False)

    @_regex.default
    def _make_regex(self) -> re.Pattern[str]:
        try:
            return re.compile(self.pattern)
        except re.error as err:
            raise ShardingError(f"Offload pattern {self.pattern!r}: {err}") from None

    def matches(self, path: str) -> bool:
        return self._regex.fullmatch(path) is not None

    def __repr__(self) -> str:
        roles = self.roles[0] if len(self.roles) == 1 else self.roles
        pattern = "" if self.pattern == ".*" else f", pattern={self.pattern!r}"
        return f"Offload({roles!r}, {self.kind!r}{pattern})"


def allocate(
    shape: Iterable[int], dtype: torch.dtype, kind: str, device: Any = "cpu"
) -> torch.Tensor:
    """Zeros of ``shape`` in memory ``kind``: on ``device``; pinned host
    memory (RAM where no GPU is); or a file in the disk kind's folder. On
    ``meta`` (shapes only: a target to load into), a meta tensor that
    records the kind (:func:`kind_of`; ``ckpt.load`` fills it there)."""
    shape = tuple(int(n) for n in shape)
    kind = check_kind(kind)
    if kind == "device":
        return torch.zeros(shape, dtype=dtype, device=device)
    if torch.device(device).type == "meta":
        return _meta_in(torch.zeros(shape, dtype=dtype, device="meta"), kind)
    if torch.device(device).type != "cpu":
        raise ShardingError(
            f"memory kind {kind!r} for a tensor on {torch.device(device)}: offload runs on CPU "
            "ranks only so far (the optimizer steps state where the parameters are; a GPU rank's "
            "host-side step is not there yet) — keep these roles on the device there"
        )
    if kind == "host":
        pinned = torch.cuda.is_available()
        return torch.zeros(shape, dtype=dtype, pin_memory=pinned)
    return _disk(kind[len("disk:") :], shape, dtype)


def _meta_in(t: torch.Tensor, kind: str) -> torch.Tensor:
    t._shardax_kind = kind  # type: ignore[attr-defined]
    return t


def _disk(folder: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix="shardax-", suffix=".bin")
    except OSError as err:
        raise ShardingError(
            f"memory kind 'disk:{folder}': cannot create a file there ({err}); name a writable "
            "folder on a local disk"
        ) from None
    try:
        os.unlink(name)  # the map keeps the file; nothing is left behind
        if hasattr(os, "posix_fallocate"):  # the blocks now: a full disk fails here, not later
            os.posix_fallocate(fd, 0, nbytes)  # (a sparse file's first write there: SIGBUS)
        else:
            os.ftruncate(fd, nbytes)
        tensor = torch.frombuffer(_Mapping.of(fd, nbytes), dtype=dtype)
    except OSError as err:
        raise ShardingError(
            f"memory kind 'disk:{folder}': cannot map {nbytes:,} bytes there ({err}); is the "
            "disk full?"
        ) from None
    finally:
        os.close(fd)
    tensor = tensor.view(shape)
    tensor._shardax_map = (tensor.data_ptr(), nbytes)  # type: ignore[attr-defined]
    tensor._shardax_kind = f"disk:{folder}"  # type: ignore[attr-defined]
    return tensor


class _Mapping:
    """One shared, writable map of a file, unmapped when the last tensor on
    it is freed. By libc, not :mod:`mmap`: an ``mmap`` object keeps a
    descriptor of its file open, and a model's thousands of tensors on disk
    would reach a 1024-file limit; nor by ``torch.from_file``, whose storage
    counts as shared memory (``torch.multiprocessing`` then fails to pass
    it)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    @classmethod
    def of(cls, fd: int, nbytes: int) -> Any:
        """The first ``nbytes`` of file ``fd``, mapped: a ctypes buffer
        that owns its map."""
        libc = _libc()
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
        address = libc.mmap(None, nbytes, prot, flags, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        buffer = (ctypes.c_char * nbytes).from_address(address)
        buffer.owner = cls(address, nbytes)  # type: ignore[attr-defined]
        return buffer

    def __del__(self) -> None:
        _libc().munmap(self.address, self.nbytes)


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.munmap.restype = ctypes.c_int
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


def placed(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t``'s values in memory ``kind`` (``t`` itself where it is there)."""
    if kind == kind_of(t) or (kind == "host" and not torch.cuda.is_available()):
        return t
    if t.is_meta:
        return _meta_in(t.detach(), kind)
    out = allocate(t.shape, t.dtype, kind, t.device)
    out.copy_(t)
    if is_disk(out):
        release(out)  # written: to its file, out of this process
    return out


def offloaded(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A copy of activation ``t`` in memory ``kind`` — ``"host"`` (pinned,
    copied asynchronously, beside a GPU) or ``"disk:PATH"`` — that
    :func:`restored` brings back to ``t``'s device — with ``t``'s strides
    (code after it takes the same paths: a reshape that copied copies
    again). ``t`` itself where it is not dense (its strides leave gaps), or
    where ``"host"`` is where it is already (a CPU tensor)."""
    if not _dense(t) or (kind == "host" and not t.is_cuda):
        return t
    t = t.detach()
    if kind == "host":
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=t.is_cuda)
        out.copy_(t, non_blocking=t.is_cuda)
    else:
        flat = allocate((t.numel(),), t.dtype, kind)
        out = flat.as_strided(t.shape, t.stride())
        out.copy_(t)
        if is_disk(flat):
            release(flat)
    out._shardax_home = t.device  # type: ignore[attr-defined]
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its extent exactly, in some order of
    its dims (a transposed tensor is; a sliced or broadcast one is not)."""
    extent = 1
    dims = zip(t.stride(), t.shape, strict=True)
    for stride, size in sorted((s, n) for s, n in dims if n != 1):
        if stride != extent:
            return False
        extent *= size
    return True


def restored(t: torch.Tensor) -> torch.Tensor:
    """:func:`offloaded`'s copy back on the device it came from (a disk
    copy on a CPU rank is used where it is: read, it pages in)."""
    home = getattr(t, "_shardax_home", t.device)
    return t if home == t.device else t.to(home, non_blocking=True)


def release_all(tensors: Iterable[Any]) -> None:
    """:func:`release` every disk tensor among ``tensors`` (others: nothing)."""
    for t in tensors:
        if is_disk(t):
            release(t)


def prefetch_all(tensors: Iterable[Any]) -> None:
    """:func:`prefetch` every disk tensor among ``tensors``."""
    for t in tensors:
        if is_disk(t):
            prefetch(t)


def kind_of(t: Any) -> str:
    """The memory kind ``t`` lives in: ``"disk:PATH"`` for a disk tensor,
    else ``"host"`` (pinned) or ``"device"``."""
    kind = getattr(t, "_shardax_kind", None)
    if kind is not None and (not kind.startswith("disk:") or t.is_meta or is_disk(t)):
        return kind
    return "host" if isinstance(t, torch.Tensor) and t.is_pinned() else "device"


def is_disk(t: Any) -> bool:
    """Whether ``t`` is a disk tensor (:func:`allocate` with a disk kind):
    marked so, and still on its map — a copy that carried the mark along
    (``torch.save`` and load, ``copy.deepcopy``, ``share_memory_``) is not."""
    mapped = getattr(t, "_shardax_map", None)
    return mapped is not None and t.untyped_storage().data_ptr() == mapped[0]


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that stays a disk tensor where ``t`` is one (a traced
    parameter's shard is still handed back to its file after its gather)."""
    out = t.detach()
    if is_disk(t):
        out._shardax_map = t._shardax_map  # type: ignore[attr-defined]
        out._shardax_kind = t._shardax_kind  # type: ignore[attr-defined]
    return out


def as_piece_of(t: torch.Tensor, home: torch.Tensor) -> torch.Tensor:
    """``t``, a tensor on ``home``'s storage (a detached view of a piece of
    it), marked as a disk tensor where ``home`` is one, so that
    :func:`release` hands back the pages of that piece alone; ``t`` as it
    is otherwise (a copy elsewhere, or ``home`` in memory)."""
    same = t.untyped_storage().data_ptr() == home.untyped_storage().data_ptr()
    if is_disk(home) and same:
        t._shardax_map = home._shardax_map  # type: ignore[attr-defined]
        t._shardax_kind = home._shardax_kind  # type: ignore[attr-defined]
    return t


def _advise(t: torch.Tensor, start: int, count: int, advice: int) -> None:
    if not is_disk(t):  # a copy that carried the mark: its pages are its own
        return
    base, length = t._shardax_map  # type: ignore[attr-defined]
    lo = t.data_ptr() + start * t.element_size()
    first = max(base, lo - (lo - base) % _PAGE)
    end = min(
        base + -(-length // _PAGE) * _PAGE, -(-(lo + count * t.element_size()) // _PAGE) * _PAGE
    )
    if end > first:
        _libc().madvise(first, end - first, advice)


def prefetch(t: torch.Tensor, start: int = 0, count: int | None = None) -> None:
    """Ask the kernel to read elements ``start … start+count`` of disk
    tensor ``t`` ahead, asynchronously."""
    _advise(t, start, t.numel() - start if count is None else count, mmap.MADV_WILLNEED)


def release(t: torch.Tensor, start: int = 0, count: int | None = None) -> None:
    """Hand elements ``start … start+count`` of disk tensor ``t`` back to
    its file: their pages leave the process (written ones reach the file
    through the page cache); reading them again pages them back in."""
    _advise(t, start, t.numel() - start if count is None else count, mmap.MADV_DONTNEED)
