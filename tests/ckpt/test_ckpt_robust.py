"""Checkpoints under things going wrong, on one process: a crash between the
commit's renames, directories and files that are not checkpoints, damaged
indexes and headers, links out of the checkpoint, reserved names — and the
reader's economy: bytes read for a slice, memory bounded by the buffer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import shardax as sx
from shardax.ckpt import _safetensors, _save
from shardax.cli import main


def count_reads(monkeypatch) -> list[int]:
    """The byte counts of every read a checkpoint reader makes from now on."""
    reads: list[int] = []
    real = _safetensors._read_span

    def counting(f, offset, into, where):
        reads.append(len(into))
        return real(f, offset, into, where)

    monkeypatch.setattr(_safetensors, "_read_span", counting)
    return reads


def test_a_crash_between_the_commit_renames_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Where the filesystem cannot swap directories atomically, the commit is
    two renames; a crash between them leaves the previous checkpoint set
    aside, and readers and the next save find it."""
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(3)})
    monkeypatch.setattr(_save, "_exchange", lambda a, b: False)
    renames = []
    real_rename = os.rename

    def crash_on_second(a, b):
        renames.append((a, b))
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process dies here
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        sx.ckpt.save(path, {"a": torch.ones(3)})
    monkeypatch.setattr(os, "rename", real_rename)
    assert not path.exists() and (tmp_path / ".c.old").is_dir()
    assert torch.equal(sx.ckpt.load(path)["a"], torch.zeros(3))  # the previous one
    assert sx.ckpt.verify(path) == []
    sx.ckpt.save(path, {"a": torch.full((3,), 2.0)})  # recovers, then replaces
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert torch.equal(sx.ckpt.load(path)["a"], torch.full((3,), 2.0))


def test_replacing_swaps_atomically_where_the_os_can(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(3)})
    if not _save._exchange(tmp_path / "c", tmp_path / "c"):  # not Linux, or an old kernel
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    sx.ckpt.save(path, {"a": torch.ones(3)})
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert torch.equal(sx.ckpt.load(path)["a"], torch.ones(3))


def test_a_directory_with_someone_elses_index_json_is_never_replaced(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "index.json").write_text('{"my": "web app"}')
    (app / "precious.txt").write_text("keep me")
    with pytest.raises(sx.CheckpointError, match="not a shardax checkpoint"):
        sx.ckpt.save(app, {"a": torch.zeros(1)})
    assert (app / "precious.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(sx.CheckpointError, match="is a file; a checkpoint is a directory"):
        sx.ckpt.save(tmp_path / "file", {"a": torch.zeros(1)})


def test_cli_force_replaces_checkpoints_only(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(4)})
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    runner = CliRunner()
    for dst in (other, tmp_path / "notes.txt"):
        if dst.suffix:
            dst.write_text("a file")
        result = runner.invoke(
            main, ["ckpt", "reshard", str(path), str(dst), "--mesh", "dp=2", "--force"]
        )
        assert result.exit_code == 2, result.output
        assert "not a shardax checkpoint" in result.output or "is a file" in result.output
        assert "resharding" not in result.output  # refused before any work
    assert (other / "notes.txt").read_text() == "mine"
    target = sx.ckpt.save(tmp_path / "d", {"a": torch.ones(4)})
    result = runner.invoke(
        main, ["ckpt", "reshard", str(path), str(target), "--mesh", "dp=2", "--force", "-q"]
    )
    assert result.exit_code == 0, result.output
    assert torch.equal(sx.ckpt.load(target)["a"], torch.zeros(4))


def test_consolidate_never_writes_into_its_source(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"params": {"w": torch.ones(2)}})
    inside = path / "rank-00000-of-00001.safetensors"
    result = CliRunner().invoke(
        main, ["ckpt", "consolidate", str(path), str(inside), "--force", "--only", "params"]
    )
    assert result.exit_code == 2 and "is inside the checkpoint" in result.output
    assert sx.ckpt.verify(path) == []


def test_load_restores_rng_for_rules_and_dense_targets(tmp_path):
    torch.manual_seed(5)
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.arange(4.0)})
    expected = torch.rand(3)
    mesh = sx.Mesh({"dp": 1})
    for target, kw in ((sx.Rules(sx.Rule(".*", sx.P("dp"))), {"mesh": mesh}), (None, {})):
        torch.manual_seed(0)
        sx.ckpt.load(path, target, rng=True, **kw)
        assert torch.equal(torch.rand(3), expected), target


def test_mismatches_are_found_before_any_byte_is_read(tmp_path, monkeypatch):
    path = sx.ckpt.save(tmp_path / "c", {"a": torch.zeros(3), "b": torch.zeros(2, 2)}, rng=False)
    reads = count_reads(monkeypatch)
    with pytest.raises(sx.CheckpointError, match=r"'b': shape \(2, 2\) in the checkpoint"):
        sx.ckpt.load(path, {"a": torch.zeros(3), "b": torch.zeros(4)})
    assert reads == []


