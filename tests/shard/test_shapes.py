"""Logical shapes are sacred: no rule changes a parameter's shape. For every
preset (ZeRO 0–3, Megatron with and without sequence parallelism, Ulysses,
and ZeRO-3 on top of Megatron) over the example GPT, Hugging Face GPT-2
(packed ``c_attn``: split block by block) and Llama, on meshes of several
shapes, every parameter's layout in every role is a layout *of the model's
own shape*, and its ranks' boxes tile that shape exactly; initialised on a
live mesh, every ``Sharded`` parameter has the model's shape."""

from __future__ import annotations

import math

import _tiny as tiny
import pytest
import torch
from _dist import run_ranks

import shardax as sx
from shardax.ckpt._save import distinct_boxes

ROLES = ("compute", "params", "grads", "opt_state")


MODELS = {
    "gpt": (tiny.example_gpt, sx.rules.GPT_NAMES),
    "hf-gpt2": (tiny.gpt2, sx.rules.GPT2_NAMES),
    "hf-llama": (tiny.llama, sx.rules.LLAMA_NAMES),
}


def presets(names: sx.rules.TransformerNames) -> dict[str, sx.Rules]:
    out = {f"zero{s}": sx.rules.zero(s) for s in range(4)}
    out["megatron"] = sx.rules.megatron("tp", names=names)
    out["megatron-sp"] = sx.rules.megatron("tp", sequence_parallel=True, names=names)
    out["zero3+megatron"] = sx.rules.zero(3) + sx.rules.megatron("tp", names=names)
    if names.attention_in is not None or names.attention is not None:
        out["ulysses"] = sx.rules.ulysses("sp", names=names)
    return out


MESHES = [{"dp": 2, "tp": 2, "sp": 1}, {"dp": 3, "tp": 2, "sp": 2}, {"dp": 1, "tp": 4, "sp": 2}]


def _meta(make) -> torch.nn.Module:
    with torch.device("meta"):
        return make()


@pytest.mark.parametrize("family", list(MODELS))
def test_no_preset_changes_a_parameter_shape_on_any_mesh(family):
    make, names = MODELS[family]
    params = sx.params_of(_meta(make))
    checked = 0
    for shape_of_mesh in MESHES:
        mesh = sx.AbstractMesh(shape_of_mesh)
        for preset, rules in presets(names).items():
            for path, tensor in params.items():
                shape = tuple(tensor.shape)
                if not shape:
                    continue
                for role in ROLES:
                    spec = rules.spec_for(path, shape, mesh, role)
                    layout = sx.Layout(mesh, spec)
                    boxes = distinct_boxes(layout, shape)
                    held = sum(math.prod(sizes) for _, _, sizes in boxes)
                    where = f"{family} {preset} {mesh} {path} {role} {spec}"
                    assert held == math.prod(shape), where  # the boxes tile the model's shape
                    for _, offsets, sizes in boxes:
                        assert all(
                            o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True)
                        )
                    checked += 1
    assert checked > 500


@pytest.mark.parametrize("family", list(MODELS))
def test_sharded_parameters_keep_the_models_shapes(family):
    make, names = MODELS[family]
    mesh = sx.Mesh({"dp": 1, "tp": 1})
    torch.manual_seed(0)
    model = make()
    dense = sx.params_of(model)
    params = sx.shard(dense, mesh, sx.rules.zero(3) + sx.rules.megatron("tp", names=names))
    for path, tensor in dense.items():
        assert params[path].shape == tuple(tensor.shape), path
        assert torch.equal(sx.gather(params[path]), tensor), path


def test_gpt2_packed_attention_is_blocked_not_reshaped():
    rules = sx.rules.megatron("tp", names=sx.rules.GPT2_NAMES)
    mesh = sx.AbstractMesh({"tp": 2})
    spec = rules.spec_for("transformer.h.0.attn.c_attn.weight", (16, 48), mesh)
    assert spec == sx.P(None, sx.blocks(3, "tp"))
    assert rules.spec_for("transformer.h.0.attn.c_attn.bias", (48,), mesh) == sx.P(
        sx.blocks(3, "tp")
    )
    layout = sx.Layout(mesh, spec)
    assert layout.local_shape((16, 48), 0) == (16, 24)  # its heads of q, of k and of v


class Packed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12)  # [q | k | v]
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(q * k + v)


def _blocked_gathers() -> tuple[int, int, torch.Tensor, dict]:
    mesh = sx.Mesh({"dp": 2, "tp": 1})
    rules = sx.Rule(r"qkv\..*", sx.P(sx.blocks(3, "tp"))) + sx.rules.zero(3)
    torch.manual_seed(0)
    model = Packed()
    params = sx.shard(sx.params_of(model), mesh, rules)
    x = torch.randn(2, 4)
    with sx.collectives.traffic() as seen:
        loss, grads = sx.value_and_grad(lambda p: sx.apply(model, p, x).square().sum())(params)
    calls = {op: v["calls"] for op, v in seen.summary().items()}
    return calls["all_gather over dp"], calls["psum_scatter over dp"], loss, sx.gather(grads)


@pytest.mark.world_size(2)
def test_blocked_parameters_gather_and_reduce_fused_with_the_others():
    """A blocked dim moves in its expanded view, a free reshape: its gathers
    and gradient reductions travel with the other parameters' (one
    all_gather in forward, one again in backward, one psum_scatter) and
    give the dense gradients."""
    torch.manual_seed(0)
    model = Packed()
    x = torch.randn(2, 4)
    model(x).square().sum().backward()
    for gathers, scatters, _, grads in run_ranks(_blocked_gathers, world_size=2):
        assert (gathers, scatters) == (2, 1)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)  # the mean of equal losses
