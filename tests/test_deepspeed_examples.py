"""The DeepSpeed importer on DeepSpeedExamples' configs (copies in
``tests/deepspeed_configs/DeepSpeedExamples_*``, named by their path in
microsoft/DeepSpeedExamples) and the keys they use, each checked against
DeepSpeed's own semantics: Adam's ``bias_correction: false``,
``fp16.auto_cast``, OneCycle's decay phase (step by step against
DeepSpeed's ``OneCycle`` where DeepSpeed is installed, against a reference
formula everywhere), WarmupLR / WarmupDecayLR / WarmupCosineLR update by
update (the same two ways), ``autotuning``, ``cuda_visible_devices``, files that
are not JSON or hjson, and the features refused by key."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardax.cli import main
from shardax.config import ConfigError, RunConfig, from_deepspeed
from shardax.config._deepspeed import to_hjson
from shardax.config._deepspeed_file import convert_deepspeed_file, read_deepspeed

DS_DIR = Path(__file__).resolve().parent / "deepspeed_configs"
PREFIX = "DeepSpeedExamples_"

# What each copied config converts to (None: it converts), or the keys a
# refusal names, each with the line it is written on.
EXAMPLES: dict[str, dict[str, int] | None] = {
    "training_BingBertSquad_deepspeed_bsz24_config": None,  # Adam, bias_correction: false
    "training_BingBertGlue_glue_bert_base": None,  # bias_correction: true
    "training_imagenet_config_ds_fp16_config": None,  # fp16.auto_cast, cuda_visible_devices
    "training_autotuning_hf_dsconfigs_ds_config_fp16_tune": None,  # autotuning
    "compression_bert_config_ds_config": None,  # compression_training, every part disabled
    "training_bing_bert_deepspeed_bsz64k_lamb_config_seq128": {
        "optimizer.params.bias_correction": 11,  # Lamb: no switch
        "optimizer.params.max_coeff": 12,
        "optimizer.params.min_coeff": 13,
        "sparse_attention": 24,
    },
    "training_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128": {
        "progressive_layer_drop": 21,
    },
    "compression_gpt2_config_ds_config_W8A8_Qgroup64_fp16": {"compression_training": 32},
    "training_data_efficiency_vit_finetuning_config_ds_config_cifar_random_ltd": {
        "data_efficiency": 23,
    },
    # the 18 configs of DeepSpeed's 1-bit optimizers: OneBitAdam, OneBitLamb and ZeroOneAdam convert
    **{f"training_BingBertSquad_1-bit_adam_{net}_deepspeed_onebitadam_bsz96_config": None
       for net in ("mpi_ethernet", "mpi_infiniband", "nccl")},
    **{f"training_bing_bert_1-bit_adam_{net}_deepspeed_bsz4k_onebitadam_config_seq128_{net}": None
       for net in ("mpi_ethernet", "mpi_infiniband", "nccl")},
    **{f"training_bing_bert_1-bit_lamb_{net}_deepspeed_bsz{size}_onebitlamb_config_seq{seq}_{net}": None
       for net in ("mpi_ethernet", "mpi_infiniband", "nccl") for size, seq in (("32k", 512), ("64k", 128))},
    **{f"training_bing_bert_01_adam_{net}_deepspeed_bsz4k_01adam_config_seq{seq}_{net}": None
       for net in ("mpi_ethernet", "mpi_infiniband", "nccl") for seq in (128, 512)},
}  # fmt: skip
TEMPLATE = DS_DIR / f"{PREFIX}compression_bert_config_ds_config_TEMPLATE.json"


def _path(name: str) -> Path:
    return DS_DIR / f"{PREFIX}{name}.json"


def test_every_copied_example_is_checked():
    copied = {p.stem[len(PREFIX) :] for p in DS_DIR.glob(f"{PREFIX}*.json") if p != TEMPLATE}
    assert copied == set(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_deepspeed_examples_convert_or_are_refused_by_key_and_line(name):
    path = _path(name)
    ds = json.loads(path.read_text())
    refused = EXAMPLES[name]
    if refused is None:
        data, unmapped = convert_deepspeed_file(path)
        config = RunConfig.from_text(to_hjson(data, unmapped, str(path)))  # as `config check`
        for ds_key, field in [("train_batch_size", "global_size"),
                              ("train_micro_batch_size_per_gpu", "micro"),
                              ("gradient_accumulation_steps", "accumulation")]:  # fmt: skip
            if isinstance(ds.get(ds_key), int):
                assert getattr(config.batch, field) == ds[ds_key]
        fp16 = ds.get("fp16", {}).get("enabled") is True
        assert config.precision.params == ("fp16" if fp16 else "fp32")
        if "optimizer" in ds:
            assert config.optimizer.lr == ds["optimizer"]["params"]["lr"]
        assert all(why for _, why in unmapped) and {k.split(".")[0] for k, _ in unmapped} <= set(ds)
        return
    with pytest.raises(ConfigError) as err:
        convert_deepspeed_file(path)
    text = str(err.value)
    assert text.startswith(f"{path}: DeepSpeed config: cannot convert without changing")
    listed = dict(re.findall(r"(?:computes: |\); )([\w.]+)(?:='\w+')? \(line (\d+): ", text))
    assert {k: int(v) for k, v in listed.items()} == refused
    for key, line in refused.items():  # the line is where the key is written
        assert f'"{key.split(".")[-1]}"' in path.read_text().splitlines()[line - 1]
    data, unmapped = convert_deepspeed_file(path, lossy=True)
    assert set(refused) <= {k.split("=")[0] for k, _ in unmapped}
    RunConfig.from_dict(data)


# -- optimizer.params.bias_correction ---------------------------------------------


def _fused_adam_without_bias_correction(p, grads, lr, b1, b2, eps, wd):
    """DeepSpeed's FusedAdam / DeepSpeedCPUAdam step with ``bias_correction=False``
    and ``adam_w_mode`` (csrc/adam/multi_tensor_adam.cu, cpu_adam_impl.cpp):
    ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``, no ``1 - beta**t``."""
    p, m, v = p.clone().double(), torch.zeros_like(p).double(), torch.zeros_like(p).double()
    for g in grads:
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + wd * p)
    return p


def test_bias_correction_false_is_fused_adams_switch():
    path = _path("training_BingBertSquad_deepspeed_bsz24_config")
    data, unmapped = convert_deepspeed_file(path)
    assert data["optimizer"] == {"type": "adamw", "lr": 3e-5, "weight_decay": 0.0,
                                 "bias_correction": False, "clip_global_norm": 1.0}  # fmt: skip
    assert unmapped == []
    assert (
        "bias_correction"
        not in convert_deepspeed_file(_path("training_BingBertGlue_glue_bert_base"))[0]["optimizer"]
    )  # true: the default, nothing to say
    config = RunConfig.from_dict(
        {**data, "optimizer": {**data["optimizer"], "lr": 0.1, "weight_decay": 0.01}}
    )
    assert "bias_correction=False" in config.plan(1)
    opt = config.make_optimizer(clip=False)
    torch.manual_seed(0)
    p0 = torch.randn(64)
    grads = [torch.randn(64) for _ in range(3)]
    params = {"w": p0.clone()}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": g}, state, params)
        params = {"w": params["w"] + updates["w"]}
    expected = _fused_adam_without_bias_correction(p0, grads, 0.1, 0.9, 0.999, 1e-8, 0.01)
    # fp32 against a float64 reference over 3 steps: a few ulps of each fp32 op
    torch.testing.assert_close(params["w"], expected.float(), rtol=1e-6, atol=1e-6)
    with_correction = RunConfig.from_dict({"optimizer": {"lr": 0.1}}).make_optimizer()
    first, _ = with_correction.update({"w": grads[0]}, with_correction.init({"w": p0}), {"w": p0})
    assert not torch.allclose(first["w"], params["w"] - p0)  # the switch changes the step

    with pytest.raises(ConfigError, match=r"optimizer\.params\.bias_correction \(shardax's lamb"):
        from_deepspeed({"optimizer": {"type": "Lamb", "params": {"bias_correction": False}}})
    with pytest.raises(ConfigError, match=r"bias_correction is false, a switch of adam and adamw"):
        RunConfig.from_dict({"optimizer": {"type": "lamb", "bias_correction": False}})
    with pytest.raises(ConfigError, match=r"optimizer\.params\.bias_correction is true or false"):
        from_deepspeed({"optimizer": {"type": "Adam", "params": {"bias_correction": "no"}}})


def test_bias_correction_false_is_deepspeed_cpu_adams():
    """Against DeepSpeed's own Adam with ``bias_correction=False`` (the CPU
    one: FusedAdam needs CUDA), as the converted BingBertSquad config makes it."""
    pytest.importorskip("deepspeed")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    torch.manual_seed(0)
    p0, grads = torch.randn(64), [torch.randn(64) for _ in range(3)]
    theirs = torch.nn.Parameter(p0.clone())
    try:  # builds DeepSpeed's C++ op (cached; the benchmarks' tests build it too)
        opt = DeepSpeedCPUAdam([theirs], lr=0.1, bias_correction=False, weight_decay=0.01)
    except Exception as err:  # no compiler: nothing of DeepSpeed's to compare with
        pytest.skip(f"DeepSpeedCPUAdam cannot be built here: {type(err).__name__}: {err}")
    data, _ = convert_deepspeed_file(_path("training_BingBertSquad_deepspeed_bsz24_config"))
    data["optimizer"].update(lr=0.1, weight_decay=0.01)
    ours = RunConfig.from_dict(data).make_optimizer(clip=False)
    params = {"w": p0.clone()}
    state = ours.init(params)
    for g in grads:
        theirs.grad = g.clone()
        opt.step()
        updates, state = ours.update({"w": g}, state, params)
        params = {"w": params["w"] + updates["w"]}
    # DeepSpeed's vectorised kernel is off the exact (float64) step by up to ~3e-6 per
    # update here (measured: 2.1e-6, 5.0e-6, 8.3e-6 after 1, 2, 3 steps of ~0.3); with
    # bias correction the first step alone would differ by ~0.2
    torch.testing.assert_close(params["w"], theirs.detach(), rtol=0, atol=2e-5)


# -- fp16.auto_cast ---------------------------------------------------------------


def _inputs():
    return (
        torch.ones(2, 3),
        torch.arange(4),
        [torch.zeros(2, dtype=torch.float64), {"mask": torch.ones(2), "ids": torch.arange(2)}],
        None,
        3.5,
    )


def _dtypes(tree):
    import optree

    return optree.tree_map(lambda x: getattr(x, "dtype", x), tree, none_is_leaf=True)


def test_auto_cast_casts_the_floating_inputs_to_fp16():
    path = _path("training_imagenet_config_ds_fp16_config")
    data, _ = convert_deepspeed_file(path)
    assert data["precision"]["params"] == "fp16" and data["precision"]["cast_inputs"] is True
    config = RunConfig.from_dict(data)
    assert "floating inputs cast to it" in config.plan(1)
    cast = config.make_input_cast()
    out = cast(_inputs())
    assert _dtypes(out) == (torch.float16, torch.int64,
                            [torch.float16, {"mask": torch.float16, "ids": torch.int64}],
                            None, 3.5)  # fmt: skip
    same = _inputs()
    assert RunConfig().make_input_cast()(same) is same
    plain = from_deepspeed({"fp16": {"enabled": True}})[0]
    assert "cast_inputs" not in plain["precision"]  # auto_cast: false, DeepSpeed's default
    with pytest.raises(ConfigError, match=r"fp16\.auto_cast \(DeepSpeed casts the model's"):
        from_deepspeed({"fp16": {"enabled": False, "auto_cast": True}})
    with pytest.raises(ConfigError, match=r"cast_inputs casts .* params is fp32"):
        RunConfig.from_dict({"precision": {"cast_inputs": True}})


def test_auto_cast_is_deepspeeds_cast_of_the_inputs():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = types.SimpleNamespace()  # _cast_inputs_half recurses through self only
    engine._cast_inputs_half = lambda x: DeepSpeedEngine._cast_inputs_half(engine, x)
    config = RunConfig.from_dict({"precision": {"params": "fp16", "cast_inputs": True}})
    ours, theirs = config.make_input_cast()(_inputs()), engine._cast_inputs_half(_inputs())
    assert _dtypes(ours) == _dtypes(theirs)


# -- scheduler OneCycle -----------------------------------------------------------

ONE_CYCLES = {
    "decay": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 7,
              "decay_lr_rate": 0.001, "decay_step_size": 3},
    "asymmetric-stairs": {"cycle_min_lr": 3e-5, "cycle_max_lr": 3e-3, "cycle_first_step_size": 5,
                          "cycle_second_step_size": 9, "cycle_first_stair_count": 2,
                          "cycle_second_stair_count": 3, "decay_lr_rate": 0.2,
                          "decay_step_size": 4},
    "no-decay-step": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                      "decay_lr_rate": 0.5},  # decay_step_size 0: no decay
    "no-fall": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                "cycle_second_step_size": 0, "decay_lr_rate": 1.0, "decay_step_size": 1},
}  # fmt: skip


def _ds_config(params, optimizer="SGD"):
    return {  # the scheduler first: its learning rate wins over the optimizer's either way
        "scheduler": {"type": "OneCycle", "params": {**params, "cycle_momentum": False}},
        "optimizer": {"type": optimizer, "params": {"lr": 0.5}},
    }


def _reference(k, p):
    """DeepSpeed's OneCycle written out: linear up over the first half, down
    over the second (in stairs: floor of the fraction reached), then
    ``min / (1 + rate * steps_after / decay_step_size)``."""
    low, high, up = p["cycle_min_lr"], p["cycle_max_lr"], p["cycle_first_step_size"]
    down = p.get("cycle_second_step_size", up)
    total, rate, every = up + down, p.get("decay_lr_rate", 0), p.get("decay_step_size", 0)
    if k < total:
        rising = k <= up
        stairs = p.get("cycle_first_stair_count", 0) if rising else p.get(
            "cycle_second_stair_count", p.get("cycle_first_stair_count", 0))  # fmt: skip
        num, den = (k, up) if rising else (total - k, down)
        frac = (num * stairs // den) / stairs if stairs else num / den
        return low + (high - low) * frac
    return low if not (rate and every) else low / (1 + rate * (k - total) / every)


@pytest.mark.parametrize("case", sorted(ONE_CYCLES))
def test_one_cycle_follows_deepspeeds_formula(case):
    params = ONE_CYCLES[case]
    data, unmapped = from_deepspeed(_ds_config(params))
    assert data["schedule"]["type"] == "one_cycle_linear" and unmapped == []
    assert data["optimizer"]["lr"] == params["cycle_max_lr"]  # not the optimizer's 0.5
    lr = RunConfig.from_dict(data).make_schedule()
    for k in range(60):
        # DeepSpeed's arithmetic goes through k / total and first / total: a few ulps
        assert lr(k) == pytest.approx(_reference(k, params), rel=1e-12, abs=0), k


@pytest.mark.parametrize("case", sorted(ONE_CYCLES))
def test_one_cycle_is_deepspeeds_one_cycle_step_by_step(case):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.lr_schedules import OneCycle

    params = ONE_CYCLES[case]
    lr = RunConfig.from_dict(from_deepspeed(_ds_config(params))[0]).make_schedule()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = OneCycle(opt, cycle_momentum=False, **params)
    for k in range(60):  # the engine steps the scheduler after each update
        assert lr(k) == opt.param_groups[0]["lr"], k  # the same float operations
        opt.step()
        scheduler.step()


def test_one_cycle_linear_arguments_are_checked():
    from shardax.optim._schedules import one_cycle_linear

    for kwargs, message in [
        ({"up_steps": 0}, "up_steps must be >= 1; got 0"),
        ({"up_steps": 2.5}, "up_steps must be an int; got 2.5"),
        ({"up_steps": 4, "down_steps": -1}, "down_steps must be >= 0; got -1"),
        ({"up_steps": 4, "decay_steps": -2}, "decay_steps must be >= 0; got -2"),
        ({"up_steps": 4, "up_stairs": -1}, "up_stairs must be >= 0; got -1"),
    ]:
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            one_cycle_linear(0.1, 1.0, **kwargs)


# -- schedulers WarmupLR, WarmupDecayLR, WarmupCosineLR ------------------------------

WARMUPS = {  # DeepSpeed's scheduler and its params, beside an SGD optimizer at lr OPTIMIZER_LR
    "lr-log": ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3,
                            "warmup_num_steps": 7}),  # warmup_type: log by default
    "lr-linear": ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3,
                               "warmup_num_steps": 7, "warmup_type": "linear"}),
    "lr-log-1": ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                              "warmup_num_steps": 1, "warmup_type": "log"}),
    "lr-linear-1": ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1,
                                 "warmup_num_steps": 1, "warmup_type": "linear"}),
    "lr-log-2": ("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "log"}),  # to the optimizer's
    "lr-linear-2": ("WarmupLR", {"warmup_min_lr": 1e-3, "warmup_num_steps": 2,
                                 "warmup_type": "linear"}),
    "decay-log": ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 1e-4,
                                    "warmup_max_lr": 1e-2, "warmup_num_steps": 5}),
    "decay-linear": ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 0,
                                       "warmup_max_lr": 2e-4, "warmup_num_steps": 3,
                                       "warmup_type": "linear"}),
    "decay-log-1": ("WarmupDecayLR", {"total_num_steps": 6, "warmup_min_lr": 3e-5,
                                      "warmup_max_lr": 3e-3, "warmup_num_steps": 1}),
    "decay-linear-2": ("WarmupDecayLR", {"total_num_steps": 9, "warmup_min_lr": 3e-5,
                                         "warmup_max_lr": 3e-3, "warmup_num_steps": 2,
                                         "warmup_type": "linear"}),
    "decay-default-peak": ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4}),
    "cosine-log": ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 6,
                                      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    "cosine-linear": ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 4,
                                         "warmup_type": "linear", "warmup_min_ratio": 0.3}),
    "cosine-log-1": ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 1}),
    "cosine-linear-2": ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 2,
                                           "warmup_type": "linear", "cos_min_ratio": 0.0}),
}  # fmt: skip
OPTIMIZER_LR = 0.5
UPDATES = 40  # past every warmup and decay above
# The reference divides by log(n) where DeepSpeed multiplies by 1 / log(n),
# and the converted cosine takes its ratios back from init_lr / lr and
# end_lr / lr: each a rounding or two of 2**-53 on either side, carried
# through three or four operations; 16 half-ulps bounds them.
ULPS = 16 * 2.0**-53


def _warmup_config(case):
    kind, params = WARMUPS[case]
    return {"optimizer": {"type": "SGD", "params": {"lr": OPTIMIZER_LR}},
            "scheduler": {"type": kind, "params": params}}  # fmt: skip


def _warmup_reference(k, kind, p):
    """DeepSpeed's warmup schedulers written out. DeepSpeed sets the lr when
    it builds the scheduler (iteration -1: ``warmup_min_lr``; WarmupCosineLR:
    0) and steps it after each update, so update ``k`` — counted from 0, as
    shardax's optimizer counts the updates it has applied — runs at
    iteration ``k - 1``; the warmup spans ``n = max(2, warmup_num_steps)``
    iterations: ``log(it + 1) / log(n)`` or ``it / n`` of the way."""
    it, n, total = k - 1, max(2, p["warmup_num_steps"]), p.get("total_num_steps")
    log = p.get("warmup_type", "log") == "log"
    warm = (math.log(it + 1) / math.log(n) if log else it / n) if 0 <= it < n else None
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        low, end = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 1e-4)
        if it < 0:
            return 0.0
        if warm is not None:
            return OPTIMIZER_LR * (low + (1 - low) * warm)
        progress = min(1.0, (it - n + 1) / max(1, total - n))
        return OPTIMIZER_LR * (end + (1 - end) * (1 + math.cos(math.pi * progress)) / 2)
    low = p.get("warmup_min_lr", 0.0)
    high = p.get("warmup_max_lr", OPTIMIZER_LR if kind == "WarmupLR" else 0.001)
    if it < 0:
        return low
    if warm is None:  # WarmupDecayLR: linearly back to warmup_min_lr at iteration total
        warm = 1.0 if kind == "WarmupLR" else max(0.0, (total - it) / max(1, total - n))
    return low + (high - low) * warm


@pytest.mark.parametrize("case", sorted(WARMUPS))
def test_warmup_schedulers_follow_deepspeeds_formula(case):
    kind, params = WARMUPS[case]
    data, unmapped = from_deepspeed(_warmup_config(case))
    assert data["schedule"]["deepspeed"] is True and unmapped == []
    lr = RunConfig.from_dict(data).make_schedule()
    for k in range(UPDATES):
        assert lr(k) == pytest.approx(_warmup_reference(k, kind, params), rel=ULPS, abs=0), k
    if kind != "WarmupCosineLR":  # the first two updates both run at warmup_min_lr
        assert lr(0) == lr(1) == params.get("warmup_min_lr", 0.0)


@pytest.mark.parametrize("case", sorted(WARMUPS))
def test_warmup_schedulers_are_deepspeeds_update_by_update(case):
    """The converted config's optimizer (its schedule fed by its own update
    count) against DeepSpeed's scheduler on a torch optimizer, stepped as
    DeepSpeed's engine steps it: after each applied update
    (``engine._take_model_step``)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import lr_schedules

    from shardax.optim._schedules import deepspeed_warmup, deepspeed_warmup_cosine

    kind, params = WARMUPS[case]
    config = RunConfig.from_dict(from_deepspeed(_warmup_config(case))[0])
    ours, w = config.make_optimizer(), torch.zeros(1, dtype=torch.float64)
    state, grad = ours.init(w), torch.ones(1, dtype=torch.float64)
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=OPTIMIZER_LR)
    scheduler = getattr(lr_schedules, kind)(torch_opt, **params)
    s, warmup = config.schedule, params.get("warmup_type", "log")
    if kind == "WarmupCosineLR":  # the schedule itself, on DeepSpeed's ratios
        alone = deepspeed_warmup_cosine(OPTIMIZER_LR, s.warmup_steps, s.total_steps, warmup=warmup,
                                        init_ratio=params.get("warmup_min_ratio", 0.0),
                                        end_ratio=params.get("cos_min_ratio", 1e-4))  # fmt: skip
    else:
        alone = deepspeed_warmup(s.init_lr, config.optimizer.lr, s.warmup_steps, s.total_steps,
                                 warmup=warmup)  # fmt: skip
    for k in range(UPDATES):
        theirs = torch_opt.param_groups[0]["lr"]  # what DeepSpeed's update k runs at
        updates, state = ours.update(grad, state, w)
        lr = -float(updates)  # SGD: -lr * 1.0, exactly, in float64
        assert alone(k) == theirs, k  # DeepSpeed's operations in DeepSpeed's order
        if kind == "WarmupCosineLR":  # the config holds init_lr and end_lr, not the ratios
            assert lr == pytest.approx(theirs, rel=ULPS, abs=0), k
        else:
            assert lr == theirs, k
        torch_opt.step()
        scheduler.step()


