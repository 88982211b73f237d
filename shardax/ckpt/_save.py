"""``save`` and ``save_async``: every rank writes the boxes it owns, rank 0
writes the index and commits the directory with a rename.

Ranks agree through torch.distributed's key-value store, not through
collectives, so a background save never interleaves with the training
step's collectives, and a save some rank never joins times out with the
missing ranks named instead of hanging.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import itertools
import json
import math
import os
import random
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import optree
import torch
import torch.distributed as dist

from .._tree import render_path
from ..errors import CheckpointError
from ..mesh._mesh import Mesh
from ..mesh._runtime import _timeout_seconds
from ..shard._layout import Layout
from ..shard._memory import allocate, as_piece_of, is_disk, kind_of, release, release_all
from ..shard._sharded import Sharded
from ..shard._spec import P
from ..shard._transfer import transfer
from ._format import (
    FORMAT,
    INDEX,
    Box,
    Index,
    TensorEntry,
    ValueEntry,
    dtype_name,
    write_index,
)
from ._owners import agree_on_owners
from ._safetensors import write_safetensors

__all__ = ["AsyncSave", "save", "save_async"]

# save() is collective and called in the same order on every rank, so each
# rank numbers its saves alike; the number keys that save in the store.
_SEQ = itertools.count()
RNG_PREFIX = "__rng__."
"""Tensor names of the RNG states (reserved: no leaf's path may start so)."""
_LOCK = threading.Lock()
_IN_FLIGHT: list[AsyncSave] = []  # at most one background save per process


def _key_of(entry: Any) -> Any:
    key = getattr(entry, "field", None) or entry.entry
    return key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)


def flatten(tree: Any) -> tuple[list[str], list[tuple[Any, ...]], list[Any]]:
    """``(paths, keys, leaves)`` with ``Sharded`` and None as leaves."""
    accessors, leaves, _ = optree.tree_flatten_with_accessor(
        tree, is_leaf=lambda x: isinstance(x, Sharded), none_is_leaf=True
    )
    keys = [tuple(_key_of(e) for e in a) for a in accessors]
    return [render_path(k) for k in keys], keys, leaves


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _json_value(path: str, x: Any) -> Any:
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CheckpointError(
        f"cannot store {type(x).__name__} at {path!r}: a checkpoint holds tensors, Sharded values "
        "and JSON scalars (int, float, str, bool, None) — convert it (e.g. to a tensor or a dict of "
        "scalars) before saving"
    )


def box_name(path: str, offsets: tuple[int, ...]) -> str:
    """The safetensors tensor name of the box of ``path`` at ``offsets``."""
    return f"{path}@{','.join(map(str, offsets))}"


def _file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def _sharded_boxes(path: str, x: Sharded, world: int) -> list[tuple[int, tuple, tuple]]:
    if x.partial:
        raise CheckpointError(
            f"{path!r} is a pending sum over {x.partial!r} ({x.layout!r}); transfer it to a "
            "layout without partial axes before saving"
        )
    mesh = x.mesh
    members = getattr(mesh, "members", None)  # a submesh (a pipeline stage's): its job ranks
    if members is None and mesh.world_size != world:
        raise CheckpointError(
            f"{path!r} lives on {mesh!r} ({mesh.world_size} ranks) but the job has {world}; "
            "save values on meshes over every rank (or a submesh of one)"
        )
    boxes = distinct_boxes(x.layout, x.shape)
    if members is None:
        return boxes
    return [(members[owner], offsets, sizes) for owner, offsets, sizes in boxes]


def distinct_boxes(layout: Layout, shape: tuple[int, ...]) -> list[tuple[int, tuple, tuple]]:
    """``(owner, offsets, sizes)`` of each distinct non-empty box of a global
    tensor of ``shape`` laid out by ``layout``, owned by the lowest rank that
    holds it."""
    seen: set[tuple] = set()
    out = []
    for r in range(layout.mesh.world_size):
        for offsets, sizes in layout.local_boxes(shape, r):  # several for blocked dims
            if (offsets, sizes) in seen or math.prod(sizes) == 0:
                continue
            seen.add((offsets, sizes))
            out.append((r, offsets, sizes))
    return out


