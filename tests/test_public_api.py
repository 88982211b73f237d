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
        "ScheduleError",
        "Explanation",
        "Placement",
        "Plan",
        "Step",
        "layouts_for",
        "role_layout",
        "AbstractMesh",
        "Blocks",
        "CheckpointError",
        "CollectiveError",
        "CollectiveMismatchError",
        "CollectiveTimeoutError",
        "ConfigError",
        "Layout",
        "LaunchError",
        "Mesh",
        "MeshError",
        "ModuleRule",
        "NamedSharding",
        "P",
        "PartitionSpec",
        "Relayout",
        "Rule",
        "Rules",
        "ShardingError",
        "Sharded",
        "UnmatchedRulesWarning",
        "UnshardedWeightWarning",
        "apply",
        "blocks",
        "ckpt",
        "collectives",
        "config",
        "data",
        "monitor",
        "explain",
        "gather",
        "init",
        "init_params",
        "local_sizes",
        "manual_seed",
        "optim",
        "params_of",
        "pipeline",
        "plan_transfer",
        "reshard",
        "rules",
        "shard",
        "shutdown",
        "transfer",
        "ulysses_attention",
        "value_and_grad",
        "vocab_parallel_cross_entropy",
        "vocab_parallel_embedding",
    ],
    "shardax.monitor": ["Monitor", "comm_rows", "peak_memory", "transformer_flops_per_token"],
    "shardax.config": [
        "BatchConfig",
        "CheckpointConfig",
        "ConfigError",
        "MonitorConfig",
        "OptimizerConfig",
        "ParallelConfig",
        "PrecisionConfig",
        "ResolvedBatch",
        "RunConfig",
        "ScheduleConfig",
        "from_deepspeed",
        "load_config",
    ],
    "shardax.ckpt": [
        "AsyncSave",
        "Box",
        "CheckpointManager",
        "Index",
        "RNG_POLICIES",
        "TensorEntry",
        "ValueEntry",
        "consolidate",
        "import_dense",
        "load",
        "model_metadata",
        "read_index",
        "reshard",
        "save",
        "save_async",
        "verify",
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
        "Blocks",
        "Explanation",
        "Layout",
        "ModuleRule",
        "NamedSharding",
        "P",
        "PartitionSpec",
        "Placement",
        "Plan",
        "Relayout",
        "Rule",
        "Rules",
        "ShardOver",
        "Sharded",
        "Step",
        "apply",
        "blocks",
        "explain",
        "gather",
        "init_params",
        "layouts_for",
        "local_sizes",
        "manual_seed",
        "params_of",
        "plan_transfer",
        "reshard",
        "role_layout",
        "shard",
        "transfer",
        "ulysses_attention",
        "value_and_grad",
        "vocab_parallel_cross_entropy",
        "vocab_parallel_embedding",
    ],
    "shardax.collectives": [
        "Backend",
        "Group",
        "Handle",
        "Traffic",
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
        "moving",
        "pmax",
        "pmean",
        "pmin",
        "ppermute",
        "psum",
        "psum_scatter",
        "traffic",
        "transpose",
    ],
    "shardax.rules": [
        "GPT2_NAMES",
        "GPT_NAMES",
        "LLAMA_NAMES",
        "ModuleRule",
        "Relayout",
        "Rule",
        "Rules",
        "ShardOver",
        "TransformerNames",
        "megatron",
        "ulysses",
        "zero",
    ],
    "shardax.optim": [
        "ApplyIfFiniteState",
        "DynamicLossScale",
        "EmptyState",
        "FactoredRmsState",
        "FusedStep",
        "GradientTransformation",
        "InjectHyperparamsState",
        "MaskedState",
        "MasterWeightsState",
        "MultiSteps",
        "MultiStepsState",
        "ScaleByAdamState",
        "ScaleByAmsgradState",
        "ScaleByLionState",
        "ScaleByRmsState",
        "ScaleByRssState",
        "ScaleByScheduleState",
        "ScaleByStddevState",
        "TraceState",
        "adafactor",
        "adagrad",
        "adam",
        "adamw",
        "add_decayed_weights",
        "all_finite",
        "apply_if_finite",
        "apply_updates",
        "chain",
        "clip_by_block_rms",
        "clip_by_global_norm",
        "constant",
        "constant_schedule",
        "cosine",
        "cosine_decay_schedule",
        "fused_step",
        "global_norm",
        "inject_hyperparams",
        "lamb",
        "linear",
        "linear_schedule",
        "lion",
        "masked",
        "one_cycle",
        "one_cycle_schedule",
        "piecewise",
        "piecewise_constant_schedule",
        "rmsprop",
        "scale",
        "scale_by_adam",
        "scale_by_factored_rms",
        "scale_by_learning_rate",
        "scale_by_lion",
        "scale_by_param_block_rms",
        "scale_by_rms",
        "scale_by_rss",
        "scale_by_schedule",
        "scale_by_trust_ratio",
        "sgd",
        "step",
        "trace",
        "warmup_cosine",
        "warmup_cosine_decay_schedule",
        "warmup_linear_decay",
        "warmup_linear_decay_schedule",
        "with_master_weights",
    ],
    "shardax.data": ["Sampler", "TextDataset", "batches", "shard_batch", "shard_batches"],
    "shardax.errors": [
        "CheckpointError",
        "CollectiveError",
        "CollectiveMismatchError",
        "CollectiveTimeoutError",
        "ConfigError",
        "LaunchError",
        "MeshError",
        "ScheduleError",
        "ShardingError",
        "USER_ERRORS",
        "UnmatchedRulesWarning",
        "UnshardedWeightWarning",
        "debugging",
    ],
    "shardax.pipeline": [
        "Action",
        "Event",
        "Schedule",
        "Timeline",
        "gpipe",
        "one_f_one_b",
        "simulate",
        "validate",
    ],
    "shardax.launch": ["LaunchSpec", "free_port", "launch", "rank_command", "rank_env"],
}