def test_a_schedulers_lr_wins_over_the_optimizers_in_any_order():
    """DeepSpeed's schedulers set the learning rate; WarmupLR without
    ``warmup_max_lr`` warms up to the optimizer's (``lr_schedules.WarmupLR``)."""
    adam = {"type": "Adam", "params": {"lr": 3e-4}}
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_type": "linear"}}
    for ds in ({"scheduler": warmup, "optimizer": adam}, {"optimizer": adam, "scheduler": warmup}):
        assert from_deepspeed(ds)[0]["optimizer"]["lr"] == 3e-4
        peak = {**warmup, "params": {**warmup["params"], "warmup_max_lr": 1e-3}}
        assert from_deepspeed({**ds, "scheduler": peak})[0]["optimizer"]["lr"] == 1e-3


def test_deepspeeds_warmup_lr_without_a_peak_warms_up_to_the_optimizers_lr():
    pytest.importorskip("deepspeed")
    adam = {"type": "Adam", "params": {"lr": 3e-4}}
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_type": "linear"}}
    from deepspeed.runtime.lr_schedules import WarmupLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    scheduler = WarmupLR(opt, warmup_num_steps=5, warmup_type="linear")
    lr = RunConfig.from_dict(from_deepspeed({"scheduler": warmup, "optimizer": adam})[0])
    for _ in range(10):
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == lr.make_schedule()(10) == 3e-4  # the peak: the same


