"""``shardax ckpt`` — inspect, verify, reshard, consolidate, import — on one
process: what each prints, the files each writes (loadable by plain
safetensors and by ``sx.ckpt.load``), streaming within a memory cap, and
the errors a user meets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from torch import nn

import shardax as sx
from shardax.cli import main


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["ckpt", *map(str, args)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 5)
        self.register_buffer("scale", torch.tensor(2.0))


def train_state(tmp_path: Path) -> tuple[Path, Tiny, dict]:
    """A saved state like the example's: params, AdamW moments, step."""
    torch.manual_seed(0)
    model = Tiny()
    params = sx.params_of(model)
    state = {
        "params": params,
        "opt_state": {"mu": {k: torch.randn_like(v) for k, v in params.items()}},
        "step": 7,
    }
    path = sx.ckpt.save(tmp_path / "ckpt", state, metadata={"run": "t"})
    return path, model, state


def test_inspect_lists_leaves_mesh_totals_and_metadata(tmp_path):
    path, _, state = train_state(tmp_path)
    code, out = cli("inspect", path)
    assert code == 0, out
    assert "saved from mesh (none) by 1 rank(s)" in out
    assert re.search(r"\nparams\.fc\.weight +5×6 +float32 +P\(\) +120 B\n", out), out
    assert "value step = 7" in out and 'metadata {"run": "t"}' in out
    code, out = cli("inspect", path, "--json")
    summary = json.loads(out)
    total = sum(v.numel() * 4 for part in ("params",) for v in state[part].values())
    total *= 2  # and the moments
    assert summary["total_bytes"] == total and summary["values"] == {"step": 7}
    assert {x["path"] for x in summary["leaves"]} >= {"params.emb.weight", "opt_state.mu.fc.bias"}


