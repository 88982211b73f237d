"""Hugging Face GPT-2 and Llama split by ``pipeline.split`` as they are —
``transformer.h`` and ``model.layers`` found as their blocks, masks,
positions and rotary tables recomputed by each stage, the untied Llama
head on the last stage — match the single-process model over 3 AdamW
steps on pp=2 (1F1B and ZB-H1's split backward) and pp=4 (ZBV)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _parity import torch_adamw_steps
from _tiny import SEQ, VOCAB
from _tiny import gpt2 as tiny_gpt2
from _tiny import llama as tiny_llama

import shardax as sx
from shardax import pipeline

STEPS, BATCH = 3, 8
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-4, 0.1


def _model(family: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return tiny_llama(attn_implementation="sdpa", num_hidden_layers=layers)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return tiny_gpt2(**no_dropout, attn_implementation="sdpa", use_cache=False, n_layer=layers)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _ce(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


@functools.cache
def _reference(family: str, layers: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return torch_adamw_steps(_model(family, layers), _ce, _batches(), (LR, BETAS, EPS, WD))


def _ranked(family: str, layers: int, name: str, ranks: int) -> tuple[list[float], dict]:
    mesh = sx.Mesh({"pp": ranks})
    model = _model(family, layers)
    schedule = pipeline.schedule(name, ranks, 4)
    stages = pipeline.split(model, schedule.stages)
    params = stages.local(sx.params_of(model), schedule, mesh.axis_index("pp"))
    step = pipeline.value_and_grad(model, _ce, schedule, stages, mesh=mesh)
    opt = sx.optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    state = opt.init(params)
    losses = []
    for x, y in _batches():
        loss, grads = step(params, x, y)
        params, state = sx.optim.step(opt, grads, state, params)  # buffers: grad None
        losses.append(loss.item())
    return losses, params


@pytest.mark.parametrize(
    ("family", "name", "ranks"),
    [
        ("gpt2", "1f1b", 2),
        ("llama", "1f1b", 2),
        ("llama", "zb_h1", 2),
        pytest.param("gpt2", "zbv", 4, marks=pytest.mark.slow),
        pytest.param("llama", "zbv", 4, marks=pytest.mark.slow),
    ],
)
def test_hugging_face_models_split_as_they_are(family, name, ranks):
    layers = 2 * ranks if name == "zbv" else ranks
    ref_losses, ref_params = _reference(family, layers)
    held: set[str] = set()
    for losses, params in run_ranks(_ranked, family, layers, name, ranks, world_size=ranks):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        for k, v in params.items():
            if k in ref_params:
                torch.testing.assert_close(v, ref_params[k], rtol=1e-5, atol=1e-5, msg=k)
        held |= set(params)
    assert set(ref_params) <= held
