"""Run configs: parsing with one source of defaults and clear errors; batch
sizes where any two give the third; the calls a config turns into; the
DeepSpeed importer on real DeepSpeed configs (the shared ones, and
representative ones from DeepSpeed's docs written here); ``shardax config``;
and a converted config training the example GPT on 2 ranks."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch
from click.testing import CliRunner

import shardax as sx
from shardax.cli import main
from shardax.config import (
    BatchConfig,
    ConfigError,
    ResolvedBatch,
    RunConfig,
    from_deepspeed,
    load_config,
)
from shardax.config._deepspeed import to_hjson

ROOT = Path(__file__).resolve().parents[1]
DS_DIR = ROOT / "tests" / "deepspeed_configs"  # copies of ../shared/data/deepspeed-configs
# DeepSpeed's own test configs; DeepSpeedExamples' are test_deepspeed_examples.py's
DS_FILES = sorted(p for p in DS_DIR.glob("*.json") if not p.name.startswith("DeepSpeedExamples_"))

# Representative configs from DeepSpeed's docs and tutorials (config-json,
# the learning-rate-schedule and ZeRO-offload tutorials, the monitor docs).
DS_DOCS = {
    "zero3-offload-auto": {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu"},
            "reduce_bucket_size": "auto",
        },
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}},
    },
    "fp16-warmup-decay": {
        "train_batch_size": 64,
        "gradient_accumulation_steps": 4,
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 2e-4,
                "warmup_num_steps": 100,
                "total_num_steps": 1000,
                "warmup_type": "linear",
            },
        },
        "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "gpt"},
        "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "gpt"},
        "wandb": {"enabled": True, "project": "x"},
    },
    "cosine": {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": 500,
                "warmup_num_steps": 50,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.01,
            },
        },
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
    },
    "one-cycle": {
        "train_batch_size": 16,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}},
        "scheduler": {
            "type": "OneCycle",
            "params": {
                "cycle_first_step_size": 100,
                "cycle_min_lr": 1e-4,
                "cycle_max_lr": 1e-2,
                "decay_lr_rate": 0.001,
                "cycle_momentum": True,
                "cycle_min_mom": 0.85,
                "cycle_max_mom": 0.99,
            },
        },
        "steps_per_print": 50,
        "wall_clock_breakdown": True,
    },
}


def test_defaults_come_from_the_classes_and_unknown_keys_are_errors():
    config = RunConfig.from_text("{}")
    assert config == RunConfig()
    assert config.parallel.zero == 0 and config.mesh == {"dp": -1}
    for text, message in [
        ("zero: 3", r"unknown key zero; the top level takes batch, checkpoint, memory, mesh"),
        ("parallel: {zeros: 3}", r"unknown key parallel.zeros \(did you mean 'zero'\?\)"),
        ("parallel: {zero: 4}", r"ZeRO stage 0\.\.3; got 4"),
        ('optimizer: {type: "adamx"}', r"type is one of .*got 'adamx' \(did you mean 'adam'\?\)"),
        ("optimizer: {lr: -1}", r"lr must be positive"),
        ('mesh: {dp: "two"}', r"mesh.dp: an axis size is an integer"),
        ('monitor: {writers: ["stdout", "wandb"]}', r"writers is one of"),
        ("parallel: {sequence_parallel: true}", r"needs parallel.tp"),
        ('memory: {remat: "save_all"}', r"memory.remat is one of .*got 'save_all'"),
        ("memory: {remat_every: 0}", r"remat_every must be positive"),
        ("{ oops", r"not valid hjson"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_text(text, "run.hjson")


def test_hjson_comments_and_round_trip(tmp_path):
    path = tmp_path / "run.hjson"
    path.write_text(
        '// a comment\nmesh: {dp: -1, tp: 2}\nparallel: {zero: 1, tp: "tp"}\n'
        "batch: {\n  global: 32  # sequences per step\n  accumulation: 2\n}\n"
    )
    config = load_config(path)
    assert config.mesh == {"dp": -1, "tp": 2}
    assert RunConfig.from_dict(config.to_dict()) == config
    assert config.batch.resolve(config.dp_size(8)) == ResolvedBatch(32, 4, 2)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.hjson")


def test_any_two_batch_sizes_give_the_third():
    assert BatchConfig(global_size=64, micro=4).resolve(4) == ResolvedBatch(64, 4, 4)
    assert BatchConfig(global_size=64, accumulation=2).resolve(4) == ResolvedBatch(64, 8, 2)
    assert BatchConfig(micro=4, accumulation=2).resolve(4) == ResolvedBatch(32, 4, 2)
    assert BatchConfig(micro=4).resolve(2) == ResolvedBatch(8, 4, 1)
    with pytest.raises(ConfigError, match=r"global 64 != micro 4 x accumulation 2 x data-parallel "
                       r"size 4 \(= 32\)"):  # fmt: skip
        BatchConfig(global_size=64, micro=4, accumulation=2).resolve(4)
    with pytest.raises(ConfigError, match="not divisible by micro 3 x data-parallel size 4"):
        BatchConfig(global_size=64, micro=3).resolve(4)
    with pytest.raises(ConfigError, match="needs two of global, micro and accumulation"):
        BatchConfig(accumulation=2).resolve(4)


def test_a_config_turns_into_calls():
    config = RunConfig.from_dict(
        {
            "mesh": {"dp": 2, "tp": 2},
            "parallel": {"zero": 3, "tp": "tp"},
            "optimizer": {"type": "adamw", "lr": 1.0, "clip_global_norm": 1.0},
            "schedule": {"type": "warmup_cosine", "warmup_steps": 2, "end_lr": 0.1},
            "steps": 10,
        }
    )
    mesh = config.abstract_mesh(4)
    rules = config.make_rules()
    assert rules.spec_for("blocks.0.mlp.fc.weight", (8, 4), mesh) == sx.P(("tp", "dp"))
    reference = sx.optim.warmup_cosine_decay_schedule(1.0, 2, 10, end_value=0.1)
    assert [config.make_schedule()(s) for s in range(10)] == [reference(s) for s in range(10)]
    opt = config.make_optimizer(accumulation=2)
    state = opt.init({"w": __import__("torch").zeros(2)})
    assert type(state).__name__ == "MultiStepsState"
    log = RunConfig.from_dict({"optimizer": {"lr": 1.0},
                               "schedule": {"type": "warmup_constant", "warmup_steps": 9,
                                            "warmup": "log"}})  # fmt: skip
    lr = log.make_schedule()
    assert lr(0) == 0.0 and lr(9) == 1.0 and lr(500) == 1.0
    assert lr(4) == pytest.approx(math.log(5) / math.log(10))  # DeepSpeed's log warmup
    fp16 = RunConfig.from_dict({"precision": {"params": "fp16", "loss_scale": 1024}})
    assert fp16.make_loss_scale().scale == 1024.0
    assert RunConfig().make_loss_scale() is None
    assert "batch: global 16 = micro 8 x accumulation 1 x data-parallel 2" in RunConfig().plan(2)


def test_experts_in_a_config_split_the_batch_over_dp_and_ep():
    config = RunConfig.from_dict(
        {"mesh": {"dp": 2, "ep": 2, "tp": 2}, "parallel": {"zero": 3, "ep": "ep", "tp": "tp"}}
    )
    assert config.data_axes == ("dp", "ep") and config.dp_size(8) == 4
    mesh = config.abstract_mesh(8)
    rules = config.make_rules()
    gate_up = rules.spec_for("blocks.0.mlp.experts.gate_up_proj", (4, 16, 8), mesh)
    assert gate_up == sx.P(("ep", "dp"), sx.blocks(2, "tp"), None)  # ZeRO-3 adds dp only
    assert rules.spec_for("blocks.0.attn.qkv.weight", (24, 8), mesh) == sx.P(("tp", "dp", "ep"))
    plan = config.plan(8)
    assert "rules.experts('ep', tp='tp', batch=('dp', 'ep')) + rules.zero(3, ('dp', 'ep'))" in plan
    assert "x data-parallel 4" in plan


def test_context_parallelism_in_a_config_shards_over_cp_and_splits_the_sequence():
    """``parallel.cp``: ring attention over its axis, ZeRO over the data and
    cp axes (cp ranks hold the same parameters and sum their gradients), the
    batch's sequence split zigzag over cp while its examples stay split over
    the data axis only; the plan says so, and the file round-trips."""
    config = RunConfig.from_text(
        'mesh: {dp: 2, cp: 2}\nparallel: {zero: 3, cp: "cp"}\nbatch: {global: 8, accumulation: 1}\n'
    )
    assert config.parallel.cp == "cp" and RunConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["parallel"]["cp"] == "cp"
    assert config.batch_spec == sx.P("dp", sx.zigzag("cp")) and config.dp_size(4) == 2
    assert RunConfig().batch_spec == sx.P("dp") and RunConfig().parallel.cp is None
    mesh = config.abstract_mesh(4)
    rules = config.make_rules()
    assert rules.spec_for("blocks.0.attn.qkv.weight", (24, 8), mesh) == sx.P(("dp", "cp"))
    modules = {r.pattern: r for r in rules.modules}
    assert modules["wpe"].inputs == (sx.GlobalPositions("cp"),)  # the piece's global positions
    assert modules[r"blocks\.\d+\.attn"].within == sx.Ring("cp")  # attention: the ring over cp
    assert str(config.make_rules(names="auto")).startswith("Rules(context_parallel('cp', names")
    plan = config.plan(4)
    assert "rules.zero(3, ('dp', 'cp')) + rules.context_parallel('cp')" in plan
    assert "batch: global 8 = micro 4 x accumulation 1 x data-parallel 2" in plan
    # with tensor parallelism and experts: the ring beside megatron; experts count the tokens
    # of every rank the batch's tokens are split over (examples over dp and ep, sequence over cp)
    both = RunConfig.from_dict({"mesh": {"dp": 1, "ep": 2, "cp": 2, "tp": 2},
                                "parallel": {"zero": 1, "ep": "ep", "cp": "cp", "tp": "tp"}})  # fmt: skip
    assert both.batch_spec == sx.P(("dp", "ep"), sx.zigzag("cp"))
    assert "rules.experts('ep', tp='tp', batch=('dp', 'ep', 'cp'))" in both.plan(8)
    assert "rules.zero(1, ('dp', 'ep', 'cp'))" in both.plan(8)


def test_hybrid_sharding_in_a_config_shards_within_replicas():
    """``parallel.replicate``: the batch split over the replicas and the data
    axis, ZeRO over the data axis only (each replica holds every shard), the
    plan says so; an axis named twice, or a replica axis the mesh lacks, is
    refused."""
    config = RunConfig.from_text(
        'mesh: {replicate: 2, dp: 2}\nparallel: {zero: 3, replicate: "replicate"}\n'
        "batch: {global: 8, accumulation: 1}\n"
    )
    assert RunConfig.from_dict(config.to_dict()) == config
    assert config.data_axes == ("replicate", "dp") and config.dp_size(4) == 4
    assert config.batch_spec == sx.P(("replicate", "dp"))
    mesh = config.abstract_mesh(4)
    assert config.make_rules().spec_for("blocks.0.mlp.fc.weight", (16, 8), mesh) == sx.P("dp")
    plan = config.plan(4)
    assert "rules.zero(3, 'dp') in each replica, replicas over 'replicate' (HSDP)" in plan
    assert "batch: global 8 = micro 2 x accumulation 1 x data-parallel 4" in plan
    experts = RunConfig.from_dict({"mesh": {"replicate": 2, "dp": 1, "ep": 2},
                                   "parallel": {"zero": 2, "ep": "ep", "replicate": "replicate"}})  # fmt: skip
    assert experts.data_axes == ("replicate", "dp", "ep")
    assert "rules.zero(2, ('dp', 'ep'))" in experts.plan(4)
    with pytest.raises(ConfigError, match=r"replicate and parallel\.zero_axis both name"):
        RunConfig.from_dict({"parallel": {"replicate": "dp"}})
    with pytest.raises(ConfigError, match=r"parallel\.replicate names mesh axis 'replica'"):
        RunConfig.from_dict(
            {"mesh": {"replicate": 2, "dp": 2}, "parallel": {"replicate": "replica"}}
        )


def test_deepspeed_mics_converts_to_hybrid_sharding():
    """``mics_shard_size: 4`` (ZeRO within groups of 4 ranks, replicas across
    them) becomes the mesh ``{replicate: -1, dp: 4}`` with
    ``parallel.replicate``; -1 (off) changes nothing; a size of 0 is refused."""
    ds = {"train_batch_size": 32, "zero_optimization": {"stage": 3, "mics_shard_size": 4}}
    data, unmapped = from_deepspeed(ds)
    assert unmapped == [] and data["mesh"] == {"replicate": -1, "dp": 4}
    config = RunConfig.from_dict(data)
    assert config.parallel.replicate == "replicate" and config.data_axes == ("replicate", "dp")
    assert config.abstract_mesh(8).shape == {"replicate": 2, "dp": 4}
    off, notes = from_deepspeed({"zero_optimization": {"stage": 3, "mics_shard_size": -1}})
    assert off == {"parallel": {"zero": 3, "persist_below": 100_000}}  # DeepSpeed's default
    assert notes[0][0] == "zero_optimization.mics_shard_size"
    with pytest.raises(ConfigError, match="a group size or -1; got 0"):
        from_deepspeed({"zero_optimization": {"mics_shard_size": 0}})


def test_zeropp_in_a_config_and_from_deepspeed():
    """``parallel.node`` (an axis across nodes the parameters split over
    too), ``parallel.secondary`` (hpZ) and ``parallel.quantize_weights``
    (qwZ) make ZeRO-3 over node × dp with the options, the plan says so;
    DeepSpeed's ``zero_hpz_partition_size`` / ``zero_quantized_weights``
    convert to them (1: off); misuse is refused by name."""
    config = RunConfig.from_text(
        'mesh: {node: 2, dp: 2}\nparallel: {zero: 3, node: "node", secondary: true, '
        "quantize_weights: true}\n"
    )
    assert RunConfig.from_dict(config.to_dict()) == config
    assert config.data_axes == ("node", "dp") and config.batch_spec == sx.P(("node", "dp"))
    placement = config.make_rules().placement("h.0.fc.weight", (16, 8), config.abstract_mesh(4))
    assert placement.weights == "int8" and placement.secondary.spec == sx.P("dp")
    assert "rules.zero(3, ('node', 'dp')) with ZeRO++: int8 weight gathers (qwZ), " in config.plan(
        4
    )
    ds = {
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": 2,
            "zero_quantized_weights": True,
            "stage3_param_persistence_threshold": 0,
        }
    }
    data, unmapped = from_deepspeed(ds)
    assert unmapped == [] and RunConfig.from_dict(data).make_rules() == config.make_rules()
    assert RunConfig.from_dict(data).abstract_mesh(8).shape == {"node": 4, "dp": 2}
    off, notes = from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert off == {"parallel": {"zero": 3, "persist_below": 100_000}}
    assert notes[0][0].endswith("zero_hpz_partition_size")
    with pytest.raises(ConfigError, match=r"need parallel\.zero: 3, got 2"):
        RunConfig.from_dict({"parallel": {"zero": 2, "quantize_weights": True}})
    with pytest.raises(ConfigError, match=r"name the axis across nodes as parallel\.node"):
        RunConfig.from_dict({"parallel": {"zero": 3, "secondary": True}})
    with pytest.raises(ConfigError, match=r"parallel\.node names 'dp'"):
        RunConfig.from_dict({"parallel": {"zero": 3, "node": "dp"}})
    qgz = {"stage": 3, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}
    data, _ = from_deepspeed({"zero_optimization": qgz})
    placement = (
        RunConfig.from_dict(data)
        .make_rules()
        .placement("w", (16, 8), mesh := RunConfig.from_dict(data).abstract_mesh(4))
    )
    assert placement.grads_across == ("node",) and placement.grads.spec == sx.P(("node", "dp")), (
        mesh
    )
    with pytest.raises(ConfigError, match="does not say how many ranks a node has"):
        from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    with pytest.raises(ConfigError, match=r"it needs parallel\.zero 2 or 3"):
        RunConfig.from_dict({"parallel": {"zero": 1, "node": "node", "quantize_grads": True}})


def test_onebit_optimizers_in_a_config_and_from_deepspeed():
    """``onebit_adam`` / ``onebit_lamb`` take ``freeze_step`` (required) and,
    for LAMB, its trust ratio's ``lamb`` settings; the run's gradients stay
    unreduced over the data axes (``unreduced_axes``), which the optimizer
    averages; ZeRO, pipelines and experts are refused by name. DeepSpeed's
    OneBitAdam converts with its arithmetic (no bias correction), OneBitLamb
    with its settings, and ZeroOneAdam with its policies (``var_freeze_step``
    as ``freeze_step``, DeepSpeed's 100000 when it is not given)."""
    run = RunConfig.from_dict({"mesh": {"dp": 4}, "optimizer": {
        "type": "onebit_lamb", "freeze_step": 10, "lamb": {"max_coeff": 0.3}}})  # fmt: skip
    assert RunConfig.from_dict(run.to_dict()) == run and run.unreduced_axes == ("dp",)
    assert (
        "onebit_lamb(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, freeze_step=10, max_coeff=0.3); 1-bit momenta over ('dp',)"
        in run.plan(4)
    )
    run.make_optimizer()
    with pytest.raises(ConfigError, match="onebit_adam needs freeze_step"):
        RunConfig.from_dict({"optimizer": {"type": "onebit_adam"}})
    with pytest.raises(ConfigError, match="freeze_step is a setting of onebit_adam"):
        RunConfig.from_dict({"optimizer": {"type": "adamw", "freeze_step": 3}})
    with pytest.raises(
        ConfigError, match=r"lamb \(the trust ratio's settings\) is for onebit_lamb"
    ):
        RunConfig.from_dict(
            {"optimizer": {"type": "onebit_adam", "freeze_step": 3, "lamb": {"max_coeff": 1}}}
        )
    with pytest.raises(ConfigError, match=r"unknown \['max_ratio'\]"):
        RunConfig.from_dict(
            {"optimizer": {"type": "onebit_lamb", "freeze_step": 3, "lamb": {"max_ratio": 1}}}
        )
    with pytest.raises(ConfigError, match="ZeRO-0 only"):
        RunConfig.from_dict(
            {"parallel": {"zero": 1}, "optimizer": {"type": "onebit_adam", "freeze_step": 3}}
        )
    adam = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000,
            "bias_correction": True, "cuda_aware": False, "comm_backend_name": "nccl"}}}  # fmt: skip
    data, unmapped = from_deepspeed(adam)
    assert data["optimizer"] == {"type": "onebit_adam", "bias_correction": False, "lr": 4e-4,
                                 "freeze_step": 23000}  # fmt: skip
    assert [k for k, _ in unmapped] == [f"optimizer.params.{k}" for k in
                                        ("bias_correction", "cuda_aware", "comm_backend_name")]  # fmt: skip
    lamb = {"optimizer": {"type": "OneBitLamb", "params": {"freeze_step": 5, "max_coeff": 0.3,
                                                           "factor_max": 2.0}}}  # fmt: skip
    data, _ = from_deepspeed(lamb)
    assert data["optimizer"]["lamb"] == {"max_coeff": 0.3, "factor_max": 2.0}
    zero_one = {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 50,
                "local_step_scaler": 100, "local_step_clipper": 8, "bias_correction": True}}}  # fmt: skip
    data, unmapped = from_deepspeed(zero_one)
    assert data["optimizer"] == {"type": "zero_one_adam", "bias_correction": False, "lr": 1e-3,
                                 "freeze_step": 50, "zero_one": {"local_step_scaler": 100,
                                                                 "local_step_clipper": 8}}  # fmt: skip
    assert [k for k, _ in unmapped] == ["optimizer.params.bias_correction"]
    run = RunConfig.from_dict(data)
    assert run.unreduced_axes == ("dp",) and "local steps after the variance freezes" in run.plan(2)
    run.make_optimizer()
    data, _ = from_deepspeed({"optimizer": {"type": "ZeroOneAdam"}})
    assert data["optimizer"]["freeze_step"] == 100000
    with pytest.raises(ConfigError, match="zero_one_adam corrects neither moment's bias"):
        RunConfig.from_dict({"optimizer": {"type": "zero_one_adam", "freeze_step": 3}})
    with pytest.raises(ConfigError, match=r"zero_one \(0/1 Adam's variance and local-step"):
        RunConfig.from_dict({"optimizer": {"type": "adamw", "zero_one": {"local_step_scaler": 2}}})
    bad = {"type": "zero_one_adam", "freeze_step": 3, "bias_correction": False}
    with pytest.raises(ConfigError, match=r"optimizer\.zero_one: unknown \['local_step'\]"):
        RunConfig.from_dict({"optimizer": {**bad, "zero_one": {"local_step": 2}}})
    with pytest.raises(ConfigError, match="ZeRO-0 only"):
        RunConfig.from_dict({"parallel": {"zero": 2}, "optimizer": bad})


