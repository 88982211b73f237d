"""In-memory checkpoints (``sx.ckpt.MemoryCheckpointManager``): each rank's
shards in its slot of host memory and a copy with its peer (a rank of the
next node, where there are nodes); after slots are lost, the newest
snapshot whose every file survives somewhere restores on the ranks left —
the files a node lacks sent over the gloo group — and equals what was
saved; when a rank and its peer are both lost, there is none (the run falls
back to disk). The slots are folders under the test's tmp dir, grouped into
"nodes" by their parent folder, as the launcher's are under /dev/shm."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax.ckpt._peers import peers_of

ROWS, STEPS = 10, (1, 2, 3)


def _slot(root: str, nodes: int, rank: int, world: int) -> Path:
    return Path(root) / f"node{rank * nodes // world}" / f"slot-{rank}"


def _values(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS, 3, generator=g), "b": torch.randn(5, generator=g)}


def _tree(mesh: sx.Mesh, values: dict[str, torch.Tensor], step: int) -> dict:
    return {
        "params": {
            "w": sx.shard(values["w"], mesh, sx.P("dp")),  # uneven: 10 rows over 3 or 4
            "b": sx.shard(values["b"], mesh, sx.P()),  # replicated
        },
        "step": step,
    }


def _save(root: str, nodes: int) -> list[str]:
    """Snapshots of steps 1-3 on every rank; this slot's files after."""
    mesh = sx.Mesh({"dp": -1})
    slot = _slot(root, nodes, mesh.rank, mesh.world_size)
    slot.mkdir(parents=True, exist_ok=True)
    memory = sx.ckpt.MemoryCheckpointManager(every=1, directory=slot)
    for step in STEPS:
        assert memory.save(step, _tree(mesh, _values(step), step), metadata={"run": "t"})
    return sorted(f"{p.parent.name}/{p.name}" for p in slot.rglob("*") if p.is_file())


def _restore(slots: list[str]) -> tuple:
    """On this job (its ranks in ``slots``): the snapshot found and the
    whole values restored (or None)."""
    mesh = sx.Mesh({"dp": -1})
    memory = sx.ckpt.MemoryCheckpointManager(directory=slots[mesh.rank])
    found = memory.latest()
    target = _tree(mesh, {k: torch.zeros_like(v) for k, v in _values(0).items()}, 0)
    back = memory.restore(target)
    if back is None:
        return found, None
    step, tree = back
    whole = {k: sx.gather(v) for k, v in tree["params"].items()}
    return found, (step, tree["step"], whole)


def _lose(root: Path, *names: str) -> None:
    for name in names:
        shutil.rmtree(root / name)


def test_peers_are_on_another_node():
    assert peers_of([1, 1, 2, 2]) == [2, 3, 0, 1]
    assert peers_of([1, 1, 1, 2]) == [3, 3, 3, 0]  # uneven nodes: node 2's rank keeps three
    assert peers_of([4, 4, 4, 4]) == [1, 2, 3, 0]


def test_a_rank_lost_on_a_node_is_rebuilt_from_its_peer_on_the_other(tmp_path):
    """2 nodes of 2 ranks; rank 3's slot is lost. On the 3 ranks left, node
    1 (rank 2's slot) lacks ranks 1 and 3's files: node 0 sends them."""
    files = run_ranks(_save, str(tmp_path), 2, world_size=4)
    # each slot: only the newest snapshot, its own file and the copy of the rank it keeps
    assert files[0] == [
        "step-00000003/index.partial.json",
        "step-00000003/rank-00000-of-00004.json",
        "step-00000003/rank-00000-of-00004.safetensors",
        "step-00000003/rank-00002-of-00004.json",
        "step-00000003/rank-00002-of-00004.safetensors",
    ]
    _lose(tmp_path, "node1/slot-3")
    slots = [str(tmp_path / s) for s in ("node0/slot-0", "node0/slot-1", "node1/slot-2")]
    results = run_ranks(_restore, slots, world_size=3)
    want = _values(3)
    for found, (step, saved_step, whole) in results:
        assert found == sx.ckpt.MemorySnapshot(step=3, world_size=4, from_peers=(3,))
        assert step == saved_step == 3
        for key, value in want.items():
            torch.testing.assert_close(whole[key], value, rtol=0, atol=0)  # bytes, moved
    assert not list(tmp_path.glob("*/.restore-*"))  # the views are gone


