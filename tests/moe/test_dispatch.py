"""Routing, dispatch and combine against Hugging Face's Mixtral MoE block
(its router and its loop over experts): the same outputs and gradients,
dropless, on one rank and with the experts split over ``ep=2``; capacity
drops exactly the pairs past it, first choices first; bad input is a
typed error."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax import moe

D, F_, E, K = 16, 24, 4, 2


def _mixtral_block(seed: int = 0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=D, intermediate_size=F_, num_local_experts=E, num_experts_per_tok=K
    )
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def _ours(block, x, *, axis=None, mesh=None, capacity=None, layout="padded"):
    """The block's forward by shardax.moe; on ``ep`` the rank's experts only."""
    routing = moe.route(torch.nn.functional.linear(x, block.gate.weight), K)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    if axis is not None:
        n, me = mesh.size(axis), mesh.axis_index(axis)
        mine = slice(me * E // n, (me + 1) * E // n)
        gate_up, down = gate_up[mine], down[mine]
    buffer, plan = moe.dispatch(x, routing, capacity=capacity, axis=axis, mesh=mesh, layout=layout)
    offsets = plan.offsets if layout == "rows" else None
    return moe.combine(moe.swiglu_experts(buffer, gate_up, down, offsets=offsets), plan), plan


def _cotangent(shape) -> torch.Tensor:
    return torch.linspace(-1, 1, shape.numel()).view(shape)


def _grads(block, x, out, cotangent=None):
    cotangent = _cotangent(out.shape) if cotangent is None else cotangent
    (out * cotangent).sum().backward()
    grads = {k: p.grad.clone() for k, p in block.named_parameters()}
    grads["x"] = x.grad.clone()
    block.zero_grad(set_to_none=True)
    x.grad = None
    return grads


@pytest.mark.parametrize("layout", ["padded", "rows"])
def test_dropless_matches_hugging_face_mixtral_forward_and_backward(layout):
    block = _mixtral_block()
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    want = block(x[None])[0]
    want_grads = _grads(block, x, want)
    got, plan = _ours(block, x, layout=layout)
    got_grads = _grads(block, x, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert plan.dropped == 0
    for k, g in want_grads.items():
        torch.testing.assert_close(got_grads[k], g, rtol=1e-5, atol=1e-5, msg=k)


def _on_ep(seed: int, layout: str) -> dict:
    mesh = sx.Mesh({"ep": 2})
    me = mesh.axis_index("ep")
    block = _mixtral_block(seed)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1))[me].requires_grad_()
    out, plan = _ours(block, x, axis="ep", mesh=mesh, layout=layout)
    grads = _grads(block, x, out, _cotangent(torch.Size([2, 7, D]))[me])  # the whole batch's
    return {"out": out.detach(), "grads": grads, "send": plan.send, "recv": plan.recv}


@pytest.mark.parametrize("layout", ["padded", "rows"])
def test_experts_split_over_ep_match_the_single_process_block(layout):
    """Each rank routes its own 7 tokens; the experts' weight gradients on
    a rank are its experts' share of the whole batch's."""
    block = _mixtral_block(3)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    out = block(x)
    want = _grads(block, x, out)
    got = run_ranks(_on_ep, 3, layout)
    torch.testing.assert_close(torch.stack([g["out"] for g in got]), out.detach())
    for me, g in enumerate(got):
        torch.testing.assert_close(g["grads"]["x"], want["x"][me], rtol=1e-5, atol=1e-5)
        mine = slice(me * E // 2, (me + 1) * E // 2)
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            # rank me's experts: both ranks' tokens' gradient (sent back to it)
            torch.testing.assert_close(
                g["grads"][name][mine], want[name][mine], rtol=1e-5, atol=1e-5
            )
            other = slice((1 - me) * E // 2, (2 - me) * E // 2)
            assert torch.count_nonzero(g["grads"][name][other]) == 0  # never computed here
        assert sum(g["send"]) == 7 * K  # every pair of its tokens went somewhere
    assert got[0]["send"][1] == got[1]["recv"][0] and got[1]["send"][0] == got[0]["recv"][1]


def test_capacity_drops_the_pairs_past_it_first_choices_first():
    """Four tokens all prefer expert 0, second expert 1: with 3 slots per
    expert, expert 0 takes tokens 0–2's first choices and drops token 3's;
    expert 1 takes three second choices and drops one."""
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 4)
    routing = moe.route(logits, 2)
    x = torch.arange(4.0)[:, None].repeat(1, 2)
    buffer, plan = moe.dispatch(x, routing, capacity=3)
    assert plan.dropped == 2
    assert buffer[0, :, 0].tolist() == [0.0, 1.0, 2.0] and buffer[1, :, 0].tolist() == [
        0.0,
        1.0,
        2.0,
    ]
    out = moe.combine(buffer, plan)  # identity experts: each token's kept choices, weighted
    w = routing.weights
    torch.testing.assert_close(out[:3], x[:3])  # both choices kept: weights sum to 1
    torch.testing.assert_close(out[3], torch.zeros(2))  # both dropped: the residual carries it
    assert moe.capacity_of(4, 4, 2, 1.5) == 3 and w.shape == (4, 2)


def test_routing_scores_bias_and_losses():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    soft = moe.route(logits, 1, norm_topk=False)
    assert soft.experts.tolist() == [[2], [0]]
    torch.testing.assert_close(soft.weights[:, 0], torch.softmax(logits, -1).max(-1).values)
    biased = moe.route(logits, 1, score="sigmoid", bias=torch.tensor([0.0, 5.0, 0.0]))
    assert biased.experts.tolist() == [[1], [1]]  # the bias chooses ...
    torch.testing.assert_close(biased.weights, torch.ones(2, 1))  # ... not the weight (normed)
    scaled = moe.route(logits, 2, score="sigmoid", norm_topk=False, scale=2.5)
    torch.testing.assert_close(scaled.weights[0], 2.5 * torch.sigmoid(torch.tensor([2.0, 1.0])))
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    router_logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    want = load_balancing_loss_func((router_logits,), num_experts=4, top_k=2)
    got = moe.load_balancing_loss(moe.route(router_logits, 2))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        moe.z_loss(router_logits), router_logits.logsumexp(-1).square().mean()
    )
    assert moe.update_bias(torch.zeros(2), torch.tensor([3, 1]), 0.5).tolist() == [-0.5, 0.5]


@pytest.mark.parametrize(
    ("dtype", "d", "grouped"),
    [(torch.float32, D, True), (torch.float64, D, False), (torch.float32, 6, False)],
)
def test_rows_layout_gives_the_padded_layouts_outputs_and_gradients(dtype, d, grouped):
    """``layout="rows"``: each expert's exact rows, one grouped GEMM (fp32,
    rows of 16-byte multiples), or a padded batched matmul where torch's
    grouped GEMM cannot run (fp64; d=6: 24-byte rows) — equal to the padded
    layout, values and every gradient, under an uneven load (expert 0
    full, expert 3 empty)."""
    from shardax.moe._dispatch import _grouped_fits

    torch.manual_seed(3)
    x = torch.randn(12, d)
    logits = torch.randn(12, E) + torch.tensor([3.0, 0.0, 0.0, -3.0])
    gate_up, down = torch.randn(E, 2 * F_, d), torch.randn(E, d, F_)
    assert _grouped_fits(x.to(dtype), gate_up.to(dtype)) is grouped
    results = []
    for layout in ("padded", "rows"):
        leaves = [t.to(dtype).requires_grad_() for t in (x, logits, gate_up, down)]
        buffer, plan = moe.dispatch(leaves[0], moe.route(leaves[1], K), layout=layout)
        offsets = plan.offsets if layout == "rows" else None
        y = moe.combine(moe.swiglu_experts(buffer, *leaves[2:], offsets=offsets), plan)
        (y * _cotangent(y.shape).to(dtype)).sum().backward()
        results.append((y, buffer.shape, [t.grad for t in leaves]))
    (y0, padded, grads0), (y1, rows, grads1) = results
    assert plan.offsets.tolist()[-1] == 12 * K and plan.offsets.diff().min() >= 0
    assert rows == (12 * K, d) and padded[0] * padded[1] > 12 * K  # the padding it saves
    torch.testing.assert_close(y1, y0)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b)


def test_grouped_experts_take_a_broadcast_gradient():
    """``.sum().backward()`` hands the grouped GEMM a gradient with stride
    0; it gets the padded batched matmul's gradients all the same."""
    torch.manual_seed(4)
    x, gate_up, down = torch.randn(6, D), torch.randn(E, 2 * F_, D), torch.randn(E, D, F_)
    offsets = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    grads = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        inputs = leaves if grouped else [t.double() for t in leaves]  # fp64: the padded bmm
        moe.swiglu_experts(*inputs, offsets=offsets).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: moe.route(torch.zeros(2, 3, 4), 1), r"\[tokens, experts\]; got shape \(2, 3, 4\)"),
        (lambda: moe.route(torch.zeros(2, 3), 4), r"k=4 experts per token out of 3"),
        (lambda: moe.route(torch.zeros(2, 3), 1, score="relu"), r"score is one of"),
        (lambda: moe.route(torch.zeros(2, 3), 1, bias=torch.zeros(2)), r"bias has shape \(2,\)"),
        (
            lambda: moe.dispatch(torch.zeros(3, 4), moe.route(torch.zeros(2, 3), 1)),
            r"routing for 2 tokens",
        ),
        (
            lambda: moe.dispatch(torch.zeros(2, 4), moe.route(torch.zeros(2, 3), 1), axis="ep"),
            r"needs the mesh",
        ),
        (
            lambda: moe.dispatch(
                torch.zeros(2, 4), moe.route(torch.zeros(2, 3), 1), capacity=2, capacity_factor=1.0
            ),
            r"give capacity \(slots\) or capacity_factor, not both",
        ),
        (lambda: sx.rules.experts("ep", tp="ep"), r"tp is another axis than the experts' 'ep'"),
        (
            lambda: moe.dispatch(torch.zeros(2, 4), moe.route(torch.zeros(2, 3), 1), layout="blocks"),
            r"layout is 'padded' or 'rows'; got 'blocks'",
        ),
        (
            lambda: moe.swiglu_experts(torch.zeros(5, 2, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3)),
            r"a buffer of shape \(5, 2, 4\) for 3 experts.*offsets=plan.offsets",
        ),
        (
            lambda: moe.swiglu_experts(torch.zeros(5, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3)),
            r"a buffer of shape \(5, 4\) for 3 experts; it takes the padded layout",
        ),
        (
            lambda: moe.swiglu_experts(
                torch.zeros(5, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3),
                offsets=torch.tensor([5], dtype=torch.int32),
            ),
            r"offsets has shape \(1,\); it holds where each of the 3 experts' rows end",
        ),
    ],
)  # fmt: skip
def test_bad_input_names_the_shapes(call, match):
    with pytest.raises(sx.ShardingError, match=match):
        call()


def test_the_experts_forward_names_what_a_module_lacks():
    mesh = sx.Mesh({"ep": 1})
    forward = moe.expert_parallel("ep")
    per_expert = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))  # not stacked
    with pytest.raises(sx.ShardingError, match=r"ModuleList has no gate_up_proj, down_proj"):
        forward(
            per_expert,
            mesh,
            torch.zeros(3, 4),
            torch.zeros(3, 1, dtype=torch.long),
            torch.ones(3, 1),
        )