def test_warmup_scheduler_params_are_read_as_deepspeed_reads_them():
    """``lr_schedules.py``: WarmupDecayLR's ``warmup_max_lr`` defaults to
    0.001 (WarmupLR's to the optimizer's lr; ``"auto"``, which the HF
    Trainer fills with its lr, is the optimizer's too); a
    ``warmup_num_steps`` below 1 is DeepSpeed's ValueError, a missing
    ``total_num_steps`` its TypeError (``"auto"``: the run's); an unknown
    ``warmup_type`` is a warning there and the log warmup."""
    adam = {"type": "AdamW", "params": {"lr": 3e-4}}
    decay = {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}
    assert from_deepspeed({"optimizer": adam, "scheduler": decay})[0]["optimizer"]["lr"] == 0.001
    auto = {**decay, "params": {**decay["params"], "warmup_max_lr": "auto"}}
    assert from_deepspeed({"optimizer": adam, "scheduler": auto})[0]["optimizer"]["lr"] == 3e-4
    for kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        zero = {"type": kind, "params": {"total_num_steps": 10, "warmup_num_steps": 0}}
        with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps is a positive "
                           f"integer, as DeepSpeed's {kind} requires; got 0"):  # fmt: skip
            from_deepspeed({"scheduler": zero})
    for kind in ("WarmupDecayLR", "WarmupCosineLR"):  # a required argument in DeepSpeed
        with pytest.raises(ConfigError, match=rf"total_num_steps is missing: DeepSpeed's {kind}"):
            from_deepspeed({"scheduler": {"type": kind, "params": {"warmup_num_steps": 5}}})
        run = {"type": kind, "params": {"warmup_num_steps": 5, "total_num_steps": "auto"}}
        assert from_deepspeed({"scheduler": run})[0]["schedule"].get("total_steps") is None
    odd = {**decay, "params": {**decay["params"], "warmup_type": "cosine"}}
    data, unmapped = from_deepspeed({"scheduler": odd})
    assert data["schedule"]["warmup"] == "log"
    assert unmapped == [("scheduler.params.warmup_type='cosine'",
                         "DeepSpeed warns and warms up as log does; so does the converted schedule")]  # fmt: skip