@pytest.mark.parametrize("path", DS_FILES, ids=[p.stem for p in DS_FILES])
def test_shared_deepspeed_configs_convert(path):
    """Each real config converts, or is refused naming every key whose loss
    would change the math; with lossy=True it converts, those keys listed,
    and its hjson passes `config check`."""
    ds = json.loads(path.read_text())
    try:
        from_deepspeed(ds)
    except ConfigError as err:
        text = str(err)
        assert "cannot convert without changing what the run computes" in text
        assert "pass --lossy" in text
        listed = text.split("; pass --lossy")[0]
        named = re.findall(r"(?:computes: |\); )([A-Za-z_][\w.]*)", listed)
        assert named, text
        for key in named:  # each a real key of the file, with its section
            section, _, leaf = key.partition(".")
            assert section in ds and (not leaf or leaf.split(".")[-1] in json.dumps(ds)), key
    data, unmapped = from_deepspeed(ds, lossy=True)
    config = RunConfig.from_text(to_hjson(data, unmapped, str(path)))
    assert config.parallel.zero == ds["zero_optimization"]["stage"]
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16"
    assert config.precision.params == precision
    for ds_key, name in [("train_batch_size", "global_size"),
                         ("train_micro_batch_size_per_gpu", "micro"),
                         ("gradient_accumulation_steps", "accumulation")]:  # fmt: skip
        if ds_key in ds:
            assert getattr(config.batch, name) == ds[ds_key]
    if "optimizer" in ds:
        assert config.optimizer.lr == ds["optimizer"]["params"]["lr"]
        assert config.optimizer.type in ("adamw", "adam")
    if "scheduler" in ds:
        assert config.schedule.type == "warmup_constant" and config.schedule.warmup == "log"
        assert config.schedule.warmup_steps == ds["scheduler"]["params"]["warmup_num_steps"]
    assert config.optimizer.clip_global_norm == ds.get("gradient_clipping")
    assert all(why for _, why in unmapped)
    known = {key.split(".")[0] for key, _ in unmapped}
    assert known <= set(ds)


