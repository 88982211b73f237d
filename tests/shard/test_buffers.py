"""Buffers need no handling: in the params (as ``params_of`` gives them) they
get no gradient and the optimizer's step (``optim.fused_step``, ``optim.step``)
leaves them — and their optimizer state —
as they are, so training matches ``torch.optim`` with the model's own
parameters; left out of the params, ``apply`` uses the model's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import shardax as sx


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 4)  # a parameter no gradient reaches
        self.register_buffer("scale", torch.tensor([2.0, 0.5, 1.0]))
        self.register_buffer("steps", torch.tensor(0))  # integer buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, sx.params_of(model)


def train(stage: int, with_buffers: bool) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    mesh = sx.Mesh({"dp": -1})
    torch.manual_seed(0)
    model = Scaled()
    state = sx.params_of(model) if with_buffers else dict(model.named_parameters())
    params = sx.shard({k: v.detach() for k, v in state.items()}, mesh, sx.rules.zero(stage))
    opt = sx.optim.adamw(0.1, weight_decay=0.5)
    opt_state = opt.init(params)
    grad_fn = sx.value_and_grad(lambda p, x, y: F.mse_loss(sx.apply(model, p, x), y))
    losses, grads = [], {}
    n, i = mesh.world_size, mesh.rank
    for x, y in batches():
        rows = slice(i * len(x) // n, (i + 1) * len(x) // n)
        loss, grads = grad_fn(params, x[rows], y[rows])
        params, opt_state = sx.optim.fused_step(opt).step(params, grads, opt_state)
        losses.append(loss.item())
    return losses, sx.gather(params), {k: g is None for k, g in grads.items()}


@pytest.mark.parametrize("with_buffers", [True, False], ids=["buffers-in-params", "model-buffers"])
@pytest.mark.parametrize("stage", [1, 3])
def test_buffers_are_not_trained_and_training_matches_pytorch(stage, with_buffers):
    ref_losses, ref = reference()
    for losses, params, no_grad in run_ranks(train, stage, with_buffers, world_size=2):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for k, v in params.items():
            torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6, msg=k)
        assert no_grad["unused.weight"] and not no_grad["lin.weight"]
        if with_buffers:
            assert no_grad["scale"] and no_grad["steps"]
            assert torch.equal(params["scale"], torch.tensor([2.0, 0.5, 1.0]))


def test_step_leaves_a_leaf_without_gradient_and_its_state_as_they_are():
    opt = sx.optim.adamw(0.1, weight_decay=0.5)
    params = {"a": torch.ones(3), "b": torch.ones(2)}
    state = opt.init(params)
    params, state = sx.optim.step(opt, {"a": torch.ones(3), "b": None}, state, params)
    assert torch.equal(params["b"], torch.ones(2)) and not torch.equal(params["a"], torch.ones(3))
    assert not state[0].mu["b"].any() and state[0].mu["a"].all()


def test_a_buffer_on_meta_left_out_of_the_params_is_named():
    with torch.device("meta"):
        model = Scaled()
    params = {k: torch.zeros(v.shape) for k, v in model.named_parameters()}
    with pytest.raises(sx.ShardingError, match=r"missing: \['scale', 'steps'\]"):
        sx.apply(model, params, torch.ones(1, 4))
