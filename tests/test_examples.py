"""The README's main job, the conformance script and the benchmarks run under
``shardax launch`` in fresh processes, as a user runs them; the training
example's options, progress bar and loss record also in this process, on
one rank (fast)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import optree
import pytest
import torch

import shardax as sx

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardax", "launch", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_hello_sharding_on_two_ranks():
    done = launch("--nproc-per-node", "2", "examples/hello_sharding.py")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank}: ok" in done.stdout
    assert "[rank 0] gradients match the dense reference" in done.stdout
    assert "[rank 0]   all_to_all over ('dp'): dim 0 -> dim 1" in done.stdout


@pytest.mark.slow  # the suite itself runs in tests/collectives/test_conformance.py
def test_conformance_suite_on_four_ranks():
    done = launch("--nproc-per-node", "4", "-m", "shardax.collectives.conformance")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] conformance: 12 checks" in done.stdout
    backend = sx.collectives.get_backend().name  # shm on a CPU machine with a compiler
    assert (
        f"Mesh({{'x': 4}}), Mesh({{'x': 2, 'y': 2}}) (4 ranks on cpu, backend {backend})"
        in done.stdout
    )


def test_collectives_benchmark_smoke(tmp_path):
    out = tmp_path / "collectives.json"
    done = launch(
        "--nproc-per-node", "2", "benchmarks/collectives.py", "--smoke", "--json", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["benchmark"] == "collectives"
    ops = {r["op"] for r in result["results"]}
    assert ops == {
        "all_reduce",
        "all_reduce_new",
        "all_gather",
        "all_gather_new",
        "reduce_scatter",
        "reduce_scatter_new",
        "all_to_all",
    }
    for r in result["results"]:
        assert (
            r["torch_s"] > 0 and r["shardax_s"] > 0 and r["ratio"] == r["torch_s"] / r["shardax_s"]
        )


def test_train_gpt_on_two_ranks_with_zero3(tmp_path):
    """The README's main job, shortened: ZeRO-3 on 2 ranks, loss printed,
    checkpoint written, sample generated."""
    out = tmp_path / "ckpt"
    done = launch(
        "--nproc-per-node", "2", "examples/train_gpt.py", "--preset", "tiny", "--steps", "4",
        "--log-every", "2", "--eval-batches", "1", "--sample-tokens", "20", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ZeRO-3" in done.stdout and "[rank 0] step     4  loss" in done.stdout
    assert "sample:" in done.stdout
    # not a terminal: the plain lines, no progress bar; the loss record beside the checkpoints
    assert not re.search(r"\r|\x1b\[|train +\d+%", done.stdout + done.stderr)
    assert f"[rank 0] loss record: {out / 'loss.csv'}" in done.stdout
    record = list(csv.DictReader((out / "loss.csv").read_text().splitlines()))
    assert [r["step"] for r in record] == ["1", "2", "3", "4"]
    final = out / "step-00000004"
    assert f"saved {final}" in done.stdout
    assert sx.ckpt.verify(final) == []
    index = sx.ckpt.read_index(final)
    assert index.world_size == 2 and index.metadata["step"] == 4
    assert index.leaves["params.wte.weight"].spec == sx.P("dp")  # ZeRO-3: stored sharded
    peaks, _ = _phase_peaks(done.stdout)  # last: each phase's peak memory
    assert list(peaks) == ["init", "step", "save", "eval", "sample"]


def _phase_peaks(stdout: str) -> tuple[dict[str, float], str]:
    """The example's last line: each phase's peak RSS per rank (MiB, the
    most of any rank), and the phase of the highest."""
    found = re.search(
        r"peak RSS per rank \(MiB, the most of any rank\): (.+); peak in (\w+)", stdout
    )
    assert found, stdout
    pairs = (part.split() for part in found.group(1).split(", "))
    return {phase: float(mib) for phase, mib in pairs}, found.group(2)


def _train(out, metrics, *extra, nproc=2):
    done = launch(
        "--nproc-per-node", str(nproc), "examples/train_gpt.py", "--preset", "tiny", "--steps", "6",
        "--save-every", "3", "--keep", "5", "--eval-batches", "0", "--sample-tokens", "0",
        "--out", str(out), "--metrics", str(metrics), *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """The default 2-rank data-parallel run (6 steps, saved at 3 and 6) the
    other runs are compared with: ``(its folder, its metrics)``, made once."""
    root = tmp_path_factory.mktemp("dp")
    return root / "a", _train(root / "a", root / "a.jsonl")[1]


def test_train_gpt_resumes_bit_identically(tmp_path, dp_run):
    """Train 6 steps saving at 3; a fresh launch resuming from step 3 gives
    steps 4–6 the very losses of the uninterrupted run (params, optimizer
    state, step, RNG and data position all restored)."""
    a, whole = dp_run
    assert [m["step"] for m in whole] == [1, 2, 3, 4, 5, 6]
    (tmp_path / "b").mkdir()
    shutil.copytree(a / "step-00000003", tmp_path / "b" / "step-00000003")
    stdout, resumed = _train(tmp_path / "b", tmp_path / "b.jsonl", "--resume")
    assert (
        f"resumed from {tmp_path / 'b' / 'step-00000003'} at step 3; rng: restored as saved"
        in stdout
    )
    assert resumed == whole[3:]  # losses and lrs, exactly
    final_a = sx.ckpt.load(a / "step-00000006")  # params, moments, step
    final_b = sx.ckpt.load(tmp_path / "b" / "step-00000006")
    leaves_a, spec_a = optree.tree_flatten(final_a)
    leaves_b, spec_b = optree.tree_flatten(final_b)
    assert spec_a == spec_b and len(leaves_a) > 20
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.slow  # the mechanisms: tests/shard/test_tensor_parallel.py (default run)
def test_train_gpt_with_tensor_and_sequence_parallelism(tmp_path, dp_run):
    """``--tp 2 --sp``: Megatron rules over a tp axis, each rank its heads,
    the loss from vocabulary-split logits; the same global batch as the
    data-parallel run, so the same losses up to the order of the sums. A
    mesh axis no preset uses is refused in one line."""
    _, dp = dp_run
    stdout, tp = _train(tmp_path / "tp", tmp_path / "tp.jsonl", "--tp", "2", "--sp")
    assert "Mesh({'dp': 1, 'tp': 2})" in stdout and "with sequence parallelism" in stdout
    for a, b in zip(tp, dp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    index = sx.ckpt.read_index(tmp_path / "tp" / "step-00000006")
    assert index.leaves["params.blocks.0.attn.qkv.weight"].spec.axes == ("tp", "dp")
    idle = launch(
        "--nproc-per-node", "2", "examples/train_gpt.py", "--preset", "tiny", "--steps", "2",
        "--mesh", "dp=1,xp=2",
    )  # fmt: skip
    assert idle.returncode == 2, idle.stdout + idle.stderr
    assert "mesh axis 'xp' (size 2)" in idle.stderr and "is used by no preset" in idle.stderr


def test_train_gpt_with_a_pipeline(tmp_path, dp_run):
    """``--pp 2 --schedule 1f1b``: the blocks split over a pp axis, 4
    micro-batches per step; the same global batch as the data-parallel
    run, so the same losses up to the order of the sums; the checkpoint
    holds the model's own key paths and global shapes, and the data-parallel
    run resumes from it."""
    _, dp = dp_run
    stdout, pp = _train(tmp_path / "pp", tmp_path / "pp.jsonl", "--pp", "2", "--schedule", "1f1b")
    assert "pipeline: 2 stages ((1, 1) blocks) on pp=2, 1f1b over 4 micro-batches" in stdout
    for a, b in zip(pp, dp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    step3 = tmp_path / "pp" / "step-00000003"
    index = sx.ckpt.read_index(step3)
    assert index.leaves["params.wte.weight"].shape == (256, 64)
    assert {p.split(".")[2] for p in index.leaves if p.startswith("params.blocks.")} == {"0", "1"}
    stdout, resumed = _train(tmp_path / "b", tmp_path / "b.jsonl", "--resume", str(step3))
    assert f"resumed from {step3} at step 3" in stdout
    for got, want in zip(resumed, dp[3:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)


@pytest.mark.slow  # fp16 on CPU: two runs of 6 steps
def test_train_gpt_in_fp16_resumes_where_the_loss_scale_stood(tmp_path):
    """fp16 with dynamic loss scaling, the scale growing after each finite
    step: a run resumed from step 3 goes on from the scale the checkpoint
    holds, not the config's initial one (with another scale the fp16
    gradients round otherwise, and overflows fall on other steps), so steps
    4–6 are the uninterrupted run's exactly."""
    (tmp_path / "fp16.hjson").write_text(
        'precision: {params: "fp16", loss_scale: 1024, growth_interval: 1}\n'
    )
    fp16 = ("--config", str(tmp_path / "fp16.hjson"))
    stdout, whole = _train(tmp_path / "a", tmp_path / "a.jsonl", *fp16)
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "step-00000003", tmp_path / "b" / "step-00000003")
    saved = sx.ckpt.load(tmp_path / "b" / "step-00000003")["loss_scale"]
    assert saved["scale"] != 1024.0, saved  # it moved: grown each finite step
    stdout, resumed = _train(tmp_path / "b", tmp_path / "b.jsonl", *fp16, "--resume")
    assert f"loss scale {saved['scale']:g} as saved" in stdout, stdout
    assert resumed == whole[3:]


