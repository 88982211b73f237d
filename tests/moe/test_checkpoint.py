"""Checkpoints of a model whose experts are split over ``ep`` hold the
model's own key paths and global shapes: saved from dp=2 × ep=2 under
ZeRO-3, or from ep=2 × tp=2 (each expert split by Megatron's rules too),
after two AdamW steps, params and optimizer state load on ep=4 (one expert
per rank), on one process, and into the plain Hugging Face model, equal to
what was saved."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _moe import HYPER, _batches, _loss, _model

import shardax as sx


def _rules(mesh: sx.Mesh) -> sx.Rules:
    if "tp" in mesh.axis_names:
        return sx.rules.experts("ep", tp="tp") + sx.rules.megatron("tp", names="auto")
    return sx.rules.experts("ep") + sx.rules.zero(3, tuple(mesh.axis_names))


def _train_and_save(path: str, shape: dict[str, int]) -> dict[str, torch.Tensor]:
    mesh = sx.Mesh(shape)
    data = tuple(a for a in shape if a != "tp")
    n, me = mesh.size(data), mesh.axis_index(data)
    model = _model("mixtral")
    params = sx.shard(sx.params_of(model), mesh, _rules(mesh))
    lr, (b1, b2), eps, wd = HYPER
    opt = sx.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = opt.init(params)

    def loss(p, x, y):
        return _loss(sx.apply(model, p, x), y)  # whole logits, under tp too

    grad_fn = sx.value_and_grad(loss)
    for x, y in _batches()[:2]:
        rows = slice(me * len(x) // n, (me + 1) * len(x) // n)
        _, grads = grad_fn(params, x[rows], y[rows])
        params, state = sx.optim.step(opt, grads, state, params)
    sx.ckpt.save(path, {"params": params, "opt_state": state})
    return {k: sx.gather(v) for k, v in params.items()} | {
        f"mu.{k}": sx.gather(v) for k, v in state[0].mu.items() if "experts" in k
    }


def _load_on_ep4(path: str) -> dict[str, torch.Tensor]:
    mesh = sx.Mesh({"ep": 4})
    model = _model("mixtral")
    params = sx.shard(sx.params_of(model), mesh, _rules(mesh))  # shapes and layouts
    opt = sx.optim.adamw(HYPER[0])
    loaded = sx.ckpt.load(path, {"params": params, "opt_state": opt.init(params)})
    expert = loaded["params"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert expert.local.shape[0] == 1  # one expert per rank
    mu = loaded["opt_state"][0].mu
    return {k: sx.gather(v) for k, v in loaded["params"].items()} | {
        f"mu.{k}": sx.gather(v) for k, v in mu.items() if "experts" in k
    }


@pytest.mark.slow  # two 4-rank jobs each, about 15 s
@pytest.mark.parametrize(
    "shape", [{"dp": 2, "ep": 2}, {"ep": 2, "tp": 2}], ids=["dp2xep2-zero3", "ep2xtp2"]
)
def test_an_expert_parallel_checkpoint_loads_on_any_ep_and_into_the_plain_model(tmp_path, shape):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_train_and_save, path, shape, world_size=4)[0]
    index = sx.ckpt.read_index(path)
    plain = _model("mixtral")
    shapes = {k: tuple(v.shape) for k, v in plain.named_parameters()}
    for k, shape in shapes.items():
        assert index.leaves[f"params.{k}"].shape == shape, k  # global shapes, own names
    for got in run_ranks(_load_on_ep4, path, world_size=4):
        for k, v in saved.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    target = {k: torch.empty_like(v) for k, v in plain.state_dict().items()}
    state = sx.ckpt.load(path, {"params": target}, strict="target")["params"]
    plain.load_state_dict(state)  # strictly: every name of the Hugging Face model
    for k, v in plain.named_parameters():
        torch.testing.assert_close(v.detach(), saved[k], rtol=0, atol=0, msg=k)