@attrs.frozen
class _Plan:
    """What this rank writes (``items``) and the index it belongs to (the
    checksums still empty)."""

    rank: int
    world: int
    items: list[tuple[str, torch.Tensor]]
    index: Index
    python_rng: Any
    timeout: float
    spare: list[tuple[str, torch.Tensor]] = attrs.field(factory=list)
    disk: list[torch.Tensor] = attrs.field(factory=list)  # disk tensors read: handed back after


def _rng_items(rank: int) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    items = [(f"{RNG_PREFIX}torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
        items += [(f"{RNG_PREFIX}cuda.{i}", s) for i, s in enumerate(cuda)]
    version, state, gauss = random.getstate()
    return items, [version, list(state), gauss]


def plan(tree: Any, metadata: Mapping[str, Any] | None, *, rng: bool, copy: bool) -> _Plan:
    """Walk ``tree``: the index (every rank computes the same one) and this
    rank's boxes (copied to CPU when ``copy``, for a background write)."""
    rank, world = _world()
    paths, keys, leaves = flatten(tree)
    if len(set(paths)) != len(paths):
        dup = sorted({p for p in paths if paths.count(p) > 1})
        raise CheckpointError(f"two leaves render to the same key path {dup!r}; rename the keys")
    try:
        meta = json.loads(json.dumps(dict(metadata or {})))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"metadata must be JSON (dicts, lists, str, numbers, bool, None): {e}"
        ) from None
    items: list[tuple[str, torch.Tensor]] = []
    spare: list[tuple[str, torch.Tensor]] = []  # plain tensors another rank may lack
    disk: list[torch.Tensor] = []  # tensors on disk (rules.offload) the save reads
    entries: dict[str, Any] = {}
    mesh: dict[str, int] = {}
    timeout = None
    for path, x in zip(paths, leaves, strict=True):
        if path.startswith(RNG_PREFIX.rstrip(".")):
            raise CheckpointError(
                f"{path!r}: key paths starting with {RNG_PREFIX.rstrip('.')!r} are reserved for "
                "the RNG states; rename the key"
            )
        views: dict[tuple[int, ...], torch.Tensor] = {}
        if isinstance(x, Sharded):
            if x.layout.diverged:  # each rank's own copy: saved as their mean (collective)
                x = transfer(x, x.layout.settled())
            boxes = _sharded_boxes(path, x, world)
            layout_mesh, spec, local = x.mesh.shape, x.spec, x.local
            # this rank's piece: one box, or one per block of a blocked dim
            at = x.mesh.rank if isinstance(x.mesh, Mesh) else rank  # its place in the mesh
            views = {o: v for o, _, v in x.layout.box_views(x.local, x.shape, at)}
            mesh = mesh or layout_mesh
            if isinstance(x.mesh, Mesh) and x.mesh.timeout is not None:
                timeout = x.mesh.timeout
        elif isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                raise CheckpointError(f"{path!r} is a meta tensor: it has no values to save")
            sizes = tuple(x.shape)
            boxes = [(0, (0,) * x.ndim, sizes)] if math.prod(sizes) or not sizes else []
            layout_mesh, spec, local = {}, None, x
        else:
            entries[path] = ValueEntry(_json_value(path, x))
            continue
        stored = []
        for owner, offsets, sizes in boxes:
            name = box_name(path, offsets)
            stored.append(Box(offsets, sizes, _file(owner, world), name))
            if owner == rank or (spec is None and rank):  # plain: rank 0's, unless it lacks it
                t = (views[offsets] if views else local).detach().contiguous()
                t = as_piece_of(t, local)  # on disk: written, its pages go back to the file
                if copy:  # a snapshot where the value lives: on disk for disk state
                    t = _snapshot(t, local)
                (items if owner == rank else spare).append((name, t))
                disk += [u for u in (local, t) if is_disk(u)]
        try:
            dtype = dtype_name(local.dtype)
        except CheckpointError as e:
            raise CheckpointError(f"{path!r}: {e}") from None
        entries[path] = TensorEntry(
            x.shape, dtype, spec if spec is not None else P(), layout_mesh, stored
        )
    python_rng = None
    if rng:
        rng_items, python_rng = _rng_items(rank)
        items += [(n, t.clone()) for n, t in rng_items]
    index = Index(mesh, world, meta, entries, dict(zip(paths, keys, strict=True)))
    return _Plan(rank, world, items, index, python_rng, _timeout_seconds(timeout), spare, disk)


def _snapshot(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (a piece of ``local``) for a background save: in
    RAM, or for disk state in another file — not the state's size in RAM."""
    if not is_disk(local):
        return t.to("cpu", copy=True)
    out = allocate(t.shape, t.dtype, kind_of(local))
    out.copy_(t)
    release(out)
    release(t)  # the pages the copy read: back to the file, one piece at a time
    return out


class _Store:
    """The save's rendezvous in torch.distributed's store (world size > 1)."""

    def __init__(self, seq: int, world: int, timeout: float) -> None:
        self.prefix = f"shardax/ckpt/{seq}/"
        self.world = world
        self.timeout = timeout
        self.store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self.local: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        if self.store is None:
            self.local[key] = value
        else:
            self.store.set(self.prefix + key, value)

    def get(self, keys: list[str], what: str) -> list[str]:
        if self.store is None:
            return [self.local[k] for k in keys]
        full = [self.prefix + k for k in keys]
        try:
            self.store.wait(full, timedelta(seconds=self.timeout))
        except Exception:  # the store raises DistStoreError or RuntimeError by version
            missing = [k for k, f in zip(keys, full, strict=True) if not self.store.check([f])]
            raise CheckpointError(
                f"checkpoint save: {what} did not arrive within {self.timeout:g}s (missing: "
                f"{missing}); save() is collective — call it on every rank, with the same path"
            ) from None
        return [self.store.get(f).decode() for f in full]

    def clear(self) -> None:
        """Delete this save's keys (rank 0, once every rank is past them)."""
        if self.store is None:
            return
        per_rank = ("rank", "digest", "tree")
        keys = [f"{k}{r}" for k in per_rank for r in range(self.world)]
        for key in ["ready", "done", "merged", *keys]:
            try:
                self.store.delete_key(self.prefix + key)
            except Exception:  # a store without deletion keeps them: harmless
                return


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory holding a shardax ``index.json``."""
    try:
        with open(path / INDEX) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(final: Path) -> None:
    """Refuse to write a checkpoint where something else lives."""
    if final.exists() and not final.is_dir():
        raise CheckpointError(
            f"{final} is a file; a checkpoint is a directory — choose another path"
        )
    if final.is_dir() and any(final.iterdir()) and not is_checkpoint(final):
        raise CheckpointError(
            f"refusing to replace {final}: it exists and is not a shardax checkpoint (no shardax "
            f"{INDEX}); remove it or choose another path"
        )


def _recover(final: Path) -> None:
    """Finish a commit a crash interrupted between its two renames: the
    previous checkpoint, set aside as ``.NAME.old``, goes back in place."""
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and is_checkpoint(old):
        os.rename(old, final)


def _prepare(final: Path) -> Path:
    _recover(final)
    check_replaceable(final)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the OS or filesystem cannot."""
    if _RENAMEAT2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = _RENAMEAT2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def _commit(tmp: Path, final: Path) -> None:
    """Swap ``tmp`` into place: a reader sees the old checkpoint or the new
    one, whenever it looks — also if this process dies here."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists() and _exchange(tmp, final):
        _fsync_dir(final.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
        return
    if final.exists():  # two renames; a crash between them is undone by _recover
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _renameat2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2() if sys.platform.startswith("linux") else None


def _assemble(index: Index, reports: list[dict[str, Any]]) -> Index:
    sums: dict[str, list[int]] = {}  # box names are unique; RNG names repeat per rank
    for rep in reports:
        sums.update(rep["sums"])
    leaves = {
        p: attrs.evolve(e, boxes=[attrs.evolve(b, crc32=sums[b.name]) for b in e.boxes])
        if isinstance(e, TensorEntry)
        else e
        for p, e in index.leaves.items()
    }
    rng = {}
    for r, rep in enumerate(reports):
        tensors = {
            n: Box([0] * len(shape), shape, _file(r, index.world_size), n, rep["sums"][n])
            for n, shape in rep["rng"].items()
        }
        if tensors:
            rng[r] = {"python": rep["python"], "tensors": tensors}
    return attrs.evolve(index, leaves=leaves, rng=rng)


def _failed(final: Path, e: BaseException) -> CheckpointError:
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(f"checkpoint save to {final} failed: {type(e).__name__}: {e}")


def _write(p: _Plan, final: Path, seq: int, on_commit: Callable[[], None] | None) -> None:
    """Every rank's part of a save (runs inline or in the background thread).

    Whatever fails, rank 0 still publishes the outcome, so no rank waits out
    the timeout for a save that has already failed elsewhere."""
    store = _Store(seq, p.world, p.timeout)
    tmp = final.with_name(f".{final.name}.tmp")
    if p.rank == 0:
        try:
            _prepare(final)
        except Exception as e:
            store.set("ready", f"error: {e}")
            raise _failed(final, e) from e
        store.set("ready", "ok")
    else:
        (ready,) = store.get(["ready"], "rank 0's start")
        if ready != "ok":
            raise CheckpointError(f"checkpoint save to {final} failed on rank 0: {ready[7:]}")
    mine = _file(p.rank, p.world)
    try:
        index, items = agree_on_owners(p.index, p.items, p.spare, p.rank, p.world, store, mine)
        p = attrs.evolve(p, index=index, items=items, spare=[])
        sums = write_safetensors(tmp / mine, p.items) if p.items else {}
        release_all(p.disk)  # the disk state read for it: out of this process again
        rng = {n: list(t.shape) for n, t in p.items if n.startswith(RNG_PREFIX)}
        report: dict[str, Any] = {"sums": sums, "rng": rng, "python": p.python_rng}
    except Exception as e:
        report = {"error": f"rank {p.rank} could not write {mine}: {type(e).__name__}: {e}"}
        store.set(f"rank{p.rank}", json.dumps(report))
        if p.rank != 0:
            raise _failed(final, e) from e
    else:
        store.set(f"rank{p.rank}", json.dumps(report))
    if p.rank == 0:
        try:
            raw = store.get([f"rank{r}" for r in range(p.world)], "the shards of every rank")
            reports = [json.loads(s) for s in raw]
            errors = [r["error"] for r in reports if "error" in r]
            if errors:
                raise CheckpointError(f"checkpoint save to {final} failed: {'; '.join(errors)}")
            write_index(tmp, _assemble(p.index, reports))
            _fsync_dir(tmp)
            _commit(tmp, final)
            if on_commit is not None:
                on_commit()
        except Exception as e:
            store.set("done", f"error: {e}")
            raise _failed(final, e) from e
        store.set("done", "ok")
        # every rank has started this save, so all have read the last one's keys
        _Store(seq - 1, p.world, p.timeout).clear()
    else:
        (done,) = store.get(["done"], "rank 0's commit")
        if done != "ok":
            raise CheckpointError(f"checkpoint save to {final} failed: {done[7:]}")


class AsyncSave:
    """A save running in a background thread: ``wait()`` blocks until the
    checkpoint is committed and raises what went wrong, ``done()`` polls."""

    def __init__(self, path: Path, run: Callable[[], None]) -> None:
        self.path = path
        self._error: BaseException | None = None

        def target() -> None:
            try:
                run()
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=target, name=f"shardax-save {path}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until committed; the checkpoint's path. Raises the save's error."""
        self._thread.join()
        with _LOCK:
            if self in _IN_FLIGHT:
                _IN_FLIGHT.remove(self)
        if self._error is not None:
            raise CheckpointError(
                f"background save to {self.path} failed: {self._error}"
            ) from self._error
        return self.path

    def __repr__(self) -> str:
        return f"AsyncSave({str(self.path)!r}, done={self.done()})"


def _finish_at_exit() -> None:
    """A background save still running at exit is waited for, not lost."""
    try:
        wait_pending()
    except CheckpointError as e:
        print(f"shardax: {e}", file=sys.stderr)


atexit.register(_finish_at_exit)


def wait_pending() -> None:
    """Finish the background save in flight, if any (raising its error)."""
    with _LOCK:
        pending = list(_IN_FLIGHT)
    for h in pending:
        h.wait()


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    rng: bool = True,
    _on_commit: Callable[[], None] | None = None,
) -> Path:
    """Save a pytree of ``Sharded`` values, tensors and JSON scalars to the
    directory ``path``. Collective: call it on every rank.

    Each distinct shard is written once, by the lowest rank holding it, into
    a temporary sibling directory; rank 0 then writes ``index.json`` and
    renames the directory into place — a crash at any moment leaves the
    previous checkpoint or the complete new one. Plain tensors are taken to be
    the same on every rank (rank 0's copy is written); a value diverged over
    some axes (each rank's own copy: 0/1 Adam's local steps) is saved as
    the ranks' mean, what its layout says it is. With ``rng``, each
    rank's RNG states (torch, CUDA, Python ``random``) are saved too; restore
    them with ``load(..., rng=True)``.

    Args:
        path: the checkpoint directory (created; an old checkpoint there is
            replaced).
        tree: the pytree to save (params, optimizer state, step, …).
        metadata: JSON-able user data, returned by ``read_index(path).metadata``.
        rng: also save every rank's RNG states.

    Returns the checkpoint's path.

    >>> import tempfile, torch, shardax as sx
    >>> mesh = sx.Mesh({"dp": 1})
    >>> tree = {"w": sx.shard(torch.arange(6.0).reshape(3, 2), mesh, sx.P("dp")), "step": 3}
    >>> d = tempfile.mkdtemp()
    >>> _ = sx.ckpt.save(f"{d}/ckpt", tree, metadata={"run": "demo"})
    >>> sx.ckpt.load(f"{d}/ckpt", tree)["step"]
    3
    """
    wait_pending()
    final = Path(path).absolute()
    p = plan(tree, metadata, rng=rng, copy=False)
    _write(p, final, next(_SEQ), _on_commit)
    return final


def save_async(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    metadata: Mapping[str, Any] | None = None,
    rng: bool = True,
    _on_commit: Callable[[], None] | None = None,
) -> AsyncSave:
    """Like :func:`save`, but return once this rank's shards are copied to
    CPU memory; the files are written and committed in a background thread.
    At most one background save is in flight: a new save (either kind) first
    waits for the previous one and raises its error, if any. Call
    ``handle.wait()`` before exiting.

    >>> import tempfile, torch, shardax as sx
    >>> d = tempfile.mkdtemp()
    >>> handle = sx.ckpt.save_async(f"{d}/ckpt", {"w": torch.ones(2)})
    >>> handle.wait().name
    'ckpt'
    """
    wait_pending()
    final = Path(path).absolute()
    p = plan(tree, metadata, rng=rng, copy=True)
    seq = next(_SEQ)
    handle = AsyncSave(final, lambda: _write(p, final, seq, _on_commit))
    with _LOCK:
        _IN_FLIGHT.append(handle)
    return handle
