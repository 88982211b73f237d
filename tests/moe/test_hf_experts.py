"""Hugging Face Mixtral and Qwen2-MoE under ``rules.experts("ep")``: each rank holds,
runs and updates half the experts of every layer, the tokens travel to
their experts and back, the model's own names and shapes untouched; 5
AdamW steps on ep=2 (each rank half of each batch) match
``torch.optim.AdamW`` on the single-process model — loss and every
parameter to 1e-5."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist import run_ranks
from _moe import HYPER, _batches, _loss, _model, on_mesh
from _parity import torch_adamw_steps


@functools.cache
def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return torch_adamw_steps(_model(family), _loss, _batches(), HYPER)


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
    for losses, params, specs, _ in run_ranks(on_mesh, family, shape, zero, world_size=world):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        assert set(ref_params) <= set(params)  # and the buffers
        for k in ref_params:
            v = params[k]
            assert v.shape == ref_params[k].shape, k  # the model's own names and shapes
            torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
        want = (
            {  # ZeRO-3: the rest over dp; tp: Megatron's MLP split inside each expert
                "P('ep')" if zero == 0 else "P(('ep', 'dp'))"
            }
            if "tp" not in shape
            else {"P('ep', blocks(2, 'tp'), None)", "P('ep', None, 'tp')"}
        )
        assert {
            specs[f"model.layers.0.mlp.experts.{w}"] for w in ("gate_up_proj", "down_proj")
        } == want