def test_deepspeed_docs_configs_convert():
    data, unmapped = from_deepspeed(DS_DOCS["zero3-offload-auto"])
    config = RunConfig.from_dict(data)
    assert config.parallel.zero == 3 and config.batch.global_size is None
    assert config.batch.resolve(4) == ResolvedBatch(32, 4, 2)  # "auto": computed
    assert config.precision.params == "fp32"  # bf16 "auto": left to the default
    assert config.optimizer.betas == (0.9, 0.95) and config.optimizer.lr == 1e-3  # lr "auto"
    offload = dict(unmapped)
    assert config.memory.offload_opt == "host"  # device: cpu
    assert "streams disk state" in offload["zero_optimization.offload_optimizer.pin_memory"]
    assert config.memory.offload_params == "host"  # offload_param device: cpu
    nvme = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}}
    assert from_deepspeed(nvme)[0]["memory"] == {"offload_opt": "disk:/nvme"}

    data, unmapped = from_deepspeed(DS_DOCS["fp16-warmup-decay"])
    config = RunConfig.from_dict(data)
    assert (config.precision.hysteresis, config.precision.min_loss_scale) == (2, 1.0)
    assert config.precision.params == "fp16" and config.precision.loss_scale == 4096.0
    assert config.precision.dynamic and config.precision.growth_interval == 500
    assert config.optimizer.type == "adamw" and config.optimizer.weight_decay == 0.01
    assert (config.schedule.type, config.schedule.total_steps) == ("warmup_linear", 1000)
    assert config.schedule.deepspeed  # DeepSpeed's stepping: update k at its iteration k - 1
    lr = config.make_schedule()
    assert lr(100) == pytest.approx(1.98e-4) and lr(101) == 2e-4  # the peak, one update late
    assert lr(551) == pytest.approx(1e-4) and lr(1001) == lr(5000) == 0.0  # to warmup_min_lr
    assert config.monitor.writers == ("stdout", "tensorboard", "csv")
    assert config.monitor.dir == "logs/gpt"
    assert [k for k, _ in unmapped] == ["wandb"]
    # what DeepSpeed does when the file leaves them out: window 1000, hysteresis 2, floor 1
    defaults = RunConfig.from_dict(from_deepspeed({"fp16": {"enabled": True}})[0]).precision
    assert (defaults.growth_interval, defaults.hysteresis, defaults.min_loss_scale) == (1000, 2, 1)
    ls = RunConfig.from_dict(data).make_loss_scale()
    assert (ls.hysteresis, ls.min_scale, ls.growth_interval) == (2, 1.0, 500)

    config = RunConfig.from_dict(from_deepspeed(DS_DOCS["cosine"])[0])
    assert config.optimizer.type == "lamb" and config.monitor.comm
    lr = config.make_schedule()  # WarmupCosineLR: lr 0 for the first update (DeepSpeed sets it)
    assert lr(0) == 0.0 and lr(1) == pytest.approx(1e-4) and lr(50) == pytest.approx(1e-3)
    assert lr(500) == pytest.approx(1e-5)

    # SGD: DeepSpeed's OneCycle cycles no momentum (torch's SGD has no betas to cycle)
    data, unmapped = from_deepspeed(DS_DOCS["one-cycle"])
    config = RunConfig.from_dict(data)
    assert config.schedule.type == "one_cycle_linear" and config.optimizer.lr == 1e-2
    assert config.optimizer.momentum == 0.9 and config.monitor.log_every == 50
    assert config.monitor.timers
    lr = config.make_schedule()  # linear up and down; no decay_step_size: no decay
    assert [lr(s) for s in (0, 50, 100, 150, 200, 5000)] == pytest.approx(
        [1e-4, 5.05e-3, 1e-2, 5.05e-3, 1e-4, 1e-4], rel=1e-12
    )
    assert {"scheduler.params.cycle_min_mom", "scheduler.params.cycle_max_mom"} == dict(
        unmapped
    ).keys()

    adam = from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False,
                                                                      "weight_decay": 0.1}}})  # fmt: skip
    assert adam == ({"optimizer": {"type": "adam", "weight_decay": 0.1}}, [])  # L2, faithfully
    with pytest.raises(ConfigError, match="fp16 and bf16 are both enabled"):
        from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, lossy=True)
    with pytest.raises(ConfigError, match=r"optimizer\.type='SuperAdam' \(shardax has adamw"):
        from_deepspeed({"optimizer": {"type": "SuperAdam"}})
    with pytest.raises(ConfigError, match=r"scheduler\.type='LRRangeTest' \(shardax maps"):
        from_deepspeed({"scheduler": {"type": "LRRangeTest"}})
    with pytest.raises(ConfigError, match=r"curriculum_learning \(curriculum learning changes"):
        from_deepspeed({"curriculum_learning": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"bogus_feature \(no shardax setting"):
        from_deepspeed({"bogus_feature": {"enabled": True}})
    harmless = from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {}}})
    # device none, and the persistence threshold: DeepSpeed's defaults
    assert harmless == ({"parallel": {"zero": 3, "persist_below": 100_000}}, [])
    old = from_deepspeed({"zero_optimization": {"cpu_offload": False, "cpu_offload_params": True}})
    assert old[0]["memory"] == {"offload_params": "host"}