CLI = {
    "shardax": ["--debug", "--version"],
    "shardax ckpt": [],
    "shardax config": [],
    "shardax config check": ["--model", "--world-size"],
    "shardax config from-deepspeed": ["--lossy", "--output", "-o"],
    "shardax report": ["--json"],
    "shardax ckpt consolidate": [
        "--buffer-mib",
        "--dtype",
        "--force",
        "--hf",
        "--only",
        "--quiet",
        "-q",
    ],
    "shardax ckpt import": [
        "--buffer-mib",
        "--dtype",
        "--force",
        "--mesh",
        "--prefix",
        "--quiet",
        "--rules",
        "--specs",
        "-q",
    ],
    "shardax ckpt inspect": ["--json"],
    "shardax ckpt reshard": [
        "--buffer-mib",
        "--dtype",
        "--force",
        "--mesh",
        "--quiet",
        "--rules",
        "--specs",
        "-q",
    ],
    "shardax ckpt verify": ["--buffer-mib", "--quiet", "-q"],
    "shardax launch": [
        "--devices",
        "--dry-run",
        "--env",
        "--exclude",
        "--hostfile",
        "--include",
        "--kill-grace",
        "--launcher",
        "--log-ranks",
        "--master-addr",
        "--master-port",
        "--master_addr",
        "--master_port",
        "--max-restarts",
        "--module",
        "--nnodes",
        "--no-python",
        "--no-ssh",
        "--node-rank",
        "--nproc-per-node",
        "--nproc_per_node",
        "--num-nodes",
        "--stop-on-stdin-eof",
        "-m",
    ],
}


def test_public_names_are_frozen():
    for name, expected in SURFACE.items():
        module = importlib.import_module(name)
        assert sorted(module.__all__) == sorted(expected), name
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.{attr}"


def test_each_public_name_has_one_home():
    """``shardax.shard`` is the function (the package of the same name holds
    the machinery): everything the shard package exports is reached from
    ``shardax`` itself, as the same object — or, for the ZeRO entry, from
    ``shardax.rules``, where the presets live."""
    import shardax

    package = sys.modules["shardax.shard"]
    assert callable(shardax.shard) and shardax.shard.__module__ == "shardax.shard._api"
    for attr in package.__all__:
        home = shardax.rules if attr == "ShardOver" else shardax
        assert getattr(home, attr) is getattr(package, attr), attr


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
