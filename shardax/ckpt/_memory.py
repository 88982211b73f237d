"""In-memory checkpoints: every few steps each rank writes its shards into
host memory, and its peer keeps a copy; a restart after a lost rank rebuilds
the state from what survives, on any mesh, with no disk involved.

They are ordinary shardax checkpoints (the same files and index as
:func:`~shardax.ckpt.save`'s) kept somewhere else: this rank's own file and
its peer's copy live in the rank's *slot* of host memory, a folder in
``/dev/shm`` that ``shardax launch --max-restarts``/``--elastic`` keeps
across restarts (``SHARDAX_MEMORY_DIR``) and removes when it exits. A slot's
folder holds, per snapshot, ``step-NNNNNNNN/`` with

- ``rank-RRRRR-of-WWWWW.safetensors`` — a saving rank's boxes — and
  ``rank-RRRRR-of-WWWWW.json``, its checksums and RNG state: the rank's
  own, and those of each rank whose peer it is (sent over a gloo group and
  written here by this rank);
- ``index.partial.json`` — the index without checksums (the same on every
  rank).

A snapshot is written into ``.step-NNNNNNNN.tmp`` and renamed once this
rank's own file and its peer copies are in; after every rank has renamed,
each deletes its older snapshots. A snapshot is complete when, over the
slots that remain, every saving rank's file is somewhere: it survives the
loss of any ranks as long as a rank and its peer are not both lost (a rank
on another node, when there are nodes). Restoring gathers the files each
node lacks over the gloo group, links the rest, and loads them with
:func:`~shardax.ckpt.load` — on the new mesh, whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..errors import CheckpointError
from ._format import Index, write_index
from ._load import load
from ._owners import _merge
from ._peers import Transport, node_key, peers_of, read_bytes, write_bytes
from ._safetensors import write_safetensors
from ._save import RNG_PREFIX, _assemble, _file, plan

__all__ = ["MEMORY_ENV", "MemoryCheckpointManager", "MemorySnapshot"]

MEMORY_ENV = "SHARDAX_MEMORY_DIR"
PARTIAL = "index.partial.json"
_STEP = re.compile(r"step-(\d{8,})")
_PIECE = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")


def _every(_: Any, __: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"MemoryCheckpointManager every must be a positive int; got {value!r}"
        )


def _directory(value: Any) -> Path | None:
    return None if value is None else Path(value).absolute()


@attrs.frozen
class MemorySnapshot:
    """The newest in-memory checkpoint the ranks can rebuild together.

    Attributes:
        step: its step.
        world_size: the number of ranks that saved it.
        from_peers: the saving ranks whose own copy is gone (their slot was
            lost): their shards come from their peers' copies.
    """

    step: int
    world_size: int
    from_peers: tuple[int, ...] = ()


@attrs.frozen
class MemoryCheckpointManager:
    """Checkpoints in host memory, one copy with the rank and one with its
    peer, every ``every`` steps; the newest complete one restores on any
    mesh. Use it beside a :class:`~shardax.ckpt.CheckpointManager` (disk),
    which the run falls back to when a rank and its peer are both lost.

    Args:
        every: ``save`` writes only on steps that are multiples of this.
        directory: this rank's slot of host memory (an existing folder);
            default: ``$SHARDAX_MEMORY_DIR``, which ``shardax launch
            --max-restarts N`` (or ``--elastic``) sets in each rank.

    Each ``save``, ``latest`` and ``restore`` is collective: call it on every
    rank. At world size 1 there is no peer, only the rank's own copy:

    >>> import tempfile, torch, shardax as sx
    >>> memory = sx.ckpt.MemoryCheckpointManager(every=2, directory=tempfile.mkdtemp())
    >>> for step in range(1, 6):
    ...     _ = memory.save(step, {"w": torch.full((2,), float(step)), "step": step})
    >>> memory.latest()
    MemorySnapshot(step=4, world_size=1, from_peers=())
    >>> memory.restore({"w": torch.zeros(2), "step": 0})
    (4, {'w': tensor([4., 4.]), 'step': 4})
    """

    every: int = attrs.field(default=1, validator=_every)
    directory: Path | None = attrs.field(default=None, converter=_directory)

    def slot(self) -> Path:
        """This rank's folder of host memory."""
        where = self.directory
        if where is None:
            env = os.environ.get(MEMORY_ENV)
            if not env:
                raise CheckpointError(
                    f"in-memory checkpoints need host memory that outlives this process: run "
                    f"under `shardax launch --max-restarts N` (or --elastic MIN:MAX), which sets "
                    f"{MEMORY_ENV}, or pass directory="
                )
            where = Path(env)
        if not where.is_dir():
            raise CheckpointError(
                f"in-memory checkpoint folder {where} does not exist: its launcher has removed "
                "it (it is exiting), or directory= names no folder"
            )
        return where

    def save(self, step: int, tree: Any, *, metadata: Mapping[str, Any] | None = None,
             force: bool = False) -> bool:  # fmt: skip
        """Snapshot ``tree`` at ``step`` into host memory (this rank's copy
        and its peer's) if ``step`` is a multiple of ``every`` (or
        ``force``); whether it did. Collective."""
        if not force and step % self.every:
            return False
        slot = self.slot()
        p = plan(tree, {"step": step, **(metadata or {})}, rng=True, copy=False)
        transport = Transport(p.rank, p.world)
        mine = _file(p.rank, p.world)
        index, items = _owners(p, transport, mine)
        final = slot / f"step-{step:08d}"
        tmp = slot / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()  # not parents: a slot its launcher removed stays removed
        sums = write_safetensors(tmp / mine, items)
        rng = {n: list(t.shape) for n, t in items if n.startswith(RNG_PREFIX)}
        report = {"sums": sums, "rng": rng, "python": p.python_rng, "slot": str(slot)}
        _json(tmp / _report(mine), report)
        _json(tmp / PARTIAL, index.to_json())
        _copy_to_peer(transport, tmp, mine, node_key(slot))
        os.rename(tmp, final)
        transport.barrier()  # every rank's snapshot is in: the old ones can go
        for old in slot.iterdir():
            if old.name != final.name and (_STEP.fullmatch(old.name) or old.name.endswith(".tmp")):
                shutil.rmtree(old, ignore_errors=True)
        return True

    def latest(self) -> MemorySnapshot | None:
        """The newest snapshot the ranks can rebuild from what survives, or
        None (then fall back to disk). Collective."""
        found = _agree(self.slot(), None)
        return None if found is None else found.snapshot

    def restore(
        self, target: Any, *, step: int | None = None, rng: bool | str = "reseed", **kwargs: Any
    ) -> tuple[int, Any] | None:
        """``(step, tree)`` rebuilt from the newest complete snapshot (or
        ``step``'s) into ``target`` — on this job's mesh, whatever the
        saving job's; None when none is complete. ``rng`` and ``kwargs`` as
        :meth:`CheckpointManager.restore <shardax.ckpt.CheckpointManager.restore>`. Collective."""
        slot = self.slot()
        found = _agree(slot, step)
        if found is None:
            return None
        view = _view(found, slot)
        try:
            tree = load(view, target, rng=rng, **kwargs)
        finally:
            found.transport.barrier()  # every rank has read it
            if found.builds:
                shutil.rmtree(view, ignore_errors=True)
        return found.snapshot.step, tree