def test_verify_names_each_bad_file_and_tensor(tmp_path):
    path, _, state = train_state(tmp_path)
    code, out = cli("verify", path, "-q")
    assert code == 0 and "every checksum matches" in out
    index = sx.ckpt.read_index(path)
    box = index.leaves["params.fc.weight"].boxes[0]
    header = safetensors.safe_open(str(path / box.file), "pt").metadata()  # opens cleanly
    assert header["writer"] == "shardax"
    with open(path / box.file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start = 8 + n + json.loads(f.read(n))[box.name]["data_offsets"][0]
    with open(path / box.file, "r+b") as f:
        f.seek(start + 3)
        byte = f.read(1)
        f.seek(start + 3)
        f.write(bytes([byte[0] ^ 0x40]))
    code, out = cli("verify", path, "-q")
    assert code == 1
    assert f"BAD checksum mismatch in {box.file}:{box.name}" in out
    assert "1 problem(s)" in out
    with pytest.raises(
        sx.CheckpointError, match=f"checksum mismatch in {box.file}:params.fc.weight"
    ):
        sx.ckpt.load(path, state)


def test_verify_reports_a_missing_file_once(tmp_path):
    path, _, _ = train_state(tmp_path)
    (path / "rank-00000-of-00001.safetensors").unlink()
    code, out = cli("verify", path, "-q")
    assert code == 1 and out.count("BAD cannot open") == 1


def test_consolidate_only_params_loads_into_the_unsharded_model(tmp_path):
    path, _, state = train_state(tmp_path)
    out = tmp_path / "model.safetensors"
    code, text = cli("consolidate", path, out, "--only", "params", "-q")
    assert code == 0, text
    dense = safetensors.torch.load_file(out)
    assert sorted(dense) == sorted(state["params"])  # plain names, no moments
    fresh = Tiny()
    fresh.load_state_dict(dense)
    for k, v in sx.params_of(fresh).items():
        assert torch.equal(v, state["params"][k]), k
    code, text = cli("consolidate", path, tmp_path / "bf.safetensors", "--dtype", "bf16", "-q")
    assert code == 0, text
    every = safetensors.torch.load_file(tmp_path / "bf.safetensors")
    assert every["opt_state.mu.fc.weight"].dtype == torch.bfloat16
    assert torch.equal(every["params.emb.weight"], state["params"]["emb.weight"].bfloat16())
    meta = safetensors.safe_open(str(tmp_path / "bf.safetensors"), "pt").metadata()
    assert meta["step"] == "7"


def test_consolidate_refuses_to_overwrite_and_names_bad_only(tmp_path):
    path, _, _ = train_state(tmp_path)
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep")
    code, text = cli("consolidate", path, out)
    assert code == 2 and "pass --force" in text and out.read_bytes() == b"keep"
    code, text = cli("consolidate", path, tmp_path / "n.safetensors", "--only", "parms")
    assert (
        code == 2 and "selects nothing; top-level keys are ['opt_state', 'params', 'step']" in text
    )
    code, text = cli("consolidate", path, tmp_path / "n.safetensors", "--dtype", "fp13")
    assert code == 2 and "unknown dtype 'fp13'" in text


CAP_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from shardax.cli import main

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])  # KiB

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    main(["ckpt", "consolidate", *sys.argv[1:], "-q"], standalone_mode=False)
    print("RSS", before, status("VmHWM"))
    """
)


def test_consolidate_streams_a_checkpoint_4x_larger_than_the_memory_cap(tmp_path):
    cap = 24 << 20
    g = torch.Generator().manual_seed(1)
    tree = {f"layer{i}": torch.randn(1024, 4096, generator=g) for i in range(6)}  # 6 × 16 MiB
    path = sx.ckpt.save(tmp_path / "big", tree, rng=False)
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size >= 4 * cap
    out = tmp_path / "big.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", CAP_SCRIPT, str(path), str(out), "--buffer-mib", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rss = next(line for line in done.stdout.splitlines() if line.startswith("RSS "))
    before, after = map(int, rss.split()[1:])
    print(f"peak RSS grew {(after - before) / 1024:.1f} MiB")
    assert (after - before) * 1024 < cap, f"peak RSS grew {(after - before) / 1024:.1f} MiB"
    with safetensors.safe_open(str(out), "pt") as f:
        for k, v in tree.items():
            assert torch.equal(f.get_tensor(k), v), k


def test_reshard_by_specs_keeps_values_and_follows_params_into_opt_state(tmp_path):
    path, _, state = train_state(tmp_path)
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({r"emb\.weight": ["dp", None], r"fc\.weight": [None, "tp"]}))
    dst = tmp_path / "resharded"
    code, out = cli("reshard", path, dst, "--mesh", "dp=2,tp=2", "--specs", specs, "-q")
    assert code == 0, out
    index = sx.ckpt.read_index(dst)
    assert index.mesh == {"dp": 2, "tp": 2} and index.world_size == 4
    for prefix in ("params.", "opt_state.mu."):
        assert index.leaves[prefix + "emb.weight"].spec == sx.P("dp")
        assert index.leaves[prefix + "fc.weight"].spec == sx.P(None, "tp")
        assert index.leaves[prefix + "fc.bias"].spec == sx.P()
    assert sorted(b.sizes for b in index.leaves["params.emb.weight"].boxes) == [(5, 6), (6, 6)]
    assert not index.rng  # 1 rank → 4: per-rank RNG states do not carry over
    assert sx.ckpt.verify(dst) == []
    back = sx.ckpt.load(dst, state)
    for k in state["params"]:
        assert torch.equal(back["params"][k], state["params"][k])
        assert torch.equal(back["opt_state"]["mu"][k], state["opt_state"]["mu"][k])
    assert back["step"] == 7 and sx.ckpt.read_index(dst).metadata == {"run": "t"}


RULES_FILE = """
import shardax as sx
RULES = sx.Rules(sx.Rule(r".*\\.weight", sx.P("dp")))
NOT_RULES = 3
"""


def test_reshard_by_a_rules_file_with_a_cast(tmp_path):
    path, _, state = train_state(tmp_path)
    rules = tmp_path / "my_rules.py"
    rules.write_text(RULES_FILE)
    dst = tmp_path / "r"
    code, out = cli(
        "reshard", path, dst, "--mesh", "dp=3", "--rules", f"{rules}:RULES", "--dtype", "bf16", "-q"
    )
    assert code == 0, out
    index = sx.ckpt.read_index(dst)
    assert index.leaves["opt_state.mu.emb.weight"].spec == sx.P("dp")
    assert index.leaves["params.emb.weight"].dtype == "bfloat16"
    back = sx.ckpt.load(dst)
    assert torch.equal(back["params"]["fc.weight"], state["params"]["fc.weight"].bfloat16())
    code, out = cli("reshard", path, tmp_path / "s", "--mesh", "dp=3", "--rules", f"{rules}:NOPE")
    assert code == 2 and "has no 'NOPE'; rules defined there: ['RULES']" in out
    code, out = cli(
        "reshard", path, tmp_path / "s", "--mesh", "dp=3", "--rules", f"{rules}:NOT_RULES"
    )
    assert code == 2 and "expected Rules, a Rule" in out


def test_reshard_keeps_rng_states_when_the_world_size_stays(tmp_path):
    torch.manual_seed(5)
    path = sx.ckpt.save(tmp_path / "a", {"w": torch.arange(6.0)})
    expected = torch.rand(3)
    dst = tmp_path / "b"
    code, out = cli("reshard", path, dst, "--mesh", "x=1", "-q")
    assert code == 0, out
    torch.manual_seed(0)
    sx.ckpt.load(dst, {"w": None}, rng=True)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "dp=two"], "write the mesh as axis=size pairs"),
        (["--mesh", "dp=2", "--rules", "nomodule_xyz:R"], "cannot import 'nomodule_xyz'"),
        (["--mesh", "dp=2", "--rules", "nocolon"], "write MODULE:NAME"),
    ],
)
def test_reshard_argument_errors(tmp_path, args, message):
    path, _, _ = train_state(tmp_path)
    code, out = cli("reshard", path, tmp_path / "x", *args)
    assert code == 2 and message in out, out


def test_reshard_refuses_existing_destinations_and_uneven_strict_specs(tmp_path):
    path, _, _ = train_state(tmp_path)
    code, out = cli("reshard", path, path, "--mesh", "dp=2")
    assert code == 2 and "pass --force" in out
    code, out = cli("reshard", path, path, "--mesh", "dp=2", "--force")
    assert code == 2 and "is the source itself" in out
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({r"fc\.bias": ["nope"]}))
    code, out = cli("reshard", path, tmp_path / "y", "--mesh", "dp=2", "--specs", specs)
    assert code == 2 and "nope" in out and not (tmp_path / "y").exists()


def test_import_safetensors_and_state_dicts_into_sharded_checkpoints(tmp_path):
    torch.manual_seed(2)
    model = Tiny()
    dense = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(dense, tmp_path / "model.safetensors")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    for src in ("model.safetensors", "model.pt"):
        dst = tmp_path / f"from-{src}"
        code, out = cli("import", tmp_path / src, dst, "--mesh", "dp=2", "--prefix", "params", "-q")
        assert code == 0, out
        index = sx.ckpt.read_index(dst)
        assert set(index.leaves) == {f"params.{k}" for k in dense}
        mesh = sx.Mesh({"dp": 1})
        specs = {k: sx.P("dp") if v.ndim else sx.P() for k, v in dense.items()}
        back = sx.ckpt.load(dst, {"params": specs}, mesh=mesh)
        for k, v in dense.items():
            assert torch.equal(back["params"][k].local, v), (src, k)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_import_never_runs_code_from_a_pickle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pt")
    code, out = cli("import", tmp_path / "evil.pt", tmp_path / "c", "--mesh", "dp=1")
    assert code == 2 and "weights_only=True (no code is run)" in out
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "c").exists()