def test_config_cli(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**DS_DOCS["fp16-warmup-decay"], "curriculum_learning": {}}))
    out = tmp_path / "run.hjson"
    result = CliRunner().invoke(main, ["config", "from-deepspeed", str(ds), "-o", str(out)])
    assert result.exit_code == 2 and "curriculum_learning" in result.output and not out.exists()
    args = ["config", "from-deepspeed", str(ds), "-o", str(out), "--lossy"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "not mapped: wandb: no wandb writer" in result.output
    text = out.read_text()
    assert text.startswith("// converted from") and "//   curriculum_learning:" in text
    assert "[changes the math]" in text.split("curriculum_learning:")[1].splitlines()[0]
    result = CliRunner().invoke(main, ["config", "check", str(out), "--world-size", "4"])
    assert result.exit_code == 0, result.output
    assert "batch: global 64 = micro 4 x accumulation 4 x data-parallel 4" in result.output
    assert "fp16 with fp32 master weights, dynamic loss scale" in result.output
    bad = tmp_path / "bad.hjson"
    bad.write_text("batch: {global: 10, micro: 3, accumulation: 1}\n")
    result = CliRunner().invoke(main, ["config", "check", str(bad), "--world-size", "2"])
    assert result.exit_code == 2 and "global 10 != micro 3 x accumulation 1" in result.output
    model = "examples/gpt.py:small"
    result = CliRunner().invoke(main, ["config", "check", str(out), "--model", str(ROOT / model)])
    assert result.exit_code == 0, result.output
    assert "wte.weight" in result.output


def test_a_converted_deepspeed_config_trains_the_example_gpt(tmp_path):
    """fp16, ZeRO-2, micro 8 x 3 accumulation steps (Megatron-GPT2's
    DeepSpeed config) on 2 ranks: the loss goes down, a checkpoint is saved."""
    source = DS_DIR / "model_Megatron_GPT2_ds_config_func_bs8_zero2_gas3.json"
    run = tmp_path / "run.hjson"
    CliRunner().invoke(main, ["config", "from-deepspeed", str(source), "-o", str(run)])
    done = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "--nproc-per-node", "2",
         "examples/train_gpt.py", "--config", str(run), "--preset", "tiny", "--steps", "6",
         "--eval-batches", "0", "--sample-tokens", "0", "--out", str(tmp_path / "ckpt")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ZeRO-2, adamw, fp16, global batch 48 x 64 tokens in 3 micro-steps" in done.stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in done.stdout.splitlines()
              if "] step " in line]  # fmt: skip
    assert losses and losses[-1] < losses[0]
    assert (tmp_path / "ckpt" / "step-00000006").is_dir()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "steps: 10\noptimizer: {lr: 1e-3}\nsteps: 20\n",
            "run.hjson:3: duplicate key 'steps': the later value would silently replace",
        ),
        (
            'optimizer: {\n  type: "adamw"\n  lr: 1e-3\n  lr: 2e-3\n}\n',
            "run.hjson:4: duplicate key 'lr'",
        ),
        ("seed: 1\nsteps: true\n", "run.hjson:2: steps is an integer; got True"),
        ("steps: 2.5\n", "run.hjson:1: steps is an integer; got 2.5"),
        ("steps: 100000000000000000000000\n", "run.hjson:1: steps is an integer; got 1000"),
        (
            'optimizer: {\n  type: "adamw"\n  lr: 1e400\n}\n',
            "run.hjson:3: the number 1e400 is too large (not a finite number)",
        ),
        ('optimizer: {lr: "0.1"}\n', "run.hjson:1: optimizer.lr is a number; got '0.1'"),
        ("optimizer: {betas: [0.9, true]}\n", "optimizer.betas[1] is a number; got True"),
        ('parallel: {zero: "auto"}\n', "run.hjson:1: parallel.zero is an integer; got 'auto'"),
        ('checkpoint: {async_save: "no"}\n', "checkpoint.async_save is true or false; got 'no'"),
        ('monitor: {writers: ["stdout", 3]}\n', "monitor.writers[1] is a string; got 3"),
        (
            'steps: 100\nschedule: {type: "warmup_cosine", warmup_steps: 200}\n',
            "schedule.warmup_steps (200) must be less than the total steps (steps = 100)",
        ),
        (
            'steps: 100\nschedule: {type: "warmup_constant", warmup_steps: 101}\n',
            "schedule.warmup_steps (101) must be at most the total steps (steps = 100)",
        ),
        (
            "mesh: {data: -1}\nparallel: {zero: 2}\n",
            "parallel.zero_axis names mesh axis 'dp', but the mesh {'data': -1} has axes ['data']",
        ),
        (
            'mesh: {dp: -1, tp: 2}\nparallel: {tp: "pt"}\n',
            "parallel.tp names mesh axis 'pt' (did you mean 'tp'?)",
        ),
        (
            '\noptimizer: {typ: "adamw"}\n',
            "run.hjson:2: unknown key optimizer.typ (did you mean 'type'?)",
        ),
        (
            'mesh: {dp: -1, pp: 2}\nparallel: {pp: "pp", pp_schedule: "zb"}\n',
            "parallel.pp_schedule is one of",
        ),
        (
            'mesh: {dp: -1, pp: 2}\nparallel: {pp: "pp"}\nprecision: {params: "fp16"}\n',
            "parallel.pp with fp16: dynamic loss scaling would skip steps stage by stage",
        ),
        (
            'mesh: {dp: -1, pp: 2}\nparallel: {pp: "pp"}\nbatch: {global: 16, accumulation: 2}\n',
            "a pipeline accumulates over its own micro-batches; set parallel.pp_micro_batches",
        ),
        (
            'mesh: {dp: -1, pp: 2, ep: 2}\nparallel: {pp: "pp", ep: "ep"}\n',
            "parallel.pp with parallel.ep: experts inside pipeline stages are not supported yet",
        ),
        ('mesh: {dp: -1}\nparallel: {ep: "dp"}\n', "parallel.ep and parallel.zero_axis both name"),
        ('mesh: {dp: -1}\nparallel: {ep: "ep"}\n', "parallel.ep names mesh axis 'ep'"),
        (
            'mesh: {dp: -1, cp: 2}\nparallel: {\n  zero: 3\n  cp: "dp"\n}\n',
            "run.hjson:4: parallel.cp and parallel.zero_axis both name the axis 'dp': context "
            "parallelism needs an axis of its own",
        ),
        (
            'mesh: {dp: -1, tp: 2}\nparallel: {tp: "tp", cp: "tp"}\n',
            "run.hjson:2: parallel.cp and parallel.tp both name the axis 'tp'",
        ),
        ('mesh: {dp: -1, ep: 2}\nparallel: {ep: "ep", cp: "ep"}\n', "parallel.cp and parallel.ep"),
        ('mesh: {dp: -1, sp: 2}\nparallel: {sp: "sp", cp: "sp"}\n', "parallel.cp and parallel.sp"),
        ('mesh: {dp: -1, pp: 2}\nparallel: {pp: "pp", cp: "pp"}\n', "parallel.cp and parallel.pp"),
        (
            'mesh: {dp: -1, cp: 2}\nparallel: {cp: "cpp"}\n',
            "run.hjson:2: parallel.cp names mesh axis 'cpp' (did you mean 'cp'?), but the mesh",
        ),
        (
            "mesh: {dp: -1, cp: 2}\n",
            "mesh axis 'cp' (size 2) of {'dp': -1, 'cp': 2} is used by no preset",
        ),
        (
            'schedule: {type: "one_cycle_linear"}\n',
            "run.hjson: schedule.up_steps is needed by schedule one_cycle_linear",
        ),
        (
            "steps: 10\nschedule: {up_steps: 5}\n",
            "run.hjson:2: schedule.up_steps is a setting of schedule one_cycle_linear; schedule "
            "constant does not use it",
        ),
        (
            'schedule: {type: "one_cycle_linear", up_steps: 4, down_steps: -1}\n',
            "run.hjson:1: schedule.down_steps must be >= 0; got -1",
        ),
        (
            'schedule: {type: "one_cycle", deepspeed: true}\n',
            "run.hjson:1: schedule.deepspeed is a setting of schedules warmup_constant, "
            "warmup_linear, warmup_cosine",
        ),
        (
            'schedule: {type: "warmup_constant", deepspeed: true}\n',
            "run.hjson: schedule.warmup_steps is at least 1 with deepspeed (DeepSpeed's "
            "warmup_num_steps is a positive integer); got 0",
        ),
        ('schedule: {deepspeed: "yes"}\n', "schedule.deepspeed is true or false; got 'yes'"),
        (
            "precision: {\n  cast_inputs: true\n}\n",
            "run.hjson:2: precision.cast_inputs casts the model's floating-point inputs to the "
            "params' half dtype, and params is fp32",
        ),
        (
            'optimizer: {\n  type: "lamb"\n  bias_correction: false\n}\n',
            "run.hjson:3: optimizer.bias_correction is false, a switch of adam and adamw only",
        ),
    ],
)
def test_every_bad_value_is_a_typed_error_naming_file_line_and_key(text, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_text(text, "run.hjson")
    assert message in str(err.value)


def test_a_pipeline_config_makes_its_schedule_and_an_optimizer_that_leaves_clipping_out():
    run = RunConfig.from_text(
        'mesh: {dp: -1, pp: 2}\nparallel: {pp: "pp", pp_schedule: "zbv", zero: 1}\n'
        "optimizer: {clip_global_norm: 1.0}\n"
    )
    schedule = run.make_pipeline(4)
    assert (len(schedule.ranks), schedule.stages, schedule.micro_batches) == (2, 4, 4)
    assert RunConfig().make_pipeline(4) is None
    with pytest.raises(ConfigError, match=r"clip with shardax\.pipeline\.clip_by_global_norm"):
        run.make_optimizer()
    plain = RunConfig.from_text("optimizer: {clip_global_norm: 1.0}\n").make_optimizer()
    piped = run.make_optimizer(clip=False)  # clipping's place kept: the same state either way
    params = {"w": torch.ones(2)}
    assert optree.tree_structure(piped.init(params)) == optree.tree_structure(plain.init(params))


def test_a_good_config_still_loads_with_its_types():
    config = RunConfig.from_text(
        'steps: 100\nschedule: {type: "warmup_constant", warmup_steps: 100}\n'
        "optimizer: {lr: 1, betas: [0.9, 0.95]}\nbatch: {global: 16.0, micro: 4}\n"
    )
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.batch.global_size == 16 and isinstance(config.batch.global_size, int)


def test_muon_in_a_config_and_from_deepspeed():
    """``optimizer.type: muon`` needs its momentum and takes ``muon``'s
    settings; the plan counts 4 bytes of state on its matrices. DeepSpeed's
    Muon converts with its arithmetic (the spectral scale) and its
    defaults, the Adam group's own learning rate as ``muon.adam_lr``, and
    notes what the config cannot say (which params take Muon)."""
    run = RunConfig.from_dict({"optimizer": {"type": "muon", "lr": 0.02, "momentum": 0.95,
                                             "muon": {"scale": "spectral", "adam_lr": 3e-4}}})  # fmt: skip
    assert RunConfig.from_dict(run.to_dict()) == run
    assert "muon(lr=0.02, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, momentum=0.95, scale=spectral, adam_lr=0.0003)" in run.plan(2)  # fmt: skip
    run.make_optimizer()
    with pytest.raises(ConfigError, match="muon needs momentum"):
        RunConfig.from_dict({"optimizer": {"type": "muon"}})
    with pytest.raises(ConfigError, match=r"muon\.scale is one of \('moonlight', 'spectral'\)"):
        RunConfig.from_dict({"optimizer": {"type": "muon", "momentum": 0.9, "muon": {"scale": 1}}})
    with pytest.raises(ConfigError, match=r"muon \(Muon's settings\) is for type muon"):
        RunConfig.from_dict({"optimizer": {"type": "adamw", "muon": {"ns_steps": 3}}})
    data, unmapped = from_deepspeed({"optimizer": {"type": "Muon", "params": {
        "lr": 0.01, "adam_lr": 1e-3, "weight_decay": 0.1}}})  # fmt: skip
    assert data["optimizer"] == {"type": "muon", "lr": 0.01, "momentum": 0.95,
                                 "betas": [0.9, 0.95], "eps": 1e-10, "weight_decay": 0.1,
                                 "muon": {"scale": "spectral", "adam_lr": 1e-3}}  # fmt: skip
    assert [k for k, _ in unmapped] == ["optimizer.params.ns_method", "optimizer.type=Muon"]
    RunConfig.from_dict(data).make_optimizer()


def test_persist_below_in_a_config_and_from_deepspeed():
    """``parallel.persist_below`` (ZeRO-3) keeps the parameters of fewer
    elements whole, and the plan says so; DeepSpeed's
    ``stage3_param_persistence_threshold`` converts to it — its default,
    100000, where a ZeRO-3 config gives none, as DeepSpeed would run it; at
    stages 0-2 a note, nothing split to keep whole; misuse refused by name."""
    config = RunConfig.from_text("parallel: {zero: 3, persist_below: 1000}\n")
    assert RunConfig.from_dict(config.to_dict()) == config
    rules, mesh = config.make_rules(), config.abstract_mesh(4)
    assert rules.spec_for("h.0.ln.weight", (64,), mesh, "params") == sx.P()
    assert rules.spec_for("h.0.ln.weight", (64,), mesh, "grads") == sx.P("dp")
    assert rules.spec_for("h.0.fc.weight", (64, 64), mesh, "params") == sx.P("dp")
    assert "parameters of < 1000 elements whole" in config.plan(4)
    data, unmapped = from_deepspeed(
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4}}
    )
    assert data == {"parallel": {"zero": 3, "persist_below": 10_000}} and unmapped == []
    data, unmapped = from_deepspeed(
        {"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 1e4}}
    )
    assert data == {"parallel": {"zero": 2}}
    assert unmapped[0][0] == "zero_optimization.stage3_param_persistence_threshold"
    assert "only ZeRO-3 splits parameters" in unmapped[0][1]
    with pytest.raises(
        ConfigError, match=r"a number >= 0 with parallel.zero: 3; got 10 with zero 2"
    ):
        RunConfig.from_dict({"parallel": {"zero": 2, "persist_below": 10}})


def test_keep_gathered_in_a_config():
    """``parallel.keep_gathered`` (ZeRO-3) places every split parameter to
    be kept from its forward gather to the backward, and the plan says so;
    without ZeRO-3, or beside hpZ's secondary copy, it is refused by name."""
    config = RunConfig.from_text("parallel: {zero: 3, keep_gathered: true}\n")
    assert RunConfig.from_dict(config.to_dict()) == config
    placement = config.make_rules().placement("h.0.fc.weight", (64, 64), config.abstract_mesh(4))
    assert placement.keep_gathered and "keep_gathered=True" in repr(placement)
    assert "gathered parameters kept for the backward" in config.plan(4)
    with pytest.raises(ConfigError, match=r"it needs parallel\.zero: 3, and replaces secondary"):
        RunConfig.from_dict({"parallel": {"zero": 2, "keep_gathered": True}})