@pytest.mark.slow  # the mechanism: tests/optim/test_wrappers.py (default run)
def test_train_gpt_with_accumulation_logs_the_global_batchs_loss(tmp_path):
    """The global batch of 16 in 4 micro-steps of 2 a rank: the loss a step
    logs is its micro-steps' mean — the whole batch's, as the run taking it
    in one micro-step logs it (equal to 1e-5: the same sums in another
    order), not the last micro-step's."""
    runs = {}
    for micro, steps in ((8, 1), (2, 4)):
        (tmp_path / f"{micro}.hjson").write_text(f"batch: {{global: 16, micro: {micro}}}\n")
        stdout, runs[micro] = _train(
            tmp_path / str(micro), tmp_path / f"{micro}.jsonl", "--config",
            str(tmp_path / f"{micro}.hjson"),
        )  # fmt: skip
        assert ("in 4 micro-steps" in stdout) == (steps == 4), stdout
    for a, b in zip(runs[2], runs[8], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def test_train_gpt_with_remat_and_state_on_disk_gives_the_same_losses(tmp_path, dp_run):
    """``--remat save_matmuls --offload-opt/-params/-grads disk:PATH``: each
    block's activations recomputed in backward (ZeRO-3 regathering its
    parameters), Adam's moments, the parameters' shards and the reduced
    gradients in files streamed through each step; the losses those of the
    run that keeps everything in memory, and no file left behind."""
    _, plain = dp_run
    state = tmp_path / "state"
    flags = ["--remat", "save_matmuls", "--offload-opt", f"disk:{state}"]
    flags += ["--offload-params", f"disk:{state}", "--offload-grads", f"disk:{state}"]
    stdout, remat = _train(tmp_path / "r", tmp_path / "r.jsonl", *flags)
    assert "blocks rematerialised (Remat('save_matmuls'))" in stdout
    assert f"optimizer state in disk:{state}; parameters in disk:{state}" in stdout
    for a, b in zip(remat, plain, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a, b)
    assert list(state.iterdir()) == []  # every file unlinked as it was made


@pytest.mark.slow
def test_train_gpt_with_hybrid_sharding_gives_the_data_parallel_losses(tmp_path):
    """A run config with replicas (``parallel.replicate``) on 4 ranks: ZeRO-3
    within each replica of 2, the batch over all 4. The global batches are
    those of ZeRO-3 over 4 data ranks, and so are the losses; the plan says
    HSDP, and the checkpoint holds the parameters split over ``dp`` only."""
    runs = {}
    for name, text in {
        "hsdp": 'mesh: {replicate: 2, dp: 2}\nparallel: {zero: 3, replicate: "replicate"}\n',
        "dp": "mesh: {dp: 4}\nparallel: {zero: 3}\n",
    }.items():
        config = tmp_path / f"{name}.hjson"
        config.write_text(text)
        done = launch(
            "--nproc-per-node", "4", "examples/train_gpt.py", *TINY, "--steps", "3",
            "--batch-size", "4", "--config", str(config), "--out", str(tmp_path / name),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        runs[name] = list(csv.DictReader((tmp_path / name / "loss.csv").read_text().splitlines()))
        if name == "hsdp":
            assert "ZeRO-3 in each replica over replicate (HSDP)" in done.stdout
            index = sx.ckpt.read_index(tmp_path / name / "step-00000003")
            assert index.leaves["params.wte.weight"].spec == sx.P("dp")
    assert [r["step"] for r in runs["hsdp"]] == ["1", "2", "3"]
    for a, b in zip(runs["hsdp"], runs["dp"], strict=True):
        for key in ("loss", "val_loss"):
            if b[key]:
                assert abs(float(a[key]) - float(b[key])) <= 1e-6 * float(b[key]), (key, a, b)


def _train_200(tmp_path: Path, name: str, config_text: str, nproc: int) -> tuple[list, str]:
    """200 steps of the tiny example GPT (batch 4) on ``nproc`` ranks under
    the run config ``config_text``: its ``loss.csv`` rows and its output."""
    config = tmp_path / f"{name}.hjson"
    config.write_text(config_text)
    done = launch(
        "--nproc-per-node", str(nproc), "examples/train_gpt.py", *TINY, "--steps", "200",
        "--log-every", "50", "--batch-size", "4", "--config", str(config),
        "--out", str(tmp_path / name),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return list(
        csv.DictReader((tmp_path / name / "loss.csv").read_text().splitlines())
    ), done.stdout


@pytest.mark.slow  # the mechanisms: tests/shard/test_train.py (default run)
def test_train_gpt_with_zero3s_gather_options_gives_zero3s_losses(tmp_path):
    """``parallel.keep_gathered`` (one gather a step) and
    ``parallel.persist_below`` (the tiny GPT's tensors under 5000 elements
    whole, its 64 x 64 projections among them; the others split) from a run
    config: the plain ZeRO-3 run's losses to 1e-5."""
    runs = {}
    options = {"zero3": "", "keep": ", keep_gathered: true", "persist": ", persist_below: 5000"}
    for name, extra in options.items():
        (tmp_path / f"{name}.hjson").write_text(f"parallel: {{zero: 3{extra}}}\n")
        stdout, runs[name] = _train(
            tmp_path / name, tmp_path / f"{name}.jsonl", "--config", str(tmp_path / f"{name}.hjson")
        )
        assert "ZeRO-3" in stdout, stdout
    for name in ("keep", "persist"):
        for a, b in zip(runs[name], runs["zero3"], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (name, a, b)


@pytest.mark.slow
def test_train_gpt_with_zeropp_ends_within_one_percent_of_zero3(tmp_path):
    """ZeRO++ from a run config on a ``node`` × ``dp`` mesh of 4 ranks, 200
    steps of the example GPT against ZeRO-3 over the same 4. With the
    secondary copy (hpZ, exact) every loss is ZeRO-3's; with int8 weight
    gathers (qwZ), with int4 gradient reductions (qgZ), and with all three,
    the last loss and validation loss are within 1 % of it, and not equal
    (the quantization did change the run). The header names the options."""
    runs = {}
    zpp = 'mesh: {node: 2, dp: 2}\nparallel: {zero: 3, node: "node"'
    for name, text in {
        "zero3": "mesh: {dp: 4}\nparallel: {zero: 3}\n",
        "hpz": zpp + ", secondary: true}\n",
        "qwz": zpp + ", quantize_weights: true}\n",
        "qgz": zpp + ", quantize_grads: true}\n",
        "all": zpp + ", secondary: true, quantize_weights: true, quantize_grads: true}\n",
    }.items():
        runs[name], stdout = _train_200(tmp_path, name, text, nproc=4)
        if name == "all":
            assert (
                "ZeRO++: int8 weight gathers (qwZ), a secondary copy over dp (hpZ), int4 gradient "
                "reduce-scatters (qgZ)" in stdout
            )
    assert len(runs["hpz"]) == len(runs["zero3"]) == 200
    for a, b in zip(runs["hpz"], runs["zero3"], strict=True):
        assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-6 * float(b["loss"]), (a, b)
    plain = runs["zero3"][-1]
    for name in ("qwz", "qgz", "all"):
        last = runs[name][-1]
        for key in ("loss", "val_loss"):
            assert abs(float(last[key]) - float(plain[key])) <= 0.01 * float(plain[key]), (
                name,
                key,
            )
        assert last["loss"] != plain["loss"], name


@pytest.mark.slow
def test_train_gpt_with_onebit_optimizers_ends_within_one_percent_of_uncompressed(tmp_path):
    """The 1-bit optimizers from a run config, 200 steps of the example GPT
    on 2 ranks, each against the same optimizer never compressing (its
    freeze_step past the run: DeepSpeed's Adam or LAMB on the averaged
    gradient; 0/1 Adam with every step a full-precision variance step).
    1-bit Adam from step 41 (DeepSpeed's arithmetic, as its configs
    convert), 1-bit LAMB from step 101, and 0/1 Adam (the variance updated
    ever more rarely from step 17, frozen at 100, then local steps, up to 4
    between syncs, from step 141) end with a mean loss over the last 20
    steps within 1 % of theirs, after the same first steps. 0/1 Adam's
    final checkpoint, taken between syncs (saved as the ranks' mean),
    verifies."""
    base = 'mesh: {dp: 2}\noptimizer: {type: "%s", freeze_step: %d%s}\n'
    zero_one = ", bias_correction: false, zero_one: {%s}"
    runs, warm = {}, {"adam": 40, "lamb": 40, "zero_one": 16}
    for name, text in {
        "adam": base % ("onebit_adam", 40, ", bias_correction: false"),
        "adam_plain": base % ("onebit_adam", 200, ", bias_correction: false"),
        "lamb": base % ("onebit_lamb", 100, ", lr: 0.005"),
        "lamb_plain": base % ("onebit_lamb", 200, ", lr: 0.005"),
        "zero_one": base % ("zero_one_adam", 100,
                            zero_one % "local_step_scaler: 20, local_step_clipper: 4"),
        "zero_one_plain": base % ("zero_one_adam", 200, zero_one % "var_update_scaler: 200"),
    }.items():  # fmt: skip
        runs[name] = [float(r["loss"]) for r in _train_200(tmp_path, name, text, nproc=2)[0]]
    for name, first in warm.items():
        mean, plain = (sum(runs[n][-20:]) / 20 for n in (name, f"{name}_plain"))
        assert abs(mean - plain) <= 0.01 * plain, (name, mean, plain)
        assert runs[name][:first] == runs[f"{name}_plain"][:first]  # the same first steps
        assert runs[name] != runs[f"{name}_plain"]
    final = tmp_path / "zero_one" / "step-00000200"
    assert sx.ckpt.verify(final) == [] and sx.ckpt.read_index(final).world_size == 2


def test_train_gpt_with_context_parallelism_gives_the_one_process_losses(
    tmp_path, train_gpt, capsys
):
    """``--cp 2`` on 2 ranks: each rank its zigzag piece of every sequence,
    attention as ring attention, ZeRO-3 over dp × cp. The data-parallel size
    is 1, so the global batches are one process's: the loss record (the
    mean of the ranks' losses of their pieces) and the validation loss are
    the one-process run's, the checkpoint holds the parameters split over
    dp and cp, and the sample, drawn without the ring from the same
    parameters, is the same text. A --cp whose 2N chunks do not divide the
    sequence is refused before anything runs."""
    flags = [*TINY, "--sample-tokens", "10", "--steps", "3"]
    cp = launch(
        "--nproc-per-node", "2", "examples/train_gpt.py", *flags, "--cp", "2",
        "--out", str(tmp_path / "cp"),
    )  # fmt: skip
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Mesh({'dp': 1, 'cp': 2}) on 2 rank(s)" in cp.stdout
    assert "context parallel over cp (ring attention, sequences split zigzag)" in cp.stdout
    final = tmp_path / "cp" / "step-00000003"
    assert f"saved {final}" in cp.stdout and sx.ckpt.verify(final) == []
    index = sx.ckpt.read_index(final)
    assert index.world_size == 2 and index.leaves["params.wte.weight"].spec == sx.P(("dp", "cp"))
    capsys.readouterr()
    _run_in_process(train_gpt, *flags, "--out", str(tmp_path / "one"))
    one = capsys.readouterr().out

    def rows(path):
        return list(csv.DictReader((path / "loss.csv").read_text().splitlines()))

    got, want = rows(tmp_path / "cp"), rows(tmp_path / "one")
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["1", "2", "3"]
    # fp32; the ring merges the blocks' softmax by log-sum-exp and the ranks' gradients are
    # summed in another order: about 1e-7 apart per step (seen), grown over 3 AdamW steps
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "val_loss"):
            if b[key]:
                assert abs(float(a[key]) - float(b[key])) <= 1e-5 * float(b[key]), (key, a, b)

    def sample(stdout):
        text = re.sub(r"^\[rank 0\] ", "", stdout, flags=re.M)
        return text.split("sample:", 1)[1].split("peak RSS per rank")[0]

    assert sample(cp.stdout).strip() and sample(cp.stdout) == sample(one)
    with pytest.raises(SystemExit) as refused:
        train_gpt.parse_args(["--preset", "tiny", "--cp", "3"])
    assert refused.value.code == 2
    assert (
        "context parallelism over cp=3 splits each sequence zigzag into 6 equal chunks (two a "
        "rank), but preset 'tiny' has seq_len 64, not a multiple of 6: choose a --cp N with 64 a "
        "multiple of 2N (1, 2, 4, 8, 16, 32)"
    ) in capsys.readouterr().err


EXPERTS = ["--experts", "4", "--capacity-factor", "1.0"]


def test_train_gpt_with_experts_split_over_ep(tmp_path, train_gpt):
    """``--experts 4 --ep 2 --capacity-factor 1.0``: each block's MLP a
    mixture of 4 experts, each rank holding 2 of every layer's; some pairs
    dropped, each step's share printed; the same losses as one process
    (the capacity is the whole batch's on any mesh; ``--aux-loss 0``: the
    balancing loss is each rank's own, GShard's groups); the checkpoint
    holds the experts' global shapes under their own names."""
    flags = [*EXPERTS, "--aux-loss", "0"]
    stdout, ep = _train(tmp_path / "ep", tmp_path / "ep.jsonl", "--ep", "2", *flags)
    assert "Mesh({'dp': 1, 'ep': 2})" in stdout
    assert "4 experts, top-2, capacity factor 1, split over ep" in stdout
    dropped = [float(x) for x in re.findall(r"dropped_fraction ([0-9.e-]+)", stdout)]
    assert dropped and 0 < dropped[-1] < 0.5, stdout
    index = sx.ckpt.read_index(tmp_path / "ep" / "step-00000006")
    experts = index.leaves["params.blocks.0.mlp.experts.gate_up_proj"]
    assert experts.shape == (4, 256, 64) and "ep" in experts.spec.axes
    one = tmp_path / "one.jsonl"
    _run_in_process(
        train_gpt, "--steps", "6", "--batch-size", "16", "--out", str(tmp_path / "one"),
        "--metrics", str(one), *flags,
    )  # fmt: skip
    reference = [json.loads(line) for line in one.read_text().splitlines()]
    for a, b in zip(ep, reference, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


@pytest.mark.slow  # the mechanisms: tests/moe/ (default run)
def test_train_gpt_with_experts_gives_the_data_parallel_losses_with_the_balancing_loss(tmp_path):
    """With the balancing loss on (each rank's own), ep=2 and dp=2 give each
    rank the same rows: the same losses, experts split or not."""
    _, ep = _train(tmp_path / "ep", tmp_path / "ep.jsonl", "--ep", "2", *EXPERTS)
    _, dp = _train(tmp_path / "dp", tmp_path / "dp.jsonl", *EXPERTS)
    for a, b in zip(ep, dp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


@pytest.mark.slow  # the mechanisms: tests/pipeline/test_executor.py (default run)
def test_train_gpt_with_ulysses_alone_and_under_a_pipeline(tmp_path):
    """A config with ``parallel.sp`` (Ulysses): each rank's logits are its
    piece of the sequence, and its targets the same piece; alone (sp=2) and
    under a pipeline (pp=2 × sp=2) the losses and the validation loss are
    the one-rank run's."""
    configs = {
        "one": ("mesh: {dp: 1}\nparallel: {zero: 0}\n", 1),
        "sp": ('mesh: {dp: 1, sp: 2}\nparallel: {sp: "sp"}\n', 2),
        "ppsp": ('mesh: {dp: 1, pp: 2, sp: 2}\nparallel: {sp: "sp", pp: "pp"}\n', 4),
    }
    runs = {}
    for name, (text, nproc) in configs.items():
        (tmp_path / f"{name}.hjson").write_text(text)
        stdout, metrics = _train(
            tmp_path / name, tmp_path / f"{name}.jsonl", "--config", str(tmp_path / f"{name}.hjson"),
            "--eval-batches", "2", nproc=nproc,
        )  # fmt: skip
        val = [line for line in stdout.splitlines() if "val loss" in line]
        runs[name] = metrics, float(val[0].split("val loss ")[1].split()[0])
    for name in ("sp", "ppsp"):
        for a, b in zip(runs[name][0], runs["one"][0], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (name, a, b)
        assert abs(runs[name][1] - runs["one"][1]) <= 1e-3, name  # printed to 4 decimals


def test_train_gpt_resumes_on_another_number_of_ranks_as_it_is(tmp_path, dp_run):
    """A 2-rank checkpoint resumes on 1 and on 3 ranks with no flag: each
    rank reads its new shards, and the RNG states, which cannot be split or
    merged, are reseeded from the checkpoint and the rank — the resume line
    says so. On 1 rank the loss curve continues the uninterrupted run's (the
    data order does not depend on the ranks; the sums differ only in
    order); on 3, with a global batch they divide, the run goes on."""
    a, whole = dp_run
    step3 = a / "step-00000003"
    reseeded = f"resumed from {step3} at step 3; rng: reseeded from the checkpoint and the rank"
    stdout, resumed = _train(
        tmp_path / "one", tmp_path / "one.jsonl", "--resume", str(step3), nproc=1
    )
    assert f"{reseeded} (saved on 2 ranks, resumed on 1)" in stdout
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for got, want in zip(resumed, whole[3:], strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)
    stdout, three = _train(
        tmp_path / "three", tmp_path / "three.jsonl", "--resume", str(step3), "--batch-size", "12",
        nproc=3,
    )  # fmt: skip
    assert f"{reseeded} (saved on 2 ranks, resumed on 3)" in stdout
    assert [m["step"] for m in three] == [4, 5, 6] and all(math.isfinite(m["loss"]) for m in three)


@pytest.mark.slow  # the mechanism: tests/ckpt/test_resume_any_mesh.py (default run)
def test_train_gpt_refuses_another_number_of_ranks_with_rng_restore(tmp_path, dp_run):
    """``--rng restore`` insists on the saved RNG states: on another number
    of ranks the run stops with one line naming the other policies."""
    step3 = dp_run[0] / "step-00000003"
    refused = launch(
        "--nproc-per-node", "1", "examples/train_gpt.py", "--preset", "tiny", "--steps", "6",
        "--out", str(tmp_path / "b"), "--resume", str(step3), "--rng", "restore",
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "holds the RNG states of 2 rank(s) and this job has 1" in refused.stderr
    assert "--rng reseed or --rng skip" in refused.stderr and "Traceback" not in refused.stderr


WIDE = ["--preset", "wide", "--batch-size", "4", "--eval-batches", "1", "--sample-tokens", "2"]


@pytest.mark.slow  # the wide GPT (134M parameters) on 2 ranks, three runs: a few minutes
def test_train_gpt_peaks_in_the_step_and_offload_takes_adams_share_off_it(tmp_path, train_gpt):
    """``--preset wide`` on 2 ranks (benchmarks/memory.py's model and batch):
    init, the checkpoint saves, the evaluation and the sample each peak
    below the training step, so the run's peak is the step's working set;
    with Adam's moments on disk (``--offload-opt disk:PATH``) it falls by at
    least 0.95 of their share, as in the benchmark. Resumed, the rank never
    holds its state twice: the resume peaks below the step, and the steps
    after it as high as before."""
    params = train_gpt.param_count(train_gpt.PRESETS["wide"])
    share = params * 8 / 2 / 2**20  # Adam: two fp32 moments a parameter, over 2 ranks
    runs = {}
    modes = {"memory": [], "offload": ["--offload-opt", f"disk:{tmp_path / 'state'}"]}
    for name, flags in modes.items():
        done = launch(
            "--nproc-per-node", "2", "examples/train_gpt.py", *WIDE, "--steps", "2",
            "--out", str(tmp_path / name), *flags,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        runs[name], top = _phase_peaks(done.stdout)
        assert top == "step", (name, runs[name])
    assert max(runs["memory"].values()) - max(runs["offload"].values()) >= 0.95 * share, runs
    done = launch(
        "--nproc-per-node", "2", "examples/train_gpt.py", *WIDE, "--steps", "3",
        "--out", str(tmp_path / "memory"), "--resume",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    resumed, top = _phase_peaks(done.stdout)
    assert top == "step" and resumed["resume"] < resumed["step"], resumed
    # a second copy of the state (params and moments: 1.5 shares) would show; a few MiB
    # of allocator noise between runs must not
    assert resumed["step"] - runs["memory"]["step"] < share / 4, (resumed, runs["memory"])


def test_check_cost_benchmark_smoke(tmp_path):
    out = tmp_path / "check_cost.json"
    done = launch(
        "--nproc-per-node", "2", "benchmarks/check_cost.py", "--smoke", "--json", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert {(r["backend"], r["op"]) for r in result["rows"]} >= {("torch", "psum_1")}
    assert all(r["checked_us"] > 0 and r["unchecked_us"] > 0 for r in result["rows"])
    assert set(result["per_step"]) >= {"torch"}


# -- the training example in this process (one rank, tiny model, a few steps) --


@pytest.fixture(scope="module")
def train_gpt():
    """``examples/train_gpt.py`` as a module (its ``sys.path`` entry for
    ``gpt`` undone afterwards)."""
    path = ROOT / "examples" / "train_gpt.py"
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location("train_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


TINY = ["--preset", "tiny", "--batch-size", "2", "--log-every", "2", "--eval-batches", "1",
        "--sample-tokens", "0"]  # fmt: skip


def _run_in_process(module, *args: str) -> None:
    with torch.random.fork_rng():
        assert module.main([*TINY, *args]) == 0


def test_sparkline(train_gpt):
    spark = train_gpt.sparkline
    up = spark([math.log(1 + i) for i in range(200)])  # averaged down to 60 characters
    assert len(up) == 60 and up[0] == "▁" and up[-1] == "█"
    assert list(up) == sorted(up)  # monotone in, monotone out ("▁" < ... < "█")
    down = spark([5.0, 4.0, 3.5, 3.4, 3.0])
    assert list(down) == sorted(down, reverse=True) and down[0] == "█" and down[-1] == "▁"
    assert spark([2.5] * 7) == "▁" * 7 and spark([]) == ""
    odd = spark([3.0, float("nan"), 2.0, float("inf"), -float("inf"), 1.0])
    assert odd == "█ ▅  ▁"  # 2.0: halfway up, rounded
    assert spark([float("nan")] * 3) == "   "
    assert len(spark([float("nan")] * 100 + [1.0] * 100)) == 60


def test_progress_bar_shows_on_a_terminal_on_rank_0(train_gpt, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("SHARDAX_TTY", raising=False)
    shows = train_gpt.shows_progress
    assert not shows(None, 0)  # pytest's captured output is no terminal
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert not shows(None, 0)  # stderr is not one either
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert shows(None, 0) and not shows(None, 1) and not shows(False, 0)
    monkeypatch.setattr(sys, "stdout", None)
    assert not shows(None, 0) and shows(True, 0)
    monkeypatch.setenv("SHARDAX_TTY", "1")  # shardax launch on a terminal
    assert shows(None, 0) and not shows(None, 1)


def test_config_file_options_merge_under_the_flags(train_gpt, tmp_path, capsys):
    """A file's options replace the defaults, flags given replace the file;
    an unknown key or a bad value is one error naming the file and the key."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"preset": "tiny", "steps": 40, "batch_size": 8, "zero": 2}))
    args = train_gpt.parse_args(["--config", str(config), "--steps", "12"])
    assert (args.preset, args.steps, args.batch_size, args.zero) == ("tiny", 12, 8, 2)
    assert args.lr == 3e-3 and args.warmup == 1  # defaults; the warmup follows --steps 12
    run = args.run
    assert run.steps == 12 and run.parallel.zero == 2 and run.batch.global_size == 8
    hjson_file = tmp_path / "run.hjson"
    hjson_file.write_text(
        '// options and a run-config section\npreset: tiny\noptimizer: {type: "lion"}\n'
    )
    args = train_gpt.parse_args(["--config", str(hjson_file), "--no-progress"])
    assert args.preset == "tiny" and args.run.optimizer.type == "lion" and args.progress is False

    def error(text: str) -> str:
        config.write_text(text)
        with pytest.raises(SystemExit) as exit:
            train_gpt.parse_args(["--config", str(config)])
        assert exit.value.code == 2
        return capsys.readouterr().err

    err = error('{"steps": 4, "batch_sise": 8}')
    assert f"error: --config {config}: unknown key 'batch_sise' (did you mean 'batch_size'?)" in err
    assert (
        "options: aux_loss, batch_size, capacity_factor, clip," in err
        and "sections: parallel, optimizer" in err
    )
    assert f"--config {config}: argument --zero: invalid choice: 5" in error('{"zero": 5}')
    assert "steps takes one value" in error('{"steps": true}')
    assert "the key 'steps' is written twice" in error('{"steps": 4, "steps": 5}')


def test_loss_record_plain_output_and_a_forced_bar(train_gpt, tmp_path, capsys, monkeypatch):
    """Not a terminal: the periodic lines as ever, no bar; then ``loss.csv``
    (a row per step, the validation loss on the last) and, without
    matplotlib, a sparkline. Resumed with ``--progress``: the bar on stderr,
    the loss lines whole on stdout, the record continuing the first run's."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # absent, even where installed
    out = tmp_path / "ckpt"
    _run_in_process(train_gpt, "--steps", "3", "--out", str(out))
    stdout, stderr = capsys.readouterr()
    assert not re.search(r"\r|\x1b\[|train +\d+%", stdout + stderr)
    assert re.search(r"^step     2  loss \d\.\d{4}  lr ", stdout, re.M)
    rows = list(csv.DictReader((out / "loss.csv").read_text().splitlines()))
    assert list(rows[0]) == ["step", "loss", "lr", "tokens_per_s", "val_loss"]
    assert [r["step"] for r in rows] == ["1", "2", "3"] and float(rows[0]["tokens_per_s"]) > 0
    assert [r["val_loss"] != "" for r in rows] == [False, False, True]
    losses = [float(r["loss"]) for r in rows]
    line = f"loss {losses[0]:.4f} {train_gpt.sparkline(losses)} {losses[-1]:.4f} (steps 1-3)"
    assert line in stdout.splitlines()
    assert f"loss record: {out / 'loss.csv'} (no plot: matplotlib is not installed)" in stdout
    assert not (out / "loss.png").exists()

    _run_in_process(train_gpt, "--steps", "4", "--out", str(out), "--resume", "--progress")
    stdout, stderr = capsys.readouterr()
    assert "train 100%" in stderr and "step 4/4 [" in stderr and "loss " in stderr
    assert re.search(r"^step     4  loss \d\.\d{4}  lr ", stdout, re.M)
    assert "\r" not in stdout and "train " not in stdout and "(steps 1-4)" in stdout
    again = list(csv.DictReader((out / "loss.csv").read_text().splitlines()))
    assert again[:3] == rows and again[3]["step"] == "4" and again[3]["val_loss"]


def test_the_loss_plot_where_matplotlib_is(train_gpt, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.0, "val_loss": 5.1}]
    assert train_gpt.plot_loss(rows, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
