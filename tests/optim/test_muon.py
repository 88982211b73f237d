"""Muon (Moonlight's: Newton–Schulz-orthogonalized momentum for matrices,
AdamW for the rest) against a single-process reference written plainly —
a loop over the parameters, each matrix orthogonalized on its own,
``torch.optim.AdamW`` for the rest — on a tiny Mixtral (attention
matrices, stacked experts, a router, embeddings, norms): alone, and on 2
gloo ranks under ZeRO-1, ZeRO-3, tensor parallelism and expert
parallelism, 5 steps each, to 1e-5."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _dist import run_ranks
from _moe import BATCH, _batches, _loss, _model

import shardax as sx
from shardax import P
from shardax.errors import ShardingError
from shardax.optim._muon import muon_default, newton_schulz, orthogonalize

LR, MOMENTUM, WD = 2e-2, 0.95, 0.1
ADAM = {"betas": (0.9, 0.95), "eps": 1e-8}


def plain_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """One matrix's quintic Newton–Schulz orthogonalization (Keller Jordan's
    coefficients), fp32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference(steps: int) -> dict:
    """The model trained ``steps`` steps on the whole batches on one
    process: Muon by hand for the matrices (each expert of a stack its own),
    torch.optim.AdamW for the rest; the params after each step."""
    model = _model("mixtral")
    named = dict(model.named_parameters())
    muon = {k for k, p in named.items() if muon_default(k, tuple(p.shape))}
    adam = torch.optim.AdamW([named[k] for k in named if k not in muon], lr=LR,
                             weight_decay=WD, **ADAM)  # fmt: skip
    bufs = {k: torch.zeros_like(named[k]) for k in muon}
    history = []
    for x, y in _batches():
        model.zero_grad()
        _loss(model(x), y).backward()
        adam.step()
        with torch.no_grad():
            for k in sorted(muon):
                p, g = named[k], named[k].grad
                bufs[k].mul_(MOMENTUM).add_(g)
                u = g + MOMENTUM * bufs[k]
                mats = [u] if u.ndim == 2 else list(u)
                o = torch.stack([plain_newton_schulz(m) for m in mats]).view_as(u)
                rows, cols = u.shape[-2:]
                p.mul_(1 - LR * WD)
                p.add_(o, alpha=-LR * 0.2 * math.sqrt(max(rows, cols)))
        history.append({k: v.detach().clone() for k, v in named.items()})
        if len(history) == steps:
            break
    return {"params": history, "muon": sorted(muon)}