def _owners(p: Any, transport: Transport, mine: str) -> tuple[Index, list]:
    """The index every rank saves under and this rank's items: its plan's,
    unless the ranks hold different trees (a pipeline's stages), then
    merged as :func:`~shardax.ckpt.save` merges them (each distinct box
    written by the lowest rank holding it)."""
    tree = json.dumps(p.index.to_json()["leaves"], sort_keys=True)
    digest = hashlib.sha256(tree.encode()).hexdigest()
    if len(set(transport.gather_json(digest))) == 1:
        return p.index, p.items
    leaves = _merge([json.loads(t) for t in transport.gather_json(tree)])
    merged = Index.from_json({**p.index.to_json(), "leaves": leaves}, "the merged index")
    owned = {b.name for e in merged.tensors().values() for b in e.boxes if b.file == mine}
    keep = [(n, t) for n, t in p.items if n in owned or n.startswith(RNG_PREFIX)]
    return merged, keep + [(n, t) for n, t in p.spare if n in owned]


def _json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


def _report(piece: str) -> str:
    return piece.removesuffix(".safetensors") + ".json"


def _copy_to_peer(transport: Transport, tmp: Path, mine: str, node: int) -> None:
    """Send this rank's file and report to its peer; write those of the
    ranks whose peer this is."""
    data, report = read_bytes(tmp / mine), read_bytes(tmp / _report(mine))
    table = transport.gather_ints([node, data.numel(), report.numel()])
    peers = peers_of([row[0] for row in table])
    rank, world = transport.rank, transport.world
    peer = peers[rank]
    sources = [r for r in range(world) if peers[r] == rank]
    got = transport.exchange(
        {} if peer is None else {peer: [data, report]}, {r: table[r][1:] for r in sources}
    )
    for r in sources:
        piece = _file(r, world)
        write_bytes(tmp / piece, got[r][0])
        write_bytes(tmp / _report(piece), got[r][1])


def _inventory(slot: Path) -> dict[str, list[list[int]]]:
    """This slot's committed snapshots: step → ``[rank, world, bytes,
    report bytes, own]`` of each saving rank whose file and report it holds
    (``own``: 1 if that rank wrote it here itself, 0 for a peer's copy)."""
    out: dict[str, list[list[int]]] = {}
    for entry in sorted(slot.iterdir()) if slot.is_dir() else []:
        m = _STEP.fullmatch(entry.name)
        if not m or not (entry / PARTIAL).is_file():
            continue
        pieces = []
        for f in entry.iterdir():
            p = _PIECE.fullmatch(f.name)
            report = entry / _report(f.name)
            if p is None or not report.is_file():
                continue
            try:
                own = json.loads(report.read_text()).get("slot") == str(slot)
            except (OSError, ValueError):
                continue
            sizes = [f.stat().st_size, report.stat().st_size]
            pieces.append([int(p.group(1)), int(p.group(2)), *sizes, int(own)])
        out[m.group(1)] = sorted(pieces)
    return out


