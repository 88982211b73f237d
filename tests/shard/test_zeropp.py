"""ZeRO++'s weight options on real gloo ranks: hpZ (a secondary copy split
within the node, gathered there in backward) equals one process exactly;
qwZ (int8 parameter gathers) equals one process that computes with the
same quantized shards, and sends the bytes its formula says."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _zero_net import (
    BETAS,
    EPS,
    LR,
    WD,
    Net,
    assert_matches,
    batch,
    reference,
    traced_adamw_steps,
)

import shardax as sx
from shardax.errors import ShardingError
from shardax.kernels import dequantize_int8, quantize_int8
from shardax.shard._spec import piece_sizes

MESH = {"node": 2, "local": 2}
AXES = ("node", "local")


def zeropp_ranks(options: dict, steps: int, stage: int = 3):
    """AdamW steps under ZeRO-``stage`` over node × local with ``options``:
    losses, gradients, final parameters, each step's traffic, a placement."""
    rules = sx.rules.zero(stage, AXES, **options)
    losses, grads, moved, params, _ = traced_adamw_steps(sx.Mesh(MESH), rules, AXES, steps)
    return losses, grads, sx.gather(params), moved, repr(params["blocks.0.up.weight"].placement)


def _quantized_as_sharded(w: torch.Tensor, path: str) -> torch.Tensor:
    """``w`` with each of its ZeRO-3 shards over node × local quantized to
    int8 and back on its own blocks: the weights the int8 gathers give."""
    spec = sx.rules.zero(3, AXES).spec_for(path, tuple(w.shape), sx.AbstractMesh(MESH))
    if not spec.axes:
        return w
    d = next(d for d, entry in enumerate(spec) if entry is not None)
    pieces = torch.split(w, list(piece_sizes(w.shape[d], [2, 2])), d)
    back = [dequantize_int8(*quantize_int8(p.contiguous())).view(p.shape) for p in pieces]
    return torch.cat(back, d)


def quantized_reference(steps: int):
    """One process computing with the weights the int8 gathers give (each
    shard quantized on its own), its gradients passed straight to the fp32
    weights AdamW keeps."""
    torch.manual_seed(0)
    model = Net()
    masters = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt_params = [torch.nn.Parameter(v) for v in masters.values()]
    opt = torch.optim.AdamW(opt_params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        used = {
            k: _quantized_as_sharded(p.detach(), k).requires_grad_()
            for k, p in zip(masters, opt_params, strict=True)
        }
        logits = torch.func.functional_call(model, used, (x,))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        grads.append({k: used[k].grad.clone() for k in used})
        for p, k in zip(opt_params, used, strict=True):
            p.grad = used[k].grad
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: p.detach().clone() for k, p in zip(masters, opt_params, strict=True)}


def _packed_bytes(
    params: dict[str, torch.Tensor], groups: list[list[str]], int8: bool = False
) -> int:
    """What the collectives over node × local move for ``groups`` of
    parameters, each group packed in one: every rank's row holds its pieces
    (fp32, or int8 then 4 bytes per started block of 256 of each piece),
    rows padded to the longest (and int8 values to 4 bytes); 4 rows."""
    total = 0
    for group in groups:
        rows, scales = [0] * 4, [0] * 4
        for path in group:
            w = params[path]
            spec = sx.rules.zero(3, AXES).spec_for(path, tuple(w.shape), sx.AbstractMesh(MESH))
            d = next(d for d, entry in enumerate(spec) if entry is not None)
            for r, k in enumerate(piece_sizes(w.shape[d], [2, 2])):
                numel = k * w.numel() // w.shape[d]
                rows[r] += numel
                scales[r] += math.ceil(numel / 256)
        m = max(rows)
        total += 4 * (m + (-m) % 4 + 4 * max(scales)) if int8 else 4 * 4 * m
    return total


UNITS = [["emb.weight", "norm.weight", "norm.bias"]] + [
    [f"blocks.{b}.{m}.{w}" for m in ("norm", "up", "down") for w in ("weight", "bias")]
    for b in range(2)
]

ALL = [path for unit in UNITS for path in unit]


def _close(runs, ref_losses, ref_grads, ref_params):
    for losses, grads, params, _, _ in runs:
        assert_matches(losses, grads, params, ref_losses, ref_grads, ref_params)


@pytest.mark.parametrize("world_size", [4])
def test_secondary_partition_matches_pytorch_and_gathers_backward_within_the_node(world_size):
    """hpZ: five AdamW steps equal one process; forward gathers over both
    axes (4P bytes for P fp32 parameters), backward only over ``local``
    from the secondary copy (4P), gradients reduce-scattered over both."""
    ref_losses, ref_grads, ref_params = reference(5)
    runs = run_ranks(zeropp_ranks, {"secondary": "local"}, 5, world_size=world_size)
    _close(runs, ref_losses, ref_grads, ref_params)
    size = 4 * sum(t.numel() for t in ref_params.values())  # split evenly over local
    want = {
        ("all_gather", AXES): _packed_bytes(ref_params, UNITS),
        ("all_gather", ("local",)): size,
        ("psum_scatter", AXES): _packed_bytes(ref_params, [ALL]),  # one bucket
        ("pmean", AXES): 4,
    }
    for *_, moved, placement in runs:
        assert moved == [want] * 5
        assert placement.endswith("secondary=P('local'))"), placement


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("secondary", [None, "local"])
def test_int8_weight_gathers_match_one_process_on_the_same_quantized_weights(secondary, world_size):
    """qwZ (with and without hpZ): five steps equal one process that
    computes with each shard quantized on its own, to 1e-5; the loss stays
    within 1 % of the exact run's; the forward gather moves the formula's
    int8 bytes (about a quarter of 4P), and hpZ's backward gather within
    the node moves the dequantized copy at full width."""
    options = {"quantize_weights": True, "secondary": secondary}
    runs = run_ranks(zeropp_ranks, options, 5, world_size=world_size)
    q_losses, q_grads, q_params = quantized_reference(5)
    _close(runs, q_losses, q_grads, q_params)
    exact_losses, _, exact_params = reference(5)
    torch.testing.assert_close(runs[0][0], exact_losses, rtol=1e-2, atol=0)
    size = 4 * sum(t.numel() for t in exact_params.values())
    forward = _packed_bytes(exact_params, UNITS, int8=True)
    assert forward < 0.5 * _packed_bytes(exact_params, UNITS)  # scales weigh on a tiny model
    reduced = _packed_bytes(exact_params, [ALL])
    want = {("all_gather", AXES): 2 * forward, ("psum_scatter", AXES): reduced, ("pmean", AXES): 4}
    if secondary:
        want = {**want, ("all_gather", AXES): forward, ("all_gather", ("local",)): size}
    for *_, moved, placement in runs:
        assert moved == [want] * 5
        assert "weights='int8'" in placement


