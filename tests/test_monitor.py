"""Monitoring: the comm log of one ZeRO-3 step shows the ZeRO paper's
volume (3Ψ elements against DDP's 2Ψ, each x(N-1)/N per rank); the step
breakdown has forward/backward (from value_and_grad) and your timers;
throughput and MFU follow from their inputs; memory of every rank; the
stdout, CSV, JSONL and TensorBoard writers; the progress line; bad input."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks

import shardax as sx
from shardax.monitor import Monitor, transformer_flops_per_token

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, PRESETS, param_count

CFG = PRESETS["tiny"]


def one_step(stage: int, tmp: str) -> tuple[list[dict], dict, list]:
    mesh = sx.Mesh({"dp": -1})
    with torch.device("meta"):
        model = GPT(CFG)
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, sx.rules.zero(stage))
    opt = sx.optim.adamw(1e-3)
    opt_state = opt.init(params)
    x = torch.randint(
        0, CFG.vocab_size, (4, CFG.seq_len), generator=torch.Generator().manual_seed(1)
    )

    def loss_fn(p):
        return F.cross_entropy(sx.apply(model, p, x).flatten(0, 1), x.flatten())

    tokens = x.numel() * mesh.size("dp")
    mon = Monitor(
        log_every=1, writers=("csv", "jsonl"), dir=tmp, timers=True, comm=True, memory=True,
        mesh=mesh, tokens_per_step=tokens, peak_tflops=1.0,
        flops_per_token=transformer_flops_per_token(param_count(CFG), CFG.n_layers,
                                                    CFG.seq_len, CFG.d_model),
    )  # fmt: skip
    with mon.step(1):
        loss, grads = sx.value_and_grad(loss_fn)(params)
        with mon.timer("optimizer"):
            updates, opt_state = opt.update(grads, opt_state, params)
            params = sx.optim.apply_updates(params, updates)
        mon.log(loss=loss)
    mon.close()
    return mon.comm_logs, (mon.records[-1] if mon.records else {}), mon.records


@pytest.mark.world_size(2)
def test_the_comm_log_of_a_zero3_step_is_the_zero_papers_volume(tmp_path):
    """Ψ parameters on N ranks: ZeRO-3 all-gathers them for forward and
    again for backward and reduce-scatters their gradients — 3Ψ elements,
    x(N-1)/N sent per rank; DDP all-reduces the gradients — 2Ψ x(N-1)/N."""
    psi, n, elem = param_count(CFG), 2, 4
    for stage, expected in ((3, 3 * psi * (n - 1) / n), (0, 2 * psi * (n - 1) / n)):
        logs, record, _ = run_ranks(one_step, stage, str(tmp_path / f"z{stage}"), world_size=2)[0]
        (step, rows) = logs[0]
        assert step == 1
        params_traffic = [r for r in rows if "pmean" not in r["collective"]]  # not the loss
        wire = sum(r["wire_bytes"] for r in params_traffic) / elem
        assert wire == pytest.approx(expected, abs=1), (stage, rows)
        kinds = {r["collective"] for r in params_traffic}
        assert kinds == (
            {"all_gather over dp", "psum_scatter over dp"} if stage else {"psum over dp"}
        )
        for r in rows:
            assert (
                r["seconds"] > 0 and r["busbw_gbps"] > 0 and r["algbw_gbps"] >= r["busbw_gbps"] / 2
            )
        assert record["comm_wire_bytes"] == sum(r["wire_bytes"] for r in rows)


@pytest.mark.world_size(2)
def test_breakdown_throughput_memory_and_files(tmp_path):
    _, record, records = run_ranks(one_step, 3, str(tmp_path), world_size=2)[0]
    for phase in ("forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "step_ms"):
        assert record[phase] > 0, phase
    assert record["tflops"] == pytest.approx(
        transformer_flops_per_token(param_count(CFG), CFG.n_layers, CFG.seq_len, CFG.d_model)
        * record["tokens_per_s"]
        / 1e12
        / 2
    )
    assert record["mfu"] == pytest.approx(record["tflops"] / 1.0)
    assert len(record["peak_rss_mib_per_rank"]) == 2 and min(record["peak_rss_mib_per_rank"]) > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and "loss" in lines[0]
    assert {line["comm"]["collective"] for line in lines[1:]} >= {"all_gather over dp"}
    csv_lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("step,loss,step_ms") and len(csv_lines) == 2
    assert (tmp_path / "comm.csv").read_text().startswith("step,collective,calls,bytes")
    assert len(records) == 1  # only rank 0 writes


def test_stdout_progress_and_only_logged_steps():
    out, err = io.StringIO(), io.StringIO()
    mon = Monitor(log_every=2, tokens_per_step=100, total_steps=4, progress=True, stream=out)
    for step in range(1, 5):
        with mon.step(step):
            mon.log(loss=torch.tensor(1.0 / step))
    mon.close()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["2", "4"]
    assert "loss 0.5" in lines[0] and "tokens/s" in lines[0]
    assert "ETA" in out.getvalue() and "100.0% step 4/4" in out.getvalue()
    assert [r["step"] for r in mon.records] == [2, 4]
    del err


def test_timers_are_free_when_off():
    mon = Monitor(writers=(), log_every=1)
    with mon.step(1):
        with mon.timer("optimizer"):
            pass
        sx.value_and_grad(lambda p: (p["w"] ** 2).sum())({"w": torch.ones(2)})
    assert set(mon.records[0]) == {"step", "step_ms"}


def test_tensorboard_writer(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'shardax\[monitor\]'"):
            Monitor(writers=("tensorboard",), dir=tmp_path)
        return
    mon = Monitor(writers=("tensorboard",), dir=tmp_path, log_every=1)
    with mon.step(1):
        mon.log(loss=1.0, expert_load=[0.75, 0.25])  # as Monitor(experts=True) records it
    mon.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "expert_load/0", "expert_load/1"} <= tags, tags
    assert events.Scalars("expert_load/1")[0].value == 0.25


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown writers \['wandb'\]"):
        Monitor(writers=("wandb",))
    with pytest.raises(ValueError, match="log_every must be a positive int"):
        Monitor(log_every=0)
    with pytest.raises(ValueError, match="MFU needs flops_per_token"):
        Monitor(peak_tflops=989.0)
    with pytest.raises(TypeError, match=r"mesh is a shardax\.Mesh \(or None\); got AbstractMesh"):
        Monitor(mesh=sx.AbstractMesh({"dp": 2}))


def test_from_config():
    config = sx.config.RunConfig.from_text("monitor: {log_every: 5, writers: [], timers: true}")
    mon = Monitor.from_config(config.monitor, tokens_per_step=10)
    assert mon.log_every == 5 and mon.timers and mon.writers == []