def test_a_lost_node_is_rebuilt_from_the_other(tmp_path):
    run_ranks(_save, str(tmp_path), 2, world_size=4)
    _lose(tmp_path, "node1")
    slots = [str(tmp_path / s) for s in ("node0/slot-0", "node0/slot-1")]
    for found, (_, _, whole) in run_ranks(_restore, slots, world_size=2):
        assert found == sx.ckpt.MemorySnapshot(step=3, world_size=4, from_peers=(2, 3))
        torch.testing.assert_close(whole["w"], _values(3)["w"], rtol=0, atol=0)


def test_a_rank_and_its_peer_both_lost_leave_nothing_to_restore(tmp_path):
    """Ranks 1 and 3 keep each other's copies: losing both loses rank 1's
    and rank 3's shards, so there is no in-memory checkpoint (fall back to
    disk)."""
    run_ranks(_save, str(tmp_path), 2, world_size=4)
    _lose(tmp_path, "node0/slot-1", "node1/slot-3")
    slots = [str(tmp_path / s) for s in ("node0/slot-0", "node1/slot-2")]
    assert run_ranks(_restore, slots, world_size=2) == [(None, None), (None, None)]


def test_on_one_node_the_next_rank_keeps_the_copy(tmp_path):
    run_ranks(_save, str(tmp_path), 1, world_size=3)
    _lose(tmp_path, "node0/slot-1")
    slots = [str(tmp_path / "node0" / s) for s in ("slot-0", "slot-2")]
    for found, (_, _, whole) in run_ranks(_restore, slots, world_size=2):
        assert found == sx.ckpt.MemorySnapshot(step=3, world_size=3, from_peers=(1,))
        torch.testing.assert_close(whole["b"], _values(3)["b"], rtol=0, atol=0)


# --- one process --------------------------------------------------------------------------


def test_one_rank_keeps_its_own_copy_and_skips_other_steps(tmp_path):
    memory = sx.ckpt.MemoryCheckpointManager(every=2, directory=tmp_path)
    tree = {"w": torch.arange(4.0), "step": 0}
    assert memory.latest() is None and memory.restore(tree) is None
    assert [memory.save(s, {**tree, "step": s}) for s in (1, 2, 3)] == [False, True, False]
    assert memory.save(3, {**tree, "step": 3}, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    (tmp_path / ".step-00000005.tmp").mkdir()  # a snapshot cut short: not a snapshot
    assert memory.latest() == sx.ckpt.MemorySnapshot(3, 1, ())
    step, back = memory.restore({"w": torch.zeros(4), "step": 0})
    assert step == 3 and back["step"] == 3 and torch.equal(back["w"], torch.arange(4.0))


def test_a_damaged_copy_is_an_error_naming_the_file(tmp_path):
    memory = sx.ckpt.MemoryCheckpointManager(directory=tmp_path)
    memory.save(1, {"w": torch.arange(1000.0)})
    piece = tmp_path / "step-00000001" / "rank-00000-of-00001.safetensors"
    data = bytearray(piece.read_bytes())
    data[-8] ^= 0xFF  # a flipped bit in the values
    piece.write_bytes(bytes(data))
    with pytest.raises(sx.CheckpointError, match=r"rank-00000-of-00001\.safetensors"):
        memory.restore({"w": torch.zeros(1000)})


def test_without_host_memory_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDAX_MEMORY_DIR", raising=False)
    with pytest.raises(sx.CheckpointError, match=r"shardax launch --max-restarts N"):
        sx.ckpt.MemoryCheckpointManager().slot()
    monkeypatch.setenv("SHARDAX_MEMORY_DIR", str(tmp_path / "gone"))
    with pytest.raises(sx.CheckpointError, match="its launcher has removed it"):
        sx.ckpt.MemoryCheckpointManager().save(1, {"w": torch.ones(1)})
    with pytest.raises(sx.CheckpointError, match="every must be a positive int"):
        sx.ckpt.MemoryCheckpointManager(every=0)
    assert os.environ["SHARDAX_MEMORY_DIR"].endswith("gone")
