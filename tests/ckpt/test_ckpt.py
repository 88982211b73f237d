"""Checkpoints on one process: the format, round trips of every kind of leaf,
the errors a user meets, atomic replacement and the manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import safetensors.torch
import torch

import shardax as sx
from shardax.ckpt import CheckpointManager


class State(NamedTuple):
    count: int
    mu: dict


def tree() -> dict:
    g = torch.Generator().manual_seed(0)
    mesh = sx.Mesh({"dp": 1})
    return {
        "params": {
            "w": sx.shard(torch.randn(5, 3, generator=g), mesh, sx.P("dp")),
            "half": torch.randn(7, generator=g).to(torch.bfloat16),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.zeros(0, 4),
        },
        "opt": State(3, {"w": torch.randn(5, 3, generator=g)}),
        "step": 12,
        "name": "run-a",
        "lr": 0.25,
        "nothing": None,
    }


def same(a, b) -> None:
    """Bit-identical pytrees (Sharded compared by their local pieces)."""
    fa, sa = _leaves(a)
    fb, sb = _leaves(b)
    assert sa == sb
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        else:
            assert x == y and type(x) is type(y)


def _leaves(t):
    import optree

    leaves, spec = optree.tree_flatten(
        t, is_leaf=lambda x: isinstance(x, sx.Sharded), none_is_leaf=True
    )
    return [x.local if isinstance(x, sx.Sharded) else x for x in leaves], spec


def test_round_trip_of_every_kind_of_leaf(tmp_path):
    t = tree()
    path = sx.ckpt.save(tmp_path / "c", t, metadata={"config": {"lr": 0.25}})
    same(sx.ckpt.load(path, t), t)
    index = sx.ckpt.read_index(path)
    assert index.metadata == {"config": {"lr": 0.25}}
    assert index.world_size == 1 and index.mesh == {"dp": 1}
    w = index.leaves["params.w"]
    assert (w.shape, w.dtype, w.spec) == ((5, 3), "float32", sx.P("dp"))
    assert index.leaves["opt.count"] == sx.ckpt.ValueEntry(3)
    assert sorted(os.listdir(path)) == ["index.json", "rank-00000-of-00001.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary left


def test_shard_files_are_plain_safetensors(tmp_path):
    t = tree()
    path = sx.ckpt.save(tmp_path / "c", t, rng=False)
    loaded = safetensors.torch.load_file(path / "rank-00000-of-00001.safetensors")
    assert torch.equal(loaded["params.w@0,0"], t["params"]["w"].local)
    assert torch.equal(loaded["params.half@0"], t["params"]["half"])


def test_load_without_target_gives_nested_dicts(tmp_path):
    t = tree()
    path = sx.ckpt.save(tmp_path / "c", t)
    out = sx.ckpt.load(path)
    assert out["opt"]["count"] == 3  # named-tuple fields by name
    assert torch.equal(out["opt"]["mu"]["w"], t["opt"].mu["w"])
    assert torch.equal(out["params"]["w"], t["params"]["w"].local)
    assert out["step"] == 12 and out["nothing"] is None


def test_load_casts_and_lays_out_by_rules(tmp_path):
    t = tree()
    path = sx.ckpt.save(tmp_path / "c", t)
    mesh = sx.Mesh({"dp": 1})
    out = sx.ckpt.load(
        path, sx.Rule("params.w", sx.P("dp")) + sx.Rule(".*", sx.P()), mesh=mesh, dtype="bf16"
    )
    assert isinstance(out["params"]["w"], sx.Sharded)
    assert out["params"]["w"].dtype == torch.bfloat16
    assert out["params"]["ids"].dtype == torch.int64  # only floating leaves are cast
    torch.testing.assert_close(out["params"]["w"].local, t["params"]["w"].local.bfloat16())


def test_mismatches_are_listed_together(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(2, 3), "b": torch.zeros(4), "n": 1})
    with pytest.raises(sx.CheckpointError) as e:
        sx.ckpt.load(path, {"a": torch.zeros(3, 2), "c": torch.zeros(1), "n": torch.zeros(1)})
    msg = str(e.value)
    assert "'a': shape (2, 3) in the checkpoint, (3, 2) in the target" in msg
    assert "missing from the checkpoint: 'c'" in msg
    assert "not in the target: 'b'" in msg
    assert "'n': the checkpoint holds a value (1), the target a tensor" in msg
    out = sx.ckpt.load(path, {"b": torch.zeros(4), "c": torch.ones(1)}, strict=False)
    assert torch.equal(out["c"], torch.ones(1))


def test_flipped_byte_is_named_by_load(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.arange(1000.0), "b": torch.zeros(3)})
    f = path / "rank-00000-of-00001.safetensors"
    raw = bytearray(f.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start + 100] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(
        sx.CheckpointError, match=r"checksum mismatch in rank-00000-of-00001.safetensors:a@0"
    ):
        sx.ckpt.load(path, {"a": torch.zeros(1000), "b": torch.zeros(3)})
    out = sx.ckpt.load(path, {"a": torch.zeros(1000), "b": torch.zeros(3)}, verify=False)
    assert out["a"][25].item() != 25.0


def test_truncated_file_is_named(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.arange(1000.0)})
    f = path / "rank-00000-of-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-2000])
    with pytest.raises(sx.CheckpointError, match="truncated"):
        sx.ckpt.load(path, {"a": torch.zeros(1000)})


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "a/../../b", ""])
def test_unsafe_file_names_in_the_index_are_refused(tmp_path, name):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(2)})
    index = json.loads((path / "index.json").read_text())
    index["leaves"]["a"]["boxes"][0]["file"] = name
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(sx.CheckpointError, match="unsafe file name"):
        sx.ckpt.load(path, {"a": torch.zeros(2)})


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(sx.CheckpointError, match="no checkpoint at"):
        sx.ckpt.load(tmp_path / "nope", {})
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "index.json").write_text('{"format": "other"}')
    with pytest.raises(sx.CheckpointError, match="not a shardax checkpoint index"):
        sx.ckpt.read_index(tmp_path / "x")
    (tmp_path / "x" / "index.json").write_text('{"format": "shardax-checkpoint", "version": 99}')
    with pytest.raises(sx.CheckpointError, match="format version 99"):
        sx.ckpt.read_index(tmp_path / "x")


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(sx.CheckpointError, match="refusing to replace"):
        sx.ckpt.save(tmp_path / "home", {"a": torch.zeros(1)})
    assert (tmp_path / "home" / "notes.txt").read_text() == "mine"


def test_unsupported_leaves_and_metadata_are_errors(tmp_path):
    with pytest.raises(sx.CheckpointError, match=r"cannot store set at 'a'"):
        sx.ckpt.save(tmp_path / "c", {"a": {1, 2}})
    with pytest.raises(sx.CheckpointError, match="metadata must be JSON"):
        sx.ckpt.save(tmp_path / "c", {"a": 1}, metadata={"f": object()})
    with pytest.raises(sx.CheckpointError, match="meta tensor"):
        sx.ckpt.save(tmp_path / "c", {"a": torch.empty(2, device="meta")})
    mesh = sx.Mesh({"dp": 1})
    partial = sx.Sharded(torch.ones(2), sx.Layout(mesh, sx.P(), partial="dp"), (2,))
    with pytest.raises(sx.CheckpointError, match="pending sum"):
        sx.ckpt.save(tmp_path / "c", {"g": partial})


def test_replacing_a_checkpoint_is_atomic(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(3)})
    sx.ckpt.save(path, {"a": torch.ones(3)})
    assert torch.equal(sx.ckpt.load(path, {"a": None})["a"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """The writer dies (os._exit) after writing half its shard file: the old
    checkpoint is intact and loadable, nothing partial is visible under the
    name, and the next save cleans the leftover up."""
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(1000)})
    script = textwrap.dedent(
        f"""
        import os, torch, shardax as sx
        from shardax.ckpt import _safetensors
        real = _safetensors._bytes
        def dying(t):
            data = real(t)
            if len(data) == 4000:
                os.write(1, b"dying")
                with open({str(path.parent / ".c.tmp" / "rank-00000-of-00001.safetensors")!r}, "ab") as f:
                    f.write(data[:2000])
                os._exit(3)
            return data
        _safetensors._bytes = dying
        sx.ckpt.save({str(path)!r}, {{"a": torch.ones(1000)}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3 and "dying" in proc.stdout, proc.stderr
    assert (tmp_path / ".c.tmp").exists()  # the partial write, hidden
    assert torch.equal(sx.ckpt.load(path, {"a": None})["a"], torch.zeros(1000))
    sx.ckpt.save(path, {"a": torch.full((1000,), 2.0)})
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_rng_states_are_restored(tmp_path):
    torch.manual_seed(5)
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(1)})
    expected = torch.rand(4)
    torch.manual_seed(99)
    sx.ckpt.load(path, {"a": None}, rng=True)
    assert torch.equal(torch.rand(4), expected)