@attrs.frozen
class _Found:
    """What the ranks agreed: the snapshot, where each saving rank's file
    is (``holders``: rank → the ranks holding it) and its sizes, each
    rank's node and slot, and whether this rank builds its node's view."""

    snapshot: MemorySnapshot
    holders: dict[int, list[int]]
    sizes: dict[int, tuple[int, int]]
    nodes: list[int]
    slots: list[str]
    transport: Transport
    builds: bool


def _agree(slot: Path, step: int | None) -> _Found | None:
    """Every rank's inventory, and the newest step (or ``step``) whose
    files are all somewhere. Collective."""
    transport = Transport(*_world())
    mine = {"node": node_key(slot), "slot": str(slot), "steps": _inventory(slot)}
    everyone = transport.gather_json(mine)
    held: dict[int, dict[int, list[int]]] = {}
    sizes: dict[int, dict[int, tuple[int, int]]] = {}
    worlds: dict[int, set[int]] = {}
    own: dict[int, set[int]] = {}
    for holder, inv in enumerate(everyone):
        for text, pieces in inv["steps"].items():
            s = int(text)
            for saver, world, nbytes, rbytes, is_own in pieces:
                held.setdefault(s, {}).setdefault(saver, []).append(holder)
                sizes.setdefault(s, {})[saver] = (nbytes, rbytes)
                worlds.setdefault(s, set()).add(world)
                if is_own:
                    own.setdefault(s, set()).add(saver)
    complete = [
        s for s, savers in held.items()
        if len(worlds[s]) == 1 and set(savers) == set(range(next(iter(worlds[s]))))
        and (step is None or s == step)
    ]  # fmt: skip
    if not complete:
        return None
    best = max(complete)
    nodes = [inv["node"] for inv in everyone]
    lost_own = tuple(r for r in sorted(held[best]) if r not in own.get(best, set()))
    return _Found(
        snapshot=MemorySnapshot(best, len(held[best]), lost_own),
        holders={r: sorted(h) for r, h in sorted(held[best].items())},
        sizes=sizes[best],
        nodes=nodes,
        slots=[inv["slot"] for inv in everyone],
        transport=transport,
        builds=nodes.index(nodes[transport.rank]) == transport.rank,
    )


def _view(found: _Found, slot: Path) -> Path:
    """This node's folder of the snapshot's files — links to those its
    slots hold, copies of the others received over the gloo group — and its
    index, built by the node's first rank. Collective."""
    step, world = found.snapshot.step, found.snapshot.world_size
    me, nodes, slots = found.transport.rank, found.nodes, found.slots
    folder = f"step-{step:08d}"
    view = slot.parent / f".restore-{folder}-{nodes[me]:x}"
    if found.builds:
        shutil.rmtree(view, ignore_errors=True)
        view.mkdir()
    leaders = {n: nodes.index(n) for n in nodes}
    sends: dict[int, list[Any]] = {}
    recvs: dict[int, list[int]] = {}
    names: dict[int, list[str]] = {}
    for saver, holders in found.holders.items():
        piece = _file(saver, world)
        local = [h for h in holders if nodes[h] == nodes[me]]
        if found.builds and local:
            for name in (piece, _report(piece), PARTIAL):
                _link(Path(slots[local[0]]) / folder / name, view / name)
        sender = holders[0]  # the first holder sends it to each node without it
        for node, leader in leaders.items():
            if any(nodes[h] == node for h in holders):
                continue
            if sender == me:
                src = Path(slots[me]) / folder
                sends.setdefault(leader, []).extend(
                    read_bytes(src / n) for n in (piece, _report(piece))
                )
            if leader == me:
                recvs.setdefault(sender, []).extend(found.sizes[saver])
                names.setdefault(sender, []).extend((piece, _report(piece)))
    for sender, pieces in found.transport.exchange(sends, recvs).items():
        for name, data in zip(names[sender], pieces, strict=True):
            write_bytes(view / name, data)
    if found.builds:
        if not (view / PARTIAL).is_file():
            src = next(Path(slots[h]) / folder for h in range(len(nodes)) if nodes[h] == nodes[me])
            _link(src / PARTIAL, view / PARTIAL)
        partial = Index.from_json(json.loads((view / PARTIAL).read_text()), str(view / PARTIAL))
        reports = [json.loads((view / _report(_file(r, world))).read_text()) for r in range(world)]
        write_index(view, _assemble(partial, reports))
    found.transport.barrier()  # every node's view is ready
    return view


def _link(src: Path, dst: Path) -> None:
    if dst.exists():
        return
    try:
        os.link(src, dst)
    except OSError:  # another filesystem: copy
        shutil.copyfile(src, dst)


def _world() -> tuple[int, int]:
    from ._save import _world as world

    return world()