def test_one_cycle_momentum_is_refused_where_deepspeed_cycles_it():
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10}
    adam = {"scheduler": {"type": "OneCycle", "params": params},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"scheduler\.params\.cycle_momentum \(on by default: "
                       r"DeepSpeed's OneCycle cycles adamw's beta1"):  # fmt: skip
        from_deepspeed(adam)
    with pytest.raises(ConfigError, match=r"sets beta2 to 0\.99"):
        from_deepspeed({"scheduler": adam["scheduler"]})  # the client's optimizer: shardax's adamw
    off = {**params, "cycle_momentum": False, "cycle_min_mom": 0.85, "decay_mom_rate": 0.1}
    data, unmapped = from_deepspeed({**adam, "scheduler": {"type": "OneCycle", "params": off}})
    assert dict(unmapped)["scheduler.params.decay_mom_rate"] == "not used: cycle_momentum is false"
    sgd = {"scheduler": {"type": "OneCycle", "params": {**params, "cycle_max_mom": 0.95}},
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}}}  # fmt: skip
    data, unmapped = from_deepspeed(sgd)
    assert unmapped == [("scheduler.params.cycle_max_mom",
                         "not used: DeepSpeed does not cycle momentum for sgd: it has no betas")]  # fmt: skip
    assert data["optimizer"]["momentum"] == 0.9


