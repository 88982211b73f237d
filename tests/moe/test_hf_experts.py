"""Hugging Face Mixtral and Qwen2-MoE under ``rules.experts("ep")``: each rank holds,
runs and updates half the experts of every layer, the tokens travel to
their experts and back, the model's own names and shapes untouched; 5
AdamW steps on ep=2 (each rank half of each batch) match
``torch.optim.AdamW`` on the single-process model — loss and every
parameter to 1e-5."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from _dist import run_ranks
from _moe import BATCH, HYPER, _batches, _loss, _model
from _parity import torch_adamw_steps

import shardax as sx


@functools.cache
def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return torch_adamw_steps(_model(family), _loss, _batches(), HYPER)


def _on_ep(
    family: str, shape: dict[str, int], zero: int
) -> tuple[list[float], dict, dict[str, str]]:
    mesh = sx.Mesh(shape)
    # the batch split over every axis but tp: ep ranks are data-parallel too
    data = tuple(a for a in shape if a != "tp")
    n, me = mesh.size(data), mesh.axis_index(data)
    model = _model(family)
    if "tp" in shape:  # Megatron inside each expert and for the rest of the model
        # every weight matrix split over tp or whole on purpose (the router): no warning
        warnings.simplefilter("error", sx.UnshardedWeightWarning)
        rules = sx.rules.experts("ep", tp="tp") + sx.rules.megatron("tp", names="auto")

        def loss(p, x, y):
            logits = sx.apply(model, p, x).logits  # this rank's piece of the vocabulary
            return sx.vocab_parallel_cross_entropy(logits, y, "tp", mesh=mesh)

    else:
        rules = sx.rules.experts("ep")

        def loss(p, x, y):
            return _loss(sx.apply(model, p, x), y)

    params = sx.shard(sx.params_of(model), mesh, rules + sx.rules.zero(zero, data))
    specs = {k: repr(v.layout.spec) for k, v in params.items() if "experts" in k}
    lr, (b1, b2), eps, wd = HYPER
    opt = sx.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = opt.init(params)
    grad_fn = sx.value_and_grad(loss)
    losses = []
    for x, y in _batches():
        rows = slice(me * BATCH // n, (me + 1) * BATCH // n)  # each rank its half of the batch
        loss, grads = grad_fn(params, x[rows], y[rows])
        params, state = sx.optim.step(opt, grads, state, params)
        losses.append(loss.item())
    return losses, {k: sx.gather(v) for k, v in params.items()}, specs


@pytest.mark.parametrize(
    ("family", "shape", "zero"),
    [
        pytest.param("mixtral", {"ep": 2}, 0, id="mixtral-ep2"),
        pytest.param("qwen2_moe", {"ep": 2}, 0, id="qwen2_moe-ep2"),
        pytest.param("mixtral", {"ep": 2, "tp": 2}, 0, id="mixtral-ep2xtp2"),
        pytest.param(
            "qwen2_moe", {"ep": 2, "tp": 2}, 0, id="qwen2_moe-ep2xtp2", marks=pytest.mark.slow
        ),
        pytest.param(
            "mixtral", {"dp": 2, "ep": 2}, 3, id="mixtral-dp2xep2-zero3", marks=pytest.mark.slow
        ),
        pytest.param(
            "qwen2_moe", {"dp": 2, "ep": 2}, 3, id="qwen2_moe-dp2xep2-zero3", marks=pytest.mark.slow
        ),
    ],
)
def test_hf_moe_models_with_their_experts_split_over_ep_match_the_single_process_model(
    family, shape, zero
):
    ref_losses, ref_params = _reference(family)
    world = 4 if len(shape) == 2 else 2
    for losses, params, specs in run_ranks(_on_ep, family, shape, zero, world_size=world):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        assert set(ref_params) <= set(params)  # and the buffers
        for k in ref_params:
            v = params[k]
            assert v.shape == ref_params[k].shape, k  # the model's own names and shapes
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
        want = {  # ZeRO-3: the rest over dp; tp: Megatron's MLP split inside each expert
            "P('ep')" if zero == 0 else "P(('ep', 'dp'))"
        } if "tp" not in shape else {"P('ep', blocks(2, 'tp'), None)", "P('ep', None, 'tp')"}
        assert {specs[f"model.layers.0.mlp.experts.{w}"] for w in ("gate_up_proj", "down_proj")} == want
