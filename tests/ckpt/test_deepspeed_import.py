"""Importing DeepSpeed checkpoints (``sx.ckpt.import_deepspeed``, ``shardax ckpt
import --from-deepspeed``): a ZeRO-1, 2 or 3 checkpoint in fp32 or bf16 —
and its universal form — becomes a shardax training state whose run
continues DeepSpeed's loss curve, on 2 ranks or 1.

The checkpoints in ``tests/data/deepspeed_ckpt`` were written by real
DeepSpeed (``make.py`` there regenerates them, with the losses of DeepSpeed's
own 5 continued steps), so these tests run without DeepSpeed; where it is
installed, the ``slow`` ones also have it write fresh checkpoints, compare
with its own ``zero_to_fp32``, and resume ``examples/train_gpt.py`` from an
imported checkpoint through the three commands of docs/migrating.md.

Bad input is refused with a :class:`CheckpointError` naming what is wrong,
and a pickle naming anything but DeepSpeed's own classes is refused by that
name without running."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from click.testing import CliRunner

import shardax as sx
from shardax.cli import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "deepspeed_ckpt"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NO_DEEPSPEED = "deepspeed is not installed (pip install deepspeed): its own runs are skipped"


def _make() -> Any:
    """``tests/data/deepspeed_ckpt/make.py``: the model, data and configs."""
    name = "deepspeed_ckpt_make"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DATA / "make.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


make = _make()
RECORD = json.loads((DATA / "losses.json").read_text())
CASES = list(make.CASES)


def run_config(config: dict[str, Any]) -> sx.config.RunConfig:
    """The run config ``shardax config from-deepspeed`` makes of a case's
    DeepSpeed config. ZeRO-1 bf16's ``data_types.grad_accum_dtype: fp32``
    (it makes DeepSpeed use its BF16_Optimizer) is a key the converter does
    not know; shardax accumulates in fp32 anyway, so it is dropped."""
    data, unmapped = sx.config.from_deepspeed(config, lossy="data_types" in config)
    assert {k for k, *_ in unmapped} <= {
        "optimizer.params.torch_adam",
        "zero_optimization.stage3_param_persistence_threshold",
        "data_types",
    }, unmapped
    return sx.config.RunConfig.from_dict(data)


def _continue(path: str, config: dict[str, Any], shape: dict[str, int], zero: int) -> list[float]:
    """On each rank: resume ``TinyLM`` from the imported checkpoint at
    ``path`` on ``shape`` under ``rules.zero(zero)`` with the run config's
    optimizer, as ``examples/train_gpt.py --resume`` does (meta stand-ins,
    a strict load) — fp16 with DeepSpeed's loss scale from the metadata —
    and train ``make.CONTINUED`` steps on ``make.batch``'s data; each
    micro-step's loss (the mean over ranks)."""
    run = run_config(config)
    mesh = sx.Mesh(shape)
    with torch.device("meta"):
        model = make.TinyLM()
    names = {n for n, _ in model.named_parameters()}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = dtype[run.precision.params]
    params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(zero))
    params = {k: v.astype(dtype) if k in names else v for k, v in params.items()}
    accumulation = config["gradient_accumulation_steps"]
    opt = run.make_optimizer(accumulation)
    state = sx.ckpt.load(path, {"params": params, "opt_state": opt.init(params), "step": 0})
    params, opt_state, start = state["params"], state["opt_state"], state["step"]
    scaling = sx.ckpt.read_index(path).metadata["deepspeed"]["loss_scale"]
    loss_scale = sx.optim.DynamicLossScale(**scaling) if scaling else None

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        return make.loss_of(sx.apply(model, p, x), y) * scale

    grad_fn = sx.value_and_grad(loss_fn)
    n, i = mesh.size("dp"), mesh.axis_index("dp")
    losses = []
    for step in range(start, start + make.CONTINUED):
        for micro in range(accumulation):
            x, y = make.batch(step * accumulation + micro)
            rows = slice(i * len(x) // n, (i + 1) * len(x) // n)
            scale = loss_scale.scale if loss_scale is not None else 1.0
            loss, grads = grad_fn(params, x[rows], y[rows], scale)
            losses.append(float(loss) / scale)
            if loss_scale is not None:  # fp16: an overflow skips the step, as DeepSpeed does
                grads, loss_scale = loss_scale.unscale_and_adjust(grads)
                if not loss_scale.finite:
                    continue
            params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
    return losses


def _imported(case: str, tmp_path: Path, source: Path | None = None, **kwargs: Any) -> Path:
    config = run_config(RECORD[case]["config"])
    return sx.ckpt.import_deepspeed(
        source or DATA / case, tmp_path / f"{case}-imported", config=config, **kwargs
    )


# fp32: the same Adam arithmetic in another order (torch's AdamW, shardax's), and the
# ranks' gradients summed in another order — seen within 1e-6 over 5 steps; bf16 and fp16:
# the same ops on the same 16-bit values, rounded alike — seen bit for bit. 1e-5 is the bar
# the import must meet (a wrong moment, count or schedule position misses it by far more).
TOLERANCE = 1e-5


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", CASES)
def test_an_imported_deepspeed_checkpoint_continues_deepspeeds_loss_curve(case, tmp_path):
    path = _imported(case, tmp_path)
    record = RECORD[case]
    ours = run_ranks(_continue, str(path), record["config"], {"dp": 2}, make.CASES[case]["stage"])
    for losses in ours:
        torch.testing.assert_close(losses, record["losses"], rtol=0, atol=TOLERANCE)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", make.UNIVERSAL)
def test_universal_checkpoints_read_as_their_sources_and_continue_alike(case, tmp_path):
    universal = sx.ckpt.read_deepspeed(DATA / f"universal_{case}")
    source = sx.ckpt.read_deepspeed(DATA / case)
    assert universal.path.name == "global_step3_universal"
    for name, value in source.params.items():
        assert torch.equal(universal.params[name], value), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(universal.state[key][name], source.state[key][name]), (key, name)
    assert (universal.steps, universal.lr_scheduler, universal.global_steps) == (
        source.steps, source.lr_scheduler, source.global_steps
    )  # fmt: skip
    path = _imported(case, tmp_path, DATA / f"universal_{case}")
    ours = run_ranks(_continue, str(path), RECORD[case]["config"], {"dp": 2}, 3)[0]
    torch.testing.assert_close(ours, RECORD[case]["losses"], rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("case", ["zero3_fp32", "zero1_fp32"])
def test_a_two_rank_deepspeed_checkpoint_continues_on_one_rank(case, tmp_path):
    """The whole global batch on one rank: the mean of the two ranks' means
    (equal halves), so the same curve. fp32 only: in bf16 a matmul over
    twice the rows may round otherwise."""
    path = _imported(case, tmp_path)
    ours = _continue(str(path), RECORD[case]["config"], {"dp": 1}, 0)
    torch.testing.assert_close(ours, RECORD[case]["losses"], rtol=0, atol=TOLERANCE)


def test_the_state_is_the_run_configs_optimizers_and_deepspeeds_values(tmp_path):
    ds = sx.ckpt.read_deepspeed(DATA / "zero1_bf16")  # BF16_Optimizer's files
    assert (ds.zero_stage, ds.world_size, ds.dtype, ds.global_steps) == (1, 2, torch.bfloat16, 3)
    assert ds.shared == {"head.weight": "emb.weight"} and set(ds.buffers) == {"temperature"}
    assert ds.params["up.weight"].shape == (9, 6) and ds.params["up.weight"].dtype == torch.float32
    assert (ds.updates, ds.schedule_step) == (3, 3)  # the scheduler's iteration 2, + 1
    config = run_config(RECORD["zero1_bf16"]["config"])
    path = sx.ckpt.import_deepspeed(ds, tmp_path / "c", config=config)
    index = sx.ckpt.read_index(path)
    params = sx.params_of(make.TinyLM())
    names = {n for n, _ in make.TinyLM().named_parameters()}
    params = {k: v.bfloat16() if k in names else v for k, v in params.items()}
    opt = config.make_optimizer()
    expected = sx.ckpt.load(path, {"params": params, "opt_state": opt.init(params), "step": 0})
    assert set(index.leaves) == {
        p for p in sx.ckpt.read_index(sx.ckpt.save(tmp_path / "own", expected, rng=False)).leaves
    }  # the tree a run of the config saves, key for key
    master = expected["opt_state"].master
    adam = expected["opt_state"].inner_state[1][0]  # chain(clip, adamw(...)): adamw's state
    assert torch.equal(master["up.weight"], ds.params["up.weight"])
    assert torch.equal(expected["params"]["up.weight"], ds.params["up.weight"].bfloat16())
    assert torch.equal(adam.mu["down.bias"], ds.exp_avg["down.bias"])
    assert torch.equal(adam.nu["emb.weight"], ds.exp_avg_sq["emb.weight"])
    assert int(adam.count["emb.weight"]) == 3 and int(adam.count["temperature"]) == 0
    assert int(expected["opt_state"].inner_state[1][2].count) == 3  # the schedule's position
    meta = index.metadata["deepspeed"]
    assert meta["zero_stage"] == 1 and meta["lr_scheduler"] == {"last_batch_iteration": 2}
    assert (
        meta["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False} and meta["loss_scale"] is None
    )


def test_deepspeeds_dynamic_loss_scale_goes_on_as_a_dynamic_loss_scale():
    from shardax.ckpt._deepspeed import loss_scale_fields

    fields = dict(cur_scale=256.0, dynamic=True, cur_iter=9, last_overflow_iter=3,
                  scale_factor=2.0, scale_window=4, min_scale=1, delayed_shift=2,
                  cur_hysteresis=1)  # fmt: skip

    class Ds:
        loss_scaler, skipped_steps = fields, 1

    ours = sx.optim.DynamicLossScale(**loss_scale_fields(Ds()))
    assert (ours.scale, ours.hysteresis_left, ours.skipped) == (256.0, 1, 1)
    # DeepSpeed grows the scale where (iteration - last overflow - 1) is a positive
    # multiple of the window: iteration 12 of 9, 10, 11, 12 — the 4th finite step from here
    for _ in range(3):
        ours = ours.adjust(True)
        assert ours.scale == 256.0
    assert ours.adjust(True).scale == 512.0


def test_the_cli_imports_for_a_run_config_or_the_recorded_one(tmp_path):
    runner = CliRunner()
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps(RECORD["zero3_bf16"]["config"]))
    run = tmp_path / "run.hjson"
    done = runner.invoke(main, ["config", "from-deepspeed", str(ds_json), "-o", str(run)])
    assert done.exit_code == 0, done.output
    src, dst = DATA / "zero3_bf16", tmp_path / "ckpt"
    args = ["ckpt", "import", "--from-deepspeed", str(src), str(dst), "--config", str(run)]
    done = runner.invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "DeepSpeed ZeRO-3 (bfloat16 on 2 ranks, step 3)" in done.output, done.output
    assert sx.ckpt.read_index(dst).leaves["params.up.weight"].spec == sx.P(None, "dp")
    done = runner.invoke(main, args)
    assert done.exit_code == 2 and "pass --force" in done.output
    recorded = runner.invoke(main, [*args[:3], str(src), str(tmp_path / "c2"), "--mesh", "dp=3"])
    assert recorded.exit_code == 0, recorded.output
    a, b = sx.ckpt.load(dst), sx.ckpt.load(tmp_path / "c2")
    assert sx.ckpt.read_index(tmp_path / "c2").world_size == 3
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    other = tmp_path / "other.hjson"
    other.write_text(run.read_text().replace("0.95", "0.999"))
    done = runner.invoke(main, [*args[:4], str(tmp_path / "c3"), "--config", str(other)])
    assert "note: betas: DeepSpeed ran (0.9, 0.95) (7 params)" in done.output, done.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-deepspeed", "--prefix", "params"], "--prefix and --dtype do not apply to"),
        (["--from-deepspeed", "--dtype", "bf16"], "--prefix and --dtype do not apply to"),
        (["--config", "{run}"], "--config goes with --from-deepspeed"),
        (["--mesh", "dp=2"], "is a directory; for a DeepSpeed checkpoint pass --from-deepspeed"),
        (["--from-deepspeed", "--config", "{fixed}"], "the run config's mesh does not fit the 2 "
         "ranks that wrote the DeepSpeed checkpoint"),  # mesh: {dp: 4}; say --mesh
        (["--from-deepspeed"], "pass --config run.hjson"),  # BF16_Optimizer's data_types
    ],
)  # fmt: skip
def test_the_cli_refuses_what_does_not_apply_naming_the_fix(tmp_path, args, message):
    run, fixed = tmp_path / "run.hjson", tmp_path / "fixed.hjson"
    run.write_text("steps: 1\n")
    fixed.write_text("mesh: {dp: 4}\n")
    args = [a.format(run=run, fixed=fixed) for a in args]
    src = DATA / ("zero1_bf16" if args == ["--from-deepspeed"] else "zero2_fp32")
    done = CliRunner().invoke(main, ["ckpt", "import", *args, str(src), str(tmp_path / "c")])
    assert done.exit_code == 2 and message in done.output, done.output
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ bad input


