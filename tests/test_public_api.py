"""The public surface and the CLI options, frozen: growing them is a visible
diff here (as torchtitan's test_no_new_cli_options does)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import click

from shardax.cli import main

SURFACE = {
    "shardax": [
        "AbstractMesh",
        "CollectiveError",
        "CollectiveTimeoutError",
        "Layout",
        "LaunchError",
        "Mesh",
        "MeshError",
        "NamedSharding",
        "P",
        "PartitionSpec",
        "Rule",
        "Rules",
        "ShardingError",
        "Sharded",
        "collectives",
        "explain",
        "gather",
        "init",
        "plan_transfer",
        "reshard",
        "rules",
        "shard",
        "shutdown",
        "transfer",
    ],
    "shardax.mesh": [
        "AbstractMesh",
        "LaunchEnv",
        "Mesh",
        "ProcessInfo",
        "current_mesh",
        "detect_env",
        "init",
        "shutdown",
    ],
    "shardax.shard": [
        "Explanation",
        "Layout",
        "NamedSharding",
        "P",
        "PartitionSpec",
        "Plan",
        "Rule",
        "Rules",
        "Sharded",
        "Step",
        "explain",
        "gather",
        "layouts_for",
        "plan_transfer",
        "reshard",
        "shard",
        "transfer",
    ],
    "shardax.collectives": [
        "AsyncResult",
        "Backend",
        "Group",
        "Handle",
        "all_gather",
        "all_to_all",
        "apply_op",
        "axis_index",
        "axis_size",
        "backend_names",
        "barrier",
        "broadcast",
        "chunk_sizes",
        "count_once",
        "get_backend",
        "pmax",
        "pmean",
        "pmin",
        "ppermute",
        "psum",
        "psum_scatter",
        "transpose",
    ],
    "shardax.rules": ["Rule", "Rules"],
    "shardax.errors": [
        "CollectiveError",
        "CollectiveTimeoutError",
        "LaunchError",
        "MeshError",
        "ShardingError",
    ],
    "shardax.launch": ["LaunchSpec", "free_port", "launch", "rank_command", "rank_env"],
}

CLI = {
    "shardax": ["--version"],
    "shardax launch": [
        "--kill-grace",
        "--log-ranks",
        "--master-addr",
        "--master-port",
        "--master_addr",
        "--master_port",
        "--module",
        "--no-python",
        "--nproc-per-node",
        "--nproc_per_node",
        "-m",
    ],
}


def test_public_names_are_frozen():
    for name, expected in SURFACE.items():
        module = importlib.import_module(name)
        assert sorted(module.__all__) == sorted(expected), name
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.{attr}"


def _options(command: click.Command, prefix: str) -> dict[str, list[str]]:
    out = {
        prefix: sorted(
            o for p in command.params for o in p.opts + p.secondary_opts if o.startswith("-")
        )
    }
    if isinstance(command, click.Group):
        for sub_name, sub in command.commands.items():
            out |= _options(sub, f"{prefix} {sub_name}")
    return out


def test_cli_options_are_frozen():
    assert _options(main, "shardax") == CLI


def test_import_needs_no_gpu_cupy_or_compiler():
    code = (
        "import sys, shardax, shardax.cli;"
        "bad = [m for m in ('cupy', 'cupy_backends', 'triton') if m in sys.modules];"
        "assert not bad, bad"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CC": "/nonexistent", "CXX": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