def test_deepspeed_cycles_adams_betas_and_not_sgds():
    """What the refusal above says, read off DeepSpeed's own OneCycle."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.lr_schedules import OneCycle

    w = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam(w, betas=(0.9, 0.999))
    scheduler = OneCycle(adam, 1e-4, 1e-2, cycle_first_step_size=10)
    assert scheduler.cycle_momentum and adam.param_groups[0]["betas"] == (0.8, 0.99)
    for _ in range(5):
        scheduler.step()
    assert adam.param_groups[0]["betas"][1] == 0.99 and adam.param_groups[0]["betas"][0] < 0.9
    sgd = OneCycle(torch.optim.SGD(w, lr=0.1, momentum=0.9), 1e-4, 1e-2)
    assert sgd.cycle_momentum is False


# -- autotuning, cuda_visible_devices ---------------------------------------------


def test_autotuning_is_recorded_in_the_header_and_changes_nothing():
    path = _path("training_autotuning_hf_dsconfigs_ds_config_fp16_tune")
    ds = json.loads(path.read_text())
    data, unmapped = convert_deepspeed_file(path)
    without = {k: v for k, v in ds.items() if k != "autotuning"}
    assert from_deepspeed(without) == (data, [])  # nothing that runs changes
    (key, why), = unmapped  # fmt: skip
    assert key == "autotuning" and "changes nothing the run computes" in why
    header = to_hjson(data, unmapped, str(path)).splitlines()
    line = next(s for s in header if s.startswith("//   autotuning: "))
    assert json.loads(line[line.index("{") :]) == ds["autotuning"]  # for a planner to read


def test_cuda_visible_devices_is_the_launchers():
    path = _path("training_imagenet_config_ds_fp16_config")
    data, unmapped = convert_deepspeed_file(path)
    why = dict(unmapped)["cuda_visible_devices"]
    assert "DeepSpeed does not read this key" in why and "`shardax launch --devices 0`" in why
    ds = json.loads(path.read_text())
    assert from_deepspeed({k: v for k, v in ds.items() if k != "cuda_visible_devices"})[0] == data
    assert (
        "--devices 0,1`"
        in dict(from_deepspeed({"cuda_visible_devices": [0, 1]})[1])["cuda_visible_devices"]
    )


# -- files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('train_batch_size = 8\n[zero_optimization]\nstage = 2\n', ":2:1: not JSON or hjson"),
        ('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true]\n}\n', ":3:27: not JSON or hjson"),
        ('{\n  "train_batch_size": 8\n', ":3:1: not JSON or hjson"),
        ('{\n  "steps_per_print": 1,\n  "steps_per_print": 2\n}\n', ":3: duplicate key"),
        ("[1, 2]\n", ": not a DeepSpeed config: its top level is list"),
        ('{"optimizer": {"type": "Adam", "params": {\n  "lr": LR\n}}}', ":2: optimizer.params.lr "
         "is a number; got 'LR' (a word where a value belongs: a template's placeholder"),
        ('{"zero_optimization": {\n  "stage": "2"\n}}', ":2: zero_optimization.stage is an integer"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_a_deepspeed_config_is_refused_naming_its_line(tmp_path, text, message):
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        convert_deepspeed_file(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)
    result = CliRunner().invoke(main, ["config", "from-deepspeed", str(path)])
    assert result.exit_code == 2 and message in result.output


def test_a_template_with_placeholders_names_the_first_one(tmp_path):
    """DeepSpeedExamples' compression template: hjson reads its placeholders
    (``BATCH_SIZE_PER_GPU,``) as text; the first is named with its line."""
    with pytest.raises(ConfigError) as err:
        convert_deepspeed_file(TEMPLATE)
    assert str(err.value) == (
        f'{TEMPLATE}:3: train_micro_batch_size_per_gpu is an integer or "auto"; got '
        "'BATCH_SIZE_PER_GPU,' (a word where a value belongs: a template's placeholder left "
        "unfilled?)"
    )
    with pytest.raises(ConfigError, match="cannot read DeepSpeed config"):
        read_deepspeed(tmp_path / "missing.json")
    (tmp_path / "binary.json").write_bytes(b'{"train_batch_size": 8}\xff\xfe')
    with pytest.raises(ConfigError, match=r"binary\.json: not a text file \(byte 23 is not UTF-8"):
        read_deepspeed(tmp_path / "binary.json")


def test_hjson_reads_as_its_json(tmp_path):
    """DeepSpeed reads its config with hjson: comments, unquoted keys and
    values, optional commas convert as the JSON they stand for."""
    path = tmp_path / "ds_config.hjson"
    path.write_text(
        "// BingBertSquad's config, in hjson\n{\n  train_batch_size: 24  # all ranks\n"
        "  train_micro_batch_size_per_gpu: 3\n  steps_per_print: 10\n  optimizer: {\n"
        "    type: Adam\n    params: {\n      lr: 3e-5\n      weight_decay: 0.0\n"
        "      bias_correction: false\n    }\n  }\n  gradient_clipping: 1.0\n"
        "  fp16: {enabled: true}\n}\n"
    )
    json_path = _path("training_BingBertSquad_deepspeed_bsz24_config")
    assert convert_deepspeed_file(path) == convert_deepspeed_file(json_path)


# -- refused by key ---------------------------------------------------------------


def test_what_shardax_does_not_do_is_refused_by_key_unless_switched_off():
    for key, why in [
        ("compression_training", "DeepSpeed Compression"),
        ("data_efficiency", "DeepSpeed Data Efficiency"),
        ("progressive_layer_drop", "Progressive Layer Dropping"),
        ("curriculum_learning", "curriculum learning"),
    ]:
        section = {"enabled": True, "technique": {"enabled": False}}
        with pytest.raises(ConfigError, match=rf"{key} \({why}"):
            from_deepspeed({key: section})
        off = {"enabled": False, "technique": {"shared_parameters": {"enabled": False}}}
        assert from_deepspeed({key: off}) == ({}, [(key, "switched off (every `enabled` in it "
                                                   "is false): DeepSpeed does nothing")])  # fmt: skip
    with pytest.raises(ConfigError, match=r"sparse_attention \(DeepSpeed's block-sparse"):
        from_deepspeed({"sparse_attention": {"mode": "fixed"}})
    ds = json.loads(_path("compression_bert_config_ds_config").read_text())  # converts above
    assert '"enabled": true' not in json.dumps(ds["compression_training"])