def _copy(case: str, tmp_path: Path) -> Path:
    out = tmp_path / case
    shutil.copytree(DATA / case, out)
    return out


def _tag(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def _resave(path: Path, **changes: Any) -> None:
    """Rewrite a model-states file (plain data: no DeepSpeed class in it)."""
    from shardax.ckpt._deepspeed_pickle import load_pickle

    state = dict(load_pickle(path))
    state.update(changes)
    torch.save(state, path)


def _broken(kind: str, tmp_path: Path) -> Path:
    """A DeepSpeed checkpoint broken as ``kind`` says."""
    if kind == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if kind == "shardax":
        return sx.ckpt.save(tmp_path / "sx", {"w": torch.ones(2)}, rng=False)
    if kind == "file":
        return _tag(DATA / "zero2_fp32") / "mp_rank_00_model_states.pt"
    root = _copy("zero3_fp32" if "zero3" in kind else "zero2_fp32", tmp_path)
    tag = _tag(root)
    if kind == "no latest":
        (root / "latest").unlink()
        shutil.copytree(tag, root / "global_step9")
    elif kind == "latest names nothing":
        (root / "latest").write_text("global_step7")
    elif kind == "missing rank":
        (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    elif kind == "zero3 missing model states":
        (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    elif kind == "extra rank":
        shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                    tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")  # fmt: skip
    elif kind == "world sizes":
        _resave(tag / "mp_rank_00_model_states.pt", dp_world_size=4)
    elif kind == "pipeline":
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_01-model_00-model_states.pt")
    elif kind == "tensor parallel":
        shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    elif kind == "tensor parallel degree":
        _resave(tag / "mp_rank_00_model_states.pt",
                checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 2})  # fmt: skip
    elif kind == "stage 0":
        for f in tag.glob("*optim_states.pt"):
            f.unlink()
        _resave(tag / "mp_rank_00_model_states.pt", param_shapes=None)
    elif kind == "no optimizer files":
        for f in tag.glob("*optim_states.pt"):
            f.unlink()
    elif kind == "mixed runs":
        os.rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                  tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")  # fmt: skip
    elif kind == "truncated":
        f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        f.write_bytes(f.read_bytes()[:1000])
    else:
        raise AssertionError(kind)
    return root


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("empty", "is not a DeepSpeed checkpoint: it has no mp_rank_00_model_states.pt"),
        ("shardax", "is a shardax checkpoint, not a DeepSpeed one: load it with sx.ckpt.load"),
        ("file", "is not a directory; pass a DeepSpeed checkpoint's tag directory"),
        ("no latest", "has no `latest` file saying which checkpoint to read; pass one of its tag "
                      "directories: global_step3, global_step9"),
        ("latest names nothing", "names the tag 'global_step7', but"),
        ("missing rank", "is missing zero_pp_rank_1_mp_rank_00_optim_states.pt: the checkpoint "
                         "says 2 ranks wrote optimizer files, and found 1"),
        ("zero3 missing model states", "is missing zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ("extra rank", "holds zero_pp_rank_2_mp_rank_00_optim_states.pt beyond the 2 ranks"),
        ("world sizes", "mismatched world sizes in "),
        ("pipeline", "holds layer_01-model_00-model_states.pt: a pipeline-parallel checkpoint"),
        ("tensor parallel", "holds mp_rank_01_model_states.pt: a tensor-parallel checkpoint"),
        ("tensor parallel degree", "a tensor-parallel checkpoint (tp_degree=2)"),
        ("stage 0", "was saved without ZeRO (stage 0)"),
        ("no optimizer files", "has no *_optim_states.pt files beside mp_rank_00_model_states.pt"),
        ("mixed runs", "mixes optimizer files of different runs"),
        ("truncated", "is not a torch.save file DeepSpeed wrote"),
    ],
)  # fmt: skip
def test_bad_checkpoints_are_refused_by_name(kind, message, tmp_path):
    path = _broken(kind, tmp_path)
    with pytest.raises(sx.CheckpointError) as err:
        sx.ckpt.import_deepspeed(path, tmp_path / "out", optimizer=sx.optim.adamw(1e-3))
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_optimizer_must_take_deepspeeds_state(tmp_path):
    ds = sx.ckpt.read_deepspeed(DATA / "zero2_fp32")
    with pytest.raises(sx.CheckpointError, match=r"opt_state\.0 is a ScaleByLionState, which"):
        sx.ckpt.deepspeed_state(ds, sx.optim.lion(1e-3))
    with pytest.raises(sx.CheckpointError, match=r"holds no Adam moments \(ScaleByAdamState\)"):
        sx.ckpt.deepspeed_state(ds, sx.optim.sgd(1e-3))
    with pytest.raises(sx.CheckpointError, match=r"needs the optimizer the run continues with"):
        sx.ckpt.import_deepspeed(ds, tmp_path / "c")
    no_adam = sx.ckpt.DeepSpeedCheckpoint(**{**_fields(ds), "state": {"momentum_buffer": {}}})
    with pytest.raises(sx.CheckpointError, match=r"kept \['momentum_buffer'\], not exp_avg"):
        sx.ckpt.deepspeed_state(no_adam, sx.optim.adamw(1e-3))


def _fields(ds: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(ds, recurse=False)


class Evil:
    """Runs a command when unpickled, if anything lets it."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_a_pickle_naming_another_class_is_refused_by_name_and_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = _copy("zero2_fp32", tmp_path)
    model = _tag(root) / "mp_rank_00_model_states.pt"
    _resave(model, client_state=Evil())
    with pytest.raises(sx.CheckpointError) as err:
        sx.ckpt.read_deepspeed(root)
    assert f"{model} names posix.system, which is not among the classes DeepSpeed writes" in str(
        err.value
    ) or "names nt.system" in str(err.value)
    assert "nothing in it ran" in str(err.value)
    assert not (tmp_path / "pwned").exists()
    done = CliRunner().invoke(main, ["ckpt", "import", "--from-deepspeed", str(root), "out"])
    assert done.exit_code == 2 and "system, which is not among" in done.output
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()


def test_deepspeeds_classes_are_stand_ins_and_deepspeed_is_never_imported():
    code = (
        "import sys, shardax as sx\n"
        f"ds = sx.ckpt.read_deepspeed({str(DATA / 'zero2_fp32')!r})\n"
        "from shardax.ckpt._deepspeed_pickle import ALLOWED, load_pickle\n"
        f"o = load_pickle({str(_tag(DATA / 'zero2_fp32') / 'zero_pp_rank_0_mp_rank_00_optim_states.pt')!r})\n"
        "s = o['optimizer_state_dict']\n"
        "print(type(s['loss_scaler']).__module__, int(s['zero_stage']), sorted(ALLOWED))\n"
        "assert 'deepspeed' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("shardax.ckpt._deepspeed_pickle 2 ")
    assert "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" in done.stdout


# ------------------------------------------------------------ DeepSpeed itself (slow)


@pytest.mark.slow
@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_writes_and_shardax_continues(case, tmp_path):
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    out = tmp_path / "ds"
    # fresh processes for each DeepSpeed run: one after another in the same processes
    # computes other bf16 losses (ZeRO-3 replaces F.linear process-wide)
    theirs = run_ranks(make.train, case, str(out), reset=True)[0]
    path = _imported(case, tmp_path, out)
    ours = run_ranks(
        _continue, str(path), make.ds_config(case), {"dp": 2}, make.CASES[case]["stage"]
    )
    torch.testing.assert_close(ours[0], theirs, rtol=0, atol=TOLERANCE)


@pytest.mark.slow
def test_the_masters_are_those_of_deepspeeds_own_zero_to_fp32():
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    code = (
        "import json, torch, shardax as sx\n"
        "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as get\n"
        "for case in ['zero1_fp32', 'zero2_fp32', 'zero3_fp32', 'zero2_bf16', 'zero3_bf16']:\n"
        f"    path = {str(DATA)!r} + '/' + case\n"
        "    ours, theirs = sx.ckpt.read_deepspeed(path).params, get(path)\n"
        "    for k, v in ours.items():\n"
        "        assert torch.equal(v, theirs[k].contiguous()), (case, k)\n"
        "print('same')\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]


GPT_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                              "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                 "warmup_num_steps": 3, "warmup_type": "linear"}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
}  # fmt: skip
"""A DeepSpeed run of the example GPT: ZeRO-2, fp32, torch's AdamW, warmup."""


def _deepspeed_gpt(out: str, saved_at: int, steps: int) -> list[float]:
    """On each of 2 ranks: DeepSpeed trains ``examples/gpt.py``'s tiny GPT on
    the batches ``examples/train_gpt.py`` draws (its sampler, seed 0), saves
    into ``out`` after ``saved_at`` steps and goes on to ``steps``; the
    losses after the save (the mean over ranks)."""
    import logging

    import deepspeed
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, PRESETS

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    model = GPT(cfg)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=GPT_CONFIG
    )
    train = sx.data.TextDataset.tinyshakespeare(cfg.seq_len, split="train")
    sampler = sx.data.Sampler(len(train), 8, sx.Mesh({"dp": 2}), sx.P("dp"), seed=0)
    losses = []
    for step, batch in enumerate(sx.data.batches(train, sampler, num_steps=steps)):
        if step == saved_at:
            engine.save_checkpoint(out)
        logits = engine(batch["x"])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if step >= saved_at:
            losses.append(float(mean) / 2)
    engine.destroy()
    return losses


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_the_three_commands_continue_a_deepspeed_run_in_train_gpt(tmp_path):
    """docs/migrating.md's example: ``shardax config from-deepspeed``, ``shardax
    ckpt import --from-deepspeed --config``, ``train_gpt.py --config
    --resume``: the example continues DeepSpeed's loss curve."""
    if not HAS_DEEPSPEED:
        pytest.skip(NO_DEEPSPEED)
    theirs = run_ranks(_deepspeed_gpt, str(tmp_path / "ds_ckpt"), 2, 4, reset=True)[0]
    (tmp_path / "ds.json").write_text(json.dumps(GPT_CONFIG))

    def shardax(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "shardax", *args], cwd=tmp_path, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    shardax("config", "from-deepspeed", "ds.json", "-o", "run.hjson")
    shardax("ckpt", "import", "--from-deepspeed", "ds_ckpt/", "ckpt/", "--config", "run.hjson")
    out = shardax(
        "launch", "--nproc-per-node", "2", str(ROOT / "examples" / "train_gpt.py"),
        "--config", "run.hjson", "--preset", "tiny", "--resume", "ckpt/", "--steps", "4",
        "--eval-batches", "0", "--sample-tokens", "0", "--out", "run", "--metrics", "m.jsonl",
    )  # fmt: skip
    assert "resumed from ckpt at step 2" in out, out
    ours = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    # fp32 on the same batches: Adam's arithmetic in another order, about 1e-7 a step
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOLERANCE)