def test_a_few_columns_of_a_row_major_box_read_only_those_columns(tmp_path, monkeypatch):
    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)
    path = sx.ckpt.save(tmp_path / "c", {"w": full}, rng=False)
    mesh = sx.Mesh({"tp": 1})
    entry = sx.ckpt.read_index(path).leaves["w"]
    reads = count_reads(monkeypatch)
    with _safetensors.Files(path) as files:
        out = torch.empty(1024, 8)
        sx.ckpt._load.fill(files, "w", entry, (0, 512), out, verify=False)
    assert torch.equal(out, full[:, 512:520])
    assert sum(reads) == 1024 * 8 * 4  # 32 KiB of the 4 MiB box
    reads.clear()
    half = sx.ckpt.load(path, {"w": sx.P(None, "tp")}, mesh=mesh)["w"]
    assert torch.equal(half.local, full)
    del mesh


def test_reads_stay_within_the_buffer(tmp_path, monkeypatch):
    """Resharding a 16 MiB replicated tensor to 16 column pieces with a 1 MiB
    buffer reads no span larger than the buffer plus its checksum margins."""
    full = torch.randn(1024, 4096)
    path = sx.ckpt.save(tmp_path / "c", {"w": full}, rng=False)
    reads = count_reads(monkeypatch)
    dst = sx.ckpt.reshard(
        path, tmp_path / "r", {"w": [None, "tp"]}, mesh={"tp": 16}, buffer_bytes=1 << 20
    )
    assert max(reads) <= 2 << 20
    assert torch.equal(sx.ckpt.load(dst)["w"], full)


def test_damaged_indexes_and_headers_are_named(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(2, 2)}, rng=False)
    index = json.loads((path / "index.json").read_text())
    bad = json.loads(json.dumps(index))
    bad["leaves"]["w"]["boxes"][0]["offsets"] = [1, 0]
    (path / "index.json").write_text(json.dumps(bad))
    with pytest.raises(sx.CheckpointError, match=r"leaf 'w': box 'w@0,0' .* does not fit in shape"):
        sx.ckpt.load(path)
    bad["leaves"]["w"]["boxes"][0]["offsets"] = [0]
    (path / "index.json").write_text(json.dumps(bad))
    with pytest.raises(sx.CheckpointError, match=r"leaf 'w': bad box \(0,\) \+ \(2, 2\)"):
        sx.ckpt.load(path)
    bad = json.loads(json.dumps(index))
    bad["leaves"]["w"]["dtype"] = "float13"
    (path / "index.json").write_text(json.dumps(bad))
    with pytest.raises(sx.CheckpointError, match=r"index.json: leaf 'w': unknown dtype 'float13'"):
        sx.ckpt.read_index(path)
    (path / "index.json").write_text(json.dumps(index))
    shard = path / "rank-00000-of-00001.safetensors"
    header = b"[1, 2]"
    shard.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(sx.CheckpointError, match="corrupt safetensors header: not a JSON object"):
        sx.ckpt.load(path)
    assert "corrupt safetensors header" in sx.ckpt.verify(path)[0]


def test_boxes_that_do_not_tile_the_tensor_fail_verify(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)}, rng=False)
    index = json.loads((path / "index.json").read_text())
    index["leaves"]["w"]["shape"] = [6]
    (path / "index.json").write_text(json.dumps(index))
    assert "its boxes hold 4 of the 6 elements" in sx.ckpt.verify(path)[0]


def test_links_out_of_the_checkpoint_are_refused(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)}, rng=False)
    shard = path / "rank-00000-of-00001.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(sx.CheckpointError, match="outside the checkpoint; copy the file in"):
        sx.ckpt.load(path)


def test_reserved_names_and_unsupported_dtypes_name_the_key_path(tmp_path):
    with pytest.raises(
        sx.CheckpointError, match=r"'__rng__\.x': key paths starting with '__rng__'"
    ):
        sx.ckpt.save(tmp_path / "a", {"__rng__": {"x": torch.ones(1)}})
    with pytest.raises(sx.CheckpointError, match=r"'a.w': checkpoints cannot hold torch.complex64"):
        sx.ckpt.save(tmp_path / "b", {"a": {"w": torch.ones(2, dtype=torch.complex64)}})
    u = torch.tensor([1, 70000], dtype=torch.uint32)
    path = sx.ckpt.save(tmp_path / "c", {"u": u})
    assert torch.equal(sx.ckpt.load(path)["u"], u)


def test_mesh_option_rejects_non_ascii_digits(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)})
    result = CliRunner().invoke(
        main, ["ckpt", "reshard", str(path), str(tmp_path / "d"), "--mesh", "dp=²"]
    )
    assert result.exit_code == 2 and "axis=size pairs" in result.output


def test_an_index_linked_from_outside_the_checkpoint_is_refused(tmp_path):
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)}, rng=False)
    outside = tmp_path / "forged-index.json"
    (path / "index.json").rename(outside)
    (path / "index.json").symlink_to(outside)
    with pytest.raises(sx.CheckpointError, match=r"is a link to .*forged-index\.json, outside"):
        sx.ckpt.load(path)


def test_a_shape_its_boxes_cannot_fill_is_refused_before_allocating(tmp_path):
    """A forged index asking for 10^15 elements (4 PB) is a typed error, not
    an allocation that takes the machine down."""
    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)}, rng=False)
    index = json.loads((path / "index.json").read_text())
    index["leaves"]["w"]["shape"] = [10**15]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(
        sx.CheckpointError, match=r"leaf 'w': its boxes hold 4 of the 1000000000000000 elements"
    ):
        sx.ckpt.load(path)
    index["leaves"]["w"]["shape"] = [-4]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(sx.CheckpointError, match=r"shape \(-4,\) has a negative dim"):
        sx.ckpt.read_index(path)
