"""Rules, spec trees and explain: in one process, on abstract meshes and meta
tensors."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import shardax as sx
from shardax import AbstractMesh, P, Rule, Rules, ShardingError
from shardax.shard import layouts_for

MESH = AbstractMesh({"dp": 2, "tp": 2})


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


PARAMS = {
    "emb": {"weight": meta(50, 16)},
    "blocks": [
        {"attn": {"qkv": {"weight": meta(48, 16), "bias": meta(48)}}, "scale": meta()},
        {"attn": {"qkv": {"weight": meta(48, 16), "bias": meta(48)}}, "scale": meta()},
    ],
    "step": 3,
}


def specs(tree, rules):
    paths, _, _, layouts = layouts_for(tree, MESH, rules)
    return {
        p: (layout.spec if layout is not None else None)
        for p, layout in zip(paths, layouts, strict=True)
    }


def test_first_matching_rule_wins_and_scalars_stay_replicated():
    rules = (
        Rule(r".*\.qkv\.weight", P("tp", None))
        + Rule(r".*\.weight", P("dp"))
        + Rule(r".*", P("tp"))
    )
    got = specs(PARAMS, rules)
    assert got["blocks.0.attn.qkv.weight"] == P("tp", None)
    assert got["emb.weight"] == P("dp")
    assert got["blocks.1.attn.qkv.bias"] == P("tp")
    assert got["blocks.0.scale"] == P()  # 0-d: always replicated
    assert got["step"] is None  # not a tensor: left alone


def test_unmatched_leaves_are_replicated_unless_strict():
    assert specs(PARAMS, Rule(r"emb\..*", P("dp")))["blocks.0.attn.qkv.bias"] == P()
    strict = Rules(Rule(r"emb\..*", P("dp")), strict=True)
    with pytest.raises(ShardingError) as err:
        specs(PARAMS, strict)
    text = str(err.value)
    for path in ["blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.1.attn.qkv.bias"]:
        assert repr(path) in text
    assert "4 leaves" in text and "blocks.0.scale" not in text


def test_a_spec_that_does_not_fit_names_path_shape_spec_and_mesh():
    with pytest.raises(ShardingError) as err:
        specs(PARAMS, Rule(r".*bias", P("tp", None)) + Rule(".*", P()))
    text = str(err.value)
    assert "'blocks.0.attn.qkv.bias'" in text and "(48,)" in text and "P('tp', None)" in text
    assert "AbstractMesh({'dp': 2, 'tp': 2})" in text and "Rule('.*bias'" in text
    with pytest.raises(ShardingError, match=r"'emb.weight'.*unknown mesh axis 'pp'"):
        specs(PARAMS, Rule(r"emb.*", P("pp")))


def test_divisible_rules_reject_uneven_dims():
    rules = Rules(Rule(r"emb\.weight", P(("dp", "tp"))), divisible=True)
    with pytest.raises(ShardingError, match=r"'emb.weight': dim 0 \(size 50\).*not divisible by 4"):
        specs(PARAMS, rules)
    assert specs(PARAMS, Rule(r"emb\.weight", P(("dp", "tp"))))["emb.weight"] == P(("dp", "tp"))


def test_rules_compose_and_flags_or():
    a, b = Rules(Rule("a", P()), strict=True), Rules(Rule("b", P("dp")), divisible=True)
    both = a + b
    assert [r.pattern for r in both] == ["a", "b"] and both.strict and both.divisible
    assert (Rule("x", P()) + b).rules[0].pattern == "x"
    assert Rule.glob("blocks.*.weight", P()).matches("blocks.12.attn.weight")
    assert not Rule.glob("blocks.*.weight", P()).matches("blocks.12.attn.bias")
    with pytest.raises(ShardingError, match="not a valid regex"):
        Rule("(", P())


def test_a_list_of_rules_is_rules_wherever_rules_are_taken():
    listed = [Rule(r".*\.qkv\.weight", P("tp", None)), Rule(r".*\.weight", P("dp"))]
    assert Rules(listed) == Rules(*listed) == Rules(listed[0], [listed[1]])
    assert specs(PARAMS, listed) == specs(PARAMS, Rules(*listed))
    assert specs(PARAMS, listed)["emb.weight"] == P("dp")
    assert sx.rules.zero(3) + listed == Rules(sx.rules.zero(3), listed)
    with pytest.raises(ShardingError, match=r"Rules takes Rule, .* \(or lists of them\); got P"):
        Rules(P("dp"))  # a spec is not a rule, though it is a tuple
    # A list of specs is still a spec tree, not rules.
    assert specs({"a": meta(4), "b": meta(4)}, {"a": P("dp"), "b": P()})["a"] == P("dp")


def test_rules_that_match_no_tensor_warn_or_fail_when_strict():
    foreign = sx.rules.megatron("tp", names=sx.rules.LLAMA_NAMES)  # on a tree of other names
    with pytest.warns(
        sx.UnmatchedRulesWarning, match=r"none of the \d+ rules matches any of the 5"
    ):
        specs(PARAMS, foreign)
    with pytest.raises(ShardingError, match="are they written for another model"):
        specs(PARAMS, Rules(foreign, strict=True))
    specs(PARAMS, sx.rules.zero(3))  # no path rules at all: nothing to match, no warning


def test_tensor_parallel_rules_name_the_weight_matrices_they_leave_whole():
    split = Rules(Rule(r".*\.qkv\.weight", P("tp", None)), tensor_parallel="tp")
    rules = split + Rules(Rule(r"emb\.bias", P()), divisible=True)
    assert rules.tensor_parallel == ("tp",) and rules.divisible
    assert repr(rules).endswith(", divisible=True, tensor_parallel=('tp',))")
    with pytest.warns(
        sx.UnshardedWeightWarning, match=r"leave 1 whole there.*'emb.weight' \(50, 16\)"
    ):
        specs(PARAMS, rules)  # the 1-D biases and the 0-d scales are not weight matrices
    specs(PARAMS, Rule(r"emb\.weight", P()) + rules)  # whole on purpose
    with pytest.raises(ShardingError, match=r"Rule\('emb\\\\.weight', P\(\)\) \+ rules"):
        specs(PARAMS, Rules(rules, strict=True))


class State(NamedTuple):
    mu: dict
    count: torch.Tensor


def test_named_tuple_fields_appear_by_name_in_paths():
    tree = State(mu={"w": meta(4, 4)}, count=meta())
    paths, *_ = layouts_for(tree, MESH, P())
    assert paths == ["mu.w", "count"]


def test_spec_trees_may_be_prefixes_with_none_for_replicated():
    tree = {"a": {"w": meta(4, 4), "b": meta(4)}, "c": meta(4)}
    got = specs(tree, {"a": P("dp"), "c": None})
    assert got == {"a.w": P("dp"), "a.b": P("dp"), "c": P()}
    with pytest.raises(ShardingError, match="does not match the tree's structure"):
        specs(tree, {"zz": P()})


def test_explain_plans_a_large_model_on_meta_tensors():
    params = {f"blocks.{i}.w": meta(8192, 8192) for i in range(4)} | {"emb": meta(32000, 8192)}
    mesh = AbstractMesh({"dp": 64, "tp": 8})
    plan = sx.explain(params, mesh, Rule(r"blocks.*", P("dp", "tp")) + Rule("emb", P(("dp", "tp"))))
    assert len(plan.rows) == 5 and len(plan.rank_bytes) == 512
    w = next(r for r in plan.rows if r.path == "blocks.0.w")
    assert w.local_shape == (128, 1024) and set(w.rank_bytes) == {128 * 1024 * 4}
    emb = next(r for r in plan.rows if r.path == "emb")
    assert emb.uneven and sum(emb.rank_bytes) == 32000 * 8192 * 4
    text = str(plan)
    assert "per rank: max" in text and "emb" in text and "(uneven)" in text


def test_explain_rows_for_sharded_and_partial_layouts():
    mesh = sx.Mesh({"dp": 1})
    x = sx.shard(torch.ones(4, 2), mesh, P("dp"))
    plan = sx.explain({"x": x, "n": 1}, mesh.abstract)
    assert [r.path for r in plan.rows] == ["x"] and plan.rows[0].layout.spec == P("dp")
    lay = sx.Layout(MESH, P("dp"), partial="tp")
    text = str(sx.explain({"g": meta(4, 2)}, MESH, lay))
    assert "partial=('tp',)" in text


def test_shard_needs_a_live_mesh():
    with pytest.raises(ShardingError, match="live Mesh"):
        sx.shard(torch.ones(2), MESH, P())
