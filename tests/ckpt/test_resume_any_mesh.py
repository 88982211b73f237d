"""Resume on any mesh: a ZeRO-3 training state saved by 2 ranks (params and
AdamW moments, in the model's own shapes) resumes on 1, 3 and 4 ranks and on
dp=2 × tp=2 under Megatron's rules, and the loss curve continues the
uninterrupted run's (the data order does not depend on the mesh: each step's
global batch is fixed and split over ``dp``; the sums differ only in order)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks

import shardax as sx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4)
GLOBAL_BATCH, STEPS, SAVED_AT = 12, 6, 3  # 12 rows split over 1, 2, 3 or 4 dp ranks


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=g)


def _train(mesh_shape: dict[str, int], path: str, start: int) -> list[float]:
    """Steps ``start``..STEPS-1 on ``mesh_shape`` (from step 0, saving at
    SAVED_AT, when ``start`` is 0; else from the checkpoint); the losses."""
    mesh = sx.Mesh(mesh_shape)
    rules = sx.rules.zero(3)
    if "tp" in mesh_shape:
        rules = rules + sx.rules.megatron("tp")
    with torch.device("meta"):
        model = GPT(CFG)
    torch.manual_seed(0)
    params = sx.init_params(model, mesh, rules)
    opt = sx.optim.adamw(1e-2, weight_decay=0.1)
    opt_state = opt.init(params)
    if start:
        state = sx.ckpt.load(path, {"params": params, "opt_state": opt_state}, rng="reseed")
        params, opt_state = state["params"], state["opt_state"]
    n, i = mesh.size("dp"), mesh.axis_index("dp")

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = sx.apply(model, p, x)  # whole, under tp too
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    grad_fn = sx.value_and_grad(loss_fn)
    losses = []
    for step in range(start, STEPS):
        if step == SAVED_AT and not start:
            sx.ckpt.save(path, {"params": params, "opt_state": opt_state})
        rows = _batch(step)[i * GLOBAL_BATCH // n : (i + 1) * GLOBAL_BATCH // n]
        loss, grads = grad_fn(params, rows[:, :-1], rows[:, 1:])
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A 2-rank run that saves at step ``SAVED_AT``: the path, its losses."""
    path = str(tmp_path_factory.mktemp("resume") / "step-3")
    whole = run_ranks(_train, {"dp": 2}, path, 0, world_size=2)[0]
    index = sx.ckpt.read_index(path)
    assert index.world_size == 2
    assert index.leaves["params.blocks.0.attn.qkv.weight"].shape == (48, 16)
    return path, whole


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("world", "shape"),
    [
        pytest.param(1, {"dp": 1}, id="1"),
        pytest.param(3, {"dp": 3}, id="3", marks=pytest.mark.slow),  # 1 and 4's neighbours
        pytest.param(4, {"dp": 4}, id="4", marks=pytest.mark.slow),
        pytest.param(4, {"dp": 2, "tp": 2}, id="dp2xtp2"),
    ],
)
def test_a_two_rank_checkpoint_resumes_on_any_mesh(saved, world, shape):
    path, whole = saved
    for resumed in run_ranks(_train, shape, path, SAVED_AT, world_size=world):
        torch.testing.assert_close(
            resumed, whole[SAVED_AT:], rtol=1e-6, atol=1e-6, msg=f"resumed on {shape}"
        )