def test_zeropp_options_are_refused_where_they_cannot_apply():
    with pytest.raises(ShardingError, match="only stage 3 splits them"):
        sx.rules.zero(2, quantize_weights=True)
    with pytest.raises(ShardingError, match="stages 0 and 1 all-reduce whole ones"):
        sx.rules.zero(1, AXES, quantize_grads=True)
    with pytest.raises(ShardingError, match="over two axes, the one across nodes first"):
        sx.rules.zero(3, "dp", quantize_grads=True)
    with pytest.raises(ShardingError, match=r"\['tp'\] are not among them"):
        sx.rules.zero(3, AXES, secondary="tp")
    with pytest.raises(ShardingError, match="not all of them"):
        sx.rules.zero(3, "dp", secondary="dp")
    with pytest.raises(ShardingError, match="does not split the parameters"):
        sx.rules.ShardOver("dp", roles=("grads",), quantize_weights=True)
    rules = sx.rules.zero(3, AXES, quantize_weights=True, secondary="local", quantize_grads=True)
    assert eval(repr(rules.overs[0]), {"ShardOver": sx.rules.ShardOver}) == rules.overs[0]


def test_int8_blocks_are_bit_for_bit_the_reference():
    """The native CPU kernels give the torch reference's bits, for every
    input dtype and a short last block."""
    from shardax.kernels.cuda import dequantize_int8_reference, quantize_int8_reference

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 255, 256, 257, 70_001):
            x = (torch.randn(n, generator=g) * 3).to(dtype)
            x[: min(n, 256)] = 0 if n > 300 else x[: min(n, 256)]  # an all-zero block
            q, s = quantize_int8(x)
            q_ref, s_ref = quantize_int8_reference(x)
            assert torch.equal(q, q_ref) and torch.equal(s, s_ref), (dtype, n)
            for out in (torch.float32, torch.bfloat16):
                assert torch.equal(dequantize_int8(q, s, out), dequantize_int8_reference(q, s, out))
    with pytest.raises(ValueError, match="takes fp32, bf16 or fp16"):
        quantize_int8(torch.ones(3, dtype=torch.int32))


def test_explain_shows_the_secondary_copy_and_the_int8_gathers():
    """``explain`` adds hpZ's secondary copy to each rank's training state
    (a parameter split over ``local`` only: half of it, for fp32 weights of
    P bytes, P/2) and says what both options do."""
    params = {"w": torch.empty(256, 64, device="meta")}
    rules = sx.rules.zero(3, AXES, quantize_weights=True, secondary="local")
    text = str(sx.explain(params, sx.AbstractMesh(MESH), rules))
    assert "params 16.0 KiB, grads 16.0 KiB, opt_state 32.0 KiB, secondary 32.0 KiB" in text
    assert "ZeRO++ qwZ: 1 tensors gathered as int8 blocks" in text
    assert "about 16.2 KiB per gather of them all, for 64.0 KiB exact" in text
    assert "ZeRO++ hpZ: backward gathers 1 tensors over ['local'] only" in text


@pytest.mark.parametrize("world_size", [4])
@pytest.mark.parametrize("stage", [2, 3])
def test_int4_gradient_reduction_is_close_and_sends_int4(stage, world_size):
    """qgZ: the gradients, reduce-scattered by an int4 all-to-all within
    each node then one across, are within int4's error of one process's
    (and not equal: they were quantized); the loss over five steps stays
    within 1 %; no fp32 reduce-scatter runs, and the all-to-all across
    nodes moves about an eighth of the fp32 bytes."""
    runs = run_ranks(zeropp_ranks, {"quantize_grads": True}, 5, stage, world_size=world_size)
    ref_losses, ref_grads, ref_params = reference(5)
    for losses, grads, _, moved, placement in runs:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
        for g, rg in zip(grads, ref_grads, strict=True):
            error = torch.cat([(g[k] - rg[k]).reshape(-1) for k in rg]).norm()
            exact = torch.cat([rg[k].reshape(-1) for k in rg]).norm()
            assert 0 < error < 0.2 * exact, (error, exact)
        assert "grads_across=('node',)" in placement
        size = 4 * sum(t.numel() for t in ref_params.values())
        for step in moved:
            assert not any(op == "psum_scatter" for op, _ in step), step
            across = step[("ragged_all_to_all", ("node",))]
            assert size / 32 < across < size / 8 + 4 * 64, (across, size)  # int4 + scales