def on_mesh(shape: dict[str, int], zero: int) -> list[dict]:
    """One rank's run of ``sx.optim.muon`` on a mesh of ``shape``: experts
    over ``ep`` (inside each expert over ``tp`` too, and Megatron for the
    rest), ZeRO ``zero`` over the data axes (every axis but tp), each rank
    its rows of each batch; the gathered params after each step."""
    mesh = sx.Mesh(shape)
    data = tuple(a for a in shape if a != "tp")
    n, me = mesh.size(data), mesh.axis_index(data)
    model = _model("mixtral")
    rules = sx.rules.experts("ep", batch=data) if "ep" in shape else sx.Rules()
    if "tp" in shape:
        warnings.simplefilter("ignore", sx.UnshardedWeightWarning)
        rules = sx.rules.experts("ep", tp="tp", batch=data) + sx.rules.megatron("tp", names="auto")
    params = sx.shard(sx.params_of(model), mesh, rules + sx.rules.zero(zero, data))
    opt = sx.optim.muon(LR, MOMENTUM, weight_decay=WD, adam_b1=ADAM["betas"][0],
                        adam_b2=ADAM["betas"][1], adam_eps=ADAM["eps"])  # fmt: skip
    state = opt.init(params)
    grad_fn = sx.value_and_grad(lambda p, x, y: _loss(sx.apply(model, p, x), y))
    history = []
    for x, y in _batches():
        rows = slice(me * BATCH // n, (me + 1) * BATCH // n)
        _, grads = grad_fn(params, x[rows], y[rows])
        params, state = sx.optim.step(opt, grads, state, params)
        history.append({k: sx.gather(v) for k, v in params.items()})
    momentum = state[0].inner_state[0].mu  # chain(masked(chain(scale_by_muon, ...)), ...)
    specs = {k: momentum[k].layout.spec for k in SPLIT_AT}
    return history, specs


SPLIT_AT = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.down_proj")


STEPS = 5


def _assert_matches(got: list[dict], want: list[dict], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for k, v in w.items():
            torch.testing.assert_close(g[k], v, rtol=1e-5, atol=1e-5, msg=f"{what}: {k} step {step + 1}")  # fmt: skip


def test_muon_alone_equals_the_plain_reference():
    """One process, no mesh: Moonlight's Muon for the attention matrices,
    the router and each expert of the stacks; AdamW for embeddings, the head
    and norms — equal to the plain loop for 5 steps."""
    ref = reference(STEPS)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref["muon"]
    assert not any("embed" in k or "lm_head" in k or "norm" in k for k in ref["muon"])
    model = _model("mixtral")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = sx.optim.muon(LR, MOMENTUM, weight_decay=WD, adam_b1=0.9, adam_b2=0.95, adam_eps=1e-8)
    state = opt.init(params)
    history = []

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _loss(torch.func.functional_call(model, p, (x,)), y)

    for x, y in _batches():
        grads = torch.func.grad(loss)(params, x, y)
        params, state = sx.optim.step(opt, grads, state, params)
        history.append(dict(params))
    _assert_matches(history, ref["params"], "one process")


MESHES = {  # the momentum's layout of q_proj and of the experts' down_proj
    "zero1 dp2": ({"dp": 2}, 1, (P("dp"), P("dp"))),
    "zero3 dp2": ({"dp": 2}, 3, (P("dp"), P("dp"))),
    "tp2": ({"ep": 1, "tp": 2}, 0, (P("tp"), P("ep", None, "tp"))),
    "ep2": ({"ep": 2}, 0, (P(), P("ep"))),
}


@pytest.mark.parametrize("name", sorted(MESHES))
def test_muon_sharded_equals_one_process(name):
    """On 2 ranks — ZeRO-1 and ZeRO-3 over dp (the momentum split), tp (each
    matrix split), ep (each rank its experts) — every param after each of 5
    steps equals the single-process reference: the matrices were whole
    where they were orthogonalized."""
    shape, zero, specs = MESHES[name]
    want = reference(STEPS)["params"]
    for got, laid in run_ranks(on_mesh, shape, zero, world_size=2):
        assert tuple(laid[k] for k in SPLIT_AT) == specs
        _assert_matches(got, want, name)


def relaid_ranks() -> dict:
    """The orthogonalization's traffic for four 8×6 matrices split over dp."""
    mesh = sx.Mesh({"dp": -1})
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(8, 6, generator=g) for _ in range(4)]
    split = [sx.shard(w, mesh, sx.P("dp")) for w in whole]
    with sx.collectives.traffic() as t:
        done = orthogonalize(split)
    return {"bytes": dict(t.bytes), "done": [sx.gather(d) for d in done],
            "want": [newton_schulz(w) for w in whole]}  # fmt: skip


@pytest.mark.world_size(2)
def test_orthogonalize_moves_each_matrix_once_each_way():
    """Four matrices split over 2 ranks: one all-to-all gives each rank two
    whole ones and one brings the results back — each moves half its bytes
    each way, nothing is gathered everywhere."""
    for got in run_ranks(relaid_ranks, world_size=2):
        assert got["bytes"] == {("all_to_all", ("dp",)): 2 * 4 * 4 * 8 * 6 // 2}
        for a, b in zip(got["done"], got["want"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_muon_refuses_what_is_not_a_matrix():
    params = {"conv.weight": torch.zeros(4, 3, 3, 3), "b": torch.zeros(3)}
    with pytest.raises(ShardingError, match=r"'conv.weight' is 4-D \(4, 3, 3, 3\).*use_muon"):
        sx.optim.muon(0.02).init(params)
    opt = sx.optim.muon(0.02, use_muon=lambda path, shape: True)
    with pytest.raises(ShardingError, match=r"Muon orthogonalizes matrices, and 'b' is 1-D"):
        opt.init({"b": torch.zeros(3)})
    opt = sx.optim.muon(0.02, use_muon=lambda path, shape: path != "conv.weight")
    opt.init({"conv.weight": torch.zeros(4, 3, 3, 3), "w": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="ns_steps must be an int >= 1"):
        sx.optim.muon(0.02, ns_steps=0)


def deepspeed_muon_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, lr: float) -> None:
    """DeepSpeed's ``muon_update`` and step for one matrix, written out:
    the momentum an average, Nesterov by lerp, Keller Jordan's scale."""
    buf.lerp_(g, 1 - MOMENTUM)
    u = g.lerp(buf, MOMENTUM)
    o = plain_newton_schulz(u) * max(1, u.size(-2) / u.size(-1)) ** 0.5
    p.mul_(1 - lr * WD)
    p.add_(o, alpha=-lr)


def test_spectral_scale_is_deepspeeds_muon():
    """``scale="spectral"`` gives DeepSpeed's (Keller Jordan's) Muon: its
    momentum is an average, (1 - momentum) times Moonlight's sum, which the
    orthogonalization's normalization does not see; its factor is
    sqrt(max(1, rows / cols)). Five steps of a tall and a wide matrix, to
    1e-6."""
    g = torch.Generator().manual_seed(3)
    params = {"tall": torch.randn(12, 5, generator=g), "wide": torch.randn(5, 12, generator=g)}
    want = {k: v.clone() for k, v in params.items()}
    bufs = {k: torch.zeros_like(v) for k, v in params.items()}
    opt = sx.optim.muon(0.02, MOMENTUM, weight_decay=WD, scale="spectral")
    state = opt.init(params)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        params, state = sx.optim.step(opt, grads, state, params)
        for k in want:
            deepspeed_muon_step(want[k], grads[k], bufs[k], 0.02)
    for k in want:
        torch.testing.assert_close(params[k], want[k], rtol=1e-6, atol=1e-6)


def test_explain_counts_muons_momentum_only():
    """``explain(..., opt_state_bytes=sx.optim.muon_state_bytes)``: 4 bytes
    per element of a matrix on Muon (its momentum), Adam's 8 elsewhere —
    under ZeRO-1 on 4 ranks, a quarter of each on a rank."""
    params = {"wte.weight": torch.empty(64, 16, device="meta"),
              "mlp.up.weight": torch.empty(64, 16, device="meta"),
              "ln.weight": torch.empty(16, device="meta")}  # fmt: skip
    table = sx.explain(params, sx.AbstractMesh({"dp": 4}), sx.rules.zero(1),
                       opt_state_bytes=sx.optim.muon_state_bytes)  # fmt: skip
    roles = dict(table.roles)
    assert max(roles["opt_state"]) == (64 * 16 * 8 + 64 * 16 * 4 + 16 * 8) // 4


def test_muon_agrees_with_torch_optim_muon():
    """``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` is Moonlight's
    Muon for matrices, its Newton–Schulz in bf16: with ``ns_dtype`` bf16,
    five steps of a tall and a wide matrix agree to bf16's precision (the
    two normalize by the norm in other ways: ``+ eps`` here, a clamp there)."""
    g = torch.Generator().manual_seed(4)
    params = {"tall": torch.randn(12, 5, generator=g), "wide": torch.randn(5, 12, generator=g)}
    theirs = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    reference = torch.optim.Muon(list(theirs.values()), lr=0.02, weight_decay=WD,
                                 momentum=MOMENTUM, adjust_lr_fn="match_rms_adamw")  # fmt: skip
    opt = sx.optim.muon(0.02, MOMENTUM, weight_decay=WD, ns_dtype=torch.bfloat16)
    state = opt.init(params)
    for _ in range(5):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        for k, p in theirs.items():
            p.grad = grads[k].clone()
        reference.step()
        params, state = sx.optim.step(opt, grads, state, params)
    for k, p in theirs.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=0, atol=2e-3)


def test_the_planner_counts_muons_state_per_leaf():
    """``shardax plan``'s state for ``optimizer.type: muon``: the example
    GPT's matrices at 4 bytes, its embeddings and norms at Adam's 8 —
    between half and 0.55 of AdamW's."""
    from _tiny import example_gpt

    from shardax.config import RunConfig
    from shardax.plan._cost import state_bytes
    from shardax.plan._model import ModelShape

    model = example_gpt(d_model=64, vocab_size=64)
    shape = ModelShape.of(model)
    held = {}
    for opt in ({"type": "adamw"}, {"type": "muon", "momentum": 0.95}):
        run = RunConfig.from_dict({"mesh": {"dp": 2}, "parallel": {"zero": 1}, "optimizer": opt})
        held[opt["type"]] = state_bytes(run, model, 2, shape)["opt_state"]
    assert 0.5 < held["muon"] / held["adamw"] < 0.55, held