def test_async_save_commits_a_snapshot(tmp_path):
    x = torch.zeros(1000)
    handle = sx.ckpt.save_async(tmp_path / "c", {"a": x})
    x += 1  # the copy was taken before save_async returned
    assert handle.wait() == tmp_path / "c"
    assert handle.done()
    assert torch.equal(sx.ckpt.load(tmp_path / "c", {"a": None})["a"], torch.zeros(1000))


def test_async_save_errors_surface_on_wait_and_on_the_next_save(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    handle = sx.ckpt.save_async(tmp_path / "home", {"a": torch.zeros(1)})
    with pytest.raises(sx.CheckpointError, match="refusing to replace"):
        handle.wait()
    sx.ckpt.save_async(tmp_path / "home", {"a": torch.zeros(1)})
    with pytest.raises(sx.CheckpointError, match=r"background save .* failed"):
        sx.ckpt.save(tmp_path / "other", {"a": torch.zeros(1)})


def test_manager_saves_every_n_keeps_k_and_resumes(tmp_path):
    mgr = CheckpointManager(tmp_path, every=2, keep=2)
    assert mgr.restore({"a": None}) is None
    for step in range(1, 8):
        mgr.save(step, {"a": torch.full((2,), float(step)), "step": step})
    assert mgr.steps() == [4, 6]
    (tmp_path / "step-00000008").mkdir()  # an uncommitted directory is not a checkpoint
    assert mgr.latest() == 6
    step, state = mgr.restore({"a": torch.zeros(2), "step": 0})
    assert step == 6 and state["step"] == 6 and torch.equal(state["a"], torch.full((2,), 6.0))
    assert sx.ckpt.read_index(mgr.path(6)).metadata == {"step": 6}
    with pytest.raises(ValueError, match="every must be a positive int"):
        CheckpointManager(tmp_path, every=0)


def test_async_manager(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=1, async_save=True)
    for step in range(3):
        mgr.save(step, {"a": torch.full((2,), float(step))})
    mgr.wait()
    assert mgr.steps() == [2]


def test_index_is_human_readable(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(2, 3)}, rng=False)
    index = json.loads(Path(path / "index.json").read_text())
    assert index["format"] == "shardax-checkpoint" and index["version"] == 1
    assert index["leaves"]["a"]["boxes"][0]["sizes"] == [2, 3]


