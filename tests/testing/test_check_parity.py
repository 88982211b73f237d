"""``sx.testing.check_parity``: one step on the mesh against the same step
as one process, reported by key path — used here on each parallelism
(ZeRO-3, Megatron, Ulysses, experts, experts × tp, ZeRO-3 × experts), and shown to
catch an expert gradient off by the expert-parallel size and to name it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _moe import _batches, _loss, _model

import shardax as sx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4)


def _gpt(shape: dict[str, int]) -> sx.testing.Parity:
    mesh = sx.Mesh(shape)
    rules = {"tp": sx.rules.megatron("tp"), "sp": sx.rules.ulysses("sp")}.get(
        next(iter(shape)), sx.rules.zero(3, "dp")
    )
    with torch.device("meta"):
        model = GPT(CFG)
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, rules)
    x = torch.randint(
        0, CFG.vocab_size, (4, CFG.seq_len), generator=torch.Generator().manual_seed(3)
    )
    y = torch.roll(x, -1, dims=1)

    def dense(p, x, y):  # whole logits under every preset
        return F.cross_entropy(sx.apply(model, p, x).flatten(0, 1), y.flatten())

    data = tuple(a for a in shape if a not in ("tp", "sp"))  # the others share each batch
    step = sx.value_and_grad(dense)
    return sx.testing.check_parity(
        step, params, (x, y), mesh, data=data, reference=sx.value_and_grad(dense)
    )


def _experts(shape: dict[str, int], zero: int, bug: float = 1.0) -> sx.testing.Parity:
    mesh = sx.Mesh(shape)
    data = tuple(a for a in shape if a != "tp")
    model = _model("mixtral")
    tp = "tp" if "tp" in shape else None
    rules = sx.rules.experts("ep", tp=tp) + sx.rules.zero(zero, data)
    if tp:
        rules = (
            sx.rules.experts("ep", tp=tp)
            + sx.rules.megatron("tp", names="auto")
            + sx.rules.zero(zero, data)
        )
    params = sx.shard(sx.params_of(model), mesh, rules)

    def dense(p, x, y):
        return _loss(sx.apply(model, p, x), y)

    grad_fn = sx.value_and_grad(dense)

    def step(p, x, y):  # bug: the experts' gradients scaled, as a forgotten 1/ep would
        loss, grads = grad_fn(p, x, y)
        return loss, {
            k: g.with_local(g.local * bug) if "experts" in k and g is not None else g
            for k, g in grads.items()
        }

    return sx.testing.check_parity(
        step, params, _batches()[0], mesh, data=data, reference=sx.value_and_grad(dense)
    )


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param({"dp": 2}, id="dp2-zero3"),
        pytest.param({"tp": 2}, id="tp2-megatron"),
        pytest.param({"sp": 2}, id="sp2-ulysses"),
    ],
)
def test_check_parity_passes_the_example_gpt_under_zero_megatron_and_ulysses(shape):
    for report in run_ranks(_gpt, shape, world_size=2):
        assert report.ok, str(report)
        assert {d.path for d in report.worst} >= {"loss", "blocks.0.mlp.fc.weight", "wte.weight"}
        report.check()


@pytest.mark.parametrize(
    ("shape", "zero"),
    [
        pytest.param({"ep": 2}, 0, id="ep2"),
        pytest.param(  # ep2xtp2 training: tests/moe/test_hf_experts.py (default run)
            {"ep": 2, "tp": 2}, 0, id="ep2xtp2", marks=pytest.mark.slow
        ),
        pytest.param({"dp": 2, "ep": 2}, 3, id="dp2xep2-zero3", marks=pytest.mark.slow),
    ],
)
def test_check_parity_passes_hf_mixtral_with_its_experts_split(shape, zero):
    world = 4 if len(shape) == 2 else 2
    for report in run_ranks(_experts, shape, zero, world_size=world):
        assert report.ok, str(report)
        assert not report.missing
        assert any("experts.gate_up_proj" in d.path for d in report.worst)


def test_check_parity_catches_expert_gradients_off_by_the_ep_size_and_names_them():
    for report in run_ranks(_experts, {"ep": 2}, 0, 2.0, world_size=2):
        assert not report.ok
        bad = {d.path for d in report.worst if not d.ok}
        assert bad == {
            f"model.layers.{i}.mlp.experts.{w}"
            for i in (0, 1)
            for w in ("gate_up_proj", "down_proj")
        }, bad
        assert report.worst[0].rel == pytest.approx(1.0)  # twice the reference: off by 100 %
        with pytest.raises(sx.testing.ParityError, match=r"BAD model\.layers\.\d\.mlp\.experts"):
            report.check()


def test_check_parity_refuses_a_batch_it_cannot_split():
    mesh = sx.Mesh({"dp": 1})
    model = torch.nn.Linear(4, 2)
    params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(1, "dp"))
    step = sx.value_and_grad(lambda p, x: sx.apply(model, p, x).sum())
    with pytest.raises(sx.ShardingError, match=r"batch is a tuple of the step's arguments"):
        sx.testing.check_parity(step, params, torch.ones(2, 4), mesh)
    with pytest.raises(sx.ShardingError, match=r"batch\[0\] of shape \(\) cannot be split"):
        sx.testing.check_parity(step, params, (torch.tensor(1.0),), mesh)


def test_check_parity_names_a_gradient_on_one_side_only():
    mesh = sx.Mesh({"dp": 1})
    model = torch.nn.Linear(4, 2)
    params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(1, "dp"))
    grad_fn = sx.value_and_grad(lambda p, x: sx.apply(model, p, x).sum())

    def forgets_the_bias(p, x):  # a step that drops a gradient
        loss, grads = grad_fn(p, x)
        return loss, {"weight": grads["weight"]}

    report = sx.testing.check_parity(
        forgets_the_bias, params, (torch.ones(2, 4),), mesh, reference=grad_fn
    )
    assert not report.ok and report.missing == ("bias",)
    with pytest.raises(sx.testing.ParityError, match=r"MISSING bias: a gradient on one side only"):
        report.check()