KILLED_RANK = """
import os, sys, torch, shardax as sx
from shardax.ckpt import _safetensors
sx.init()
mesh = sx.Mesh({"dp": -1})
path = sys.argv[1]
sx.ckpt.save(path, {"w": sx.shard(torch.zeros(2000), mesh, sx.P("dp"))})
real = _safetensors._bytes
def dying(t):
    data = real(t)
    if mesh.rank == 1 and len(data) == 4000:  # rank 1's half of w: half written, then death
        tmp = os.path.join(os.path.dirname(path), ".c.tmp", "rank-00001-of-00002.safetensors")
        with open(tmp, "ab") as f:
            f.write(data[:2000])
        os._exit(7)
    return data
_safetensors._bytes = dying
sx.ckpt.save(path, {"w": sx.shard(torch.ones(2000), mesh, sx.P("dp"))})
"""


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """Two ranks under ``shardax launch``; rank 1 dies halfway through its
    shard of the second save: the launcher stops the job with rank 1's exit
    code, and the first checkpoint is what loads — nothing partial is visible."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_RANK)
    path = tmp_path / "c"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardax",
            "launch",
            "--nproc-per-node",
            "2",
            str(script),
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == [".c.tmp", "c", "killed.py"]
    assert torch.equal(sx.ckpt.load(path)["w"], torch.zeros(2000))
    assert sx.ckpt.verify(path) == []
