"""``names="auto"`` and :class:`shardax.UnshardedWeightWarning`, in one process.

``rules.megatron(tp, names="auto")`` (and ``rules.ulysses``) pick the module
names by the parameter paths when the rules meet them: on the example GPT,
Hugging Face GPT-2, Llama, Mistral and Qwen2 (tiny configs) they give
exactly what the explicit names give — specs, placements, module rules.
Tensor-parallel rules that leave a weight matrix whole warn, naming it."""

from __future__ import annotations

import _tiny as tiny
import pytest
import torch

import shardax as sx
from shardax import P, Rule, ShardingError


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return tiny.example_gpt()
    if family == "gpt2":
        return tiny.gpt2()
    return tiny.llama(family)


NAMES = {
    "gpt": sx.rules.GPT_NAMES,
    "gpt2": sx.rules.GPT2_NAMES,
    "llama": sx.rules.LLAMA_NAMES,
    "mistral": sx.rules.LLAMA_NAMES,
    "qwen2": sx.rules.LLAMA_NAMES,
}
PRESETS = {
    "megatron": lambda names: sx.rules.megatron("tp", names=names),
    "megatron-sp": lambda names: sx.rules.megatron("tp", sequence_parallel=True, names=names),
    "ulysses": lambda names: sx.rules.ulysses("sp", names=names),
}


def placed(params: dict) -> dict:
    """What shard gives each leaf, as comparable text (module rules' forwards
    are closures, equal by their names)."""
    return {
        k: (x.spec, repr(x.placement), x.placement.compute.partial, repr(x.placement.modules))
        for k, x in params.items()
    }


@pytest.mark.parametrize("family", list(NAMES))
def test_auto_names_give_the_explicit_names_rules(family):
    model = build(family)
    params = sx.params_of(model)
    mesh = sx.Mesh({"sp": 1, "tp": 1})
    for preset in PRESETS.values():
        auto, explicit = preset("auto"), preset(NAMES[family])
        assert repr(auto.resolve(params)) == repr(explicit)  # every entry, flags too
        assert placed(sx.shard(params, mesh, auto)) == placed(sx.shard(params, mesh, explicit))
    # Real splits, planned: dp × tp with ZeRO-3 over dp.
    plan_mesh = sx.AbstractMesh({"dp": 2, "tp": 2})
    zero = sx.rules.zero(3, "dp")
    auto = sx.explain(params, plan_mesh, zero + sx.rules.megatron("tp", names="auto"))
    explicit = sx.explain(params, plan_mesh, zero + sx.rules.megatron("tp", names=NAMES[family]))
    assert str(auto) == str(explicit)
    assert sum("tp" in row.layout.spec.axes for row in auto.rows) >= 8  # 2 layers' linears


def test_auto_rules_carry_their_decision_to_apply_and_init_params():
    with torch.device("meta"):
        model = build("gpt")
    mesh = sx.Mesh({"tp": 1})
    auto = sx.rules.megatron("tp", names="auto")
    params = sx.init_params(model, mesh, auto)
    explicit = sx.init_params(model, mesh, sx.rules.megatron("tp"))
    assert placed(params) == placed(explicit)
    dense = build("gpt")
    params = sx.shard(sx.params_of(dense), mesh, auto)
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(sx.apply(dense, params, x, rules=auto), dense(x))


def test_checkpoints_decide_auto_rules_by_their_parameter_paths(tmp_path):
    """Offline ``ckpt.reshard`` and ``ckpt.load`` by rules decide
    ``names="auto"`` with the checkpoint's parameter paths (the last key of
    ``params.<path>`` and ``opt_state.….<path>``)."""
    model = build("gpt2")
    params = sx.shard(sx.params_of(model), sx.Mesh({"tp": 1}), sx.rules.zero(3, "tp"))
    opt_state = sx.optim.adamw(1e-3).init(params)
    sx.ckpt.save(tmp_path / "c", {"params": params, "opt_state": opt_state})
    auto = sx.rules.megatron("tp", names="auto")
    sx.ckpt.reshard(tmp_path / "c", tmp_path / "tp2", auto, mesh={"tp": 2})
    index = sx.ckpt.read_index(tmp_path / "tp2")
    qkv = "transformer.h.0.attn.c_attn.weight"
    assert index.leaves[f"params.{qkv}"].spec == P(None, sx.blocks(3, "tp"))
    assert index.leaves[f"opt_state.0.mu.{qkv}"].spec == P(None, sx.blocks(3, "tp"))
    loaded = sx.ckpt.load(tmp_path / "c", auto, mesh=sx.Mesh({"tp": 1}))
    assert torch.equal(sx.gather(loaded["params"][qkv]), model.transformer.h[0].attn.c_attn.weight)


def test_auto_rules_compose_in_place_and_need_a_tree_to_decide():
    auto = sx.rules.megatron("tp", sequence_parallel=True, names="auto")
    rules = Rule(r"lm_head\.weight", P()) + auto + sx.rules.zero(1, "dp")
    assert repr(rules) == (
        "Rules(Rule('lm_head\\\\.weight', P()), megatron('tp', sequence_parallel=True, "
        "names='auto'), ShardOver('dp', roles=('opt_state',)))"
    )
    assert rules == Rule(r"lm_head\.weight", P()) + auto + sx.rules.zero(1, "dp")
    paths = list(sx.params_of(build("llama")))
    decided = rules.resolve(paths)
    assert decided.rules[0] == Rule(r"lm_head\.weight", P())  # first, as written
    assert decided.match("model.layers.1.mlp.down_proj.weight").spec == P(None, "tp")
    assert decided.divisible and decided.tensor_parallel == ("tp",)
    with pytest.raises(ShardingError, match=r"spec_for takes rules decided for one tree"):
        sx.rules.ulysses("sp", names="auto").spec_for("w", (4, 4), sx.AbstractMesh({"sp": 2}))
    with pytest.raises(ShardingError, match="names is a TransformerNames or 'auto'; got 'gpt2'"):
        sx.rules.megatron("tp", names="gpt2")


def test_auto_names_that_fit_no_model_or_two_are_errors_naming_paths():
    mesh = sx.AbstractMesh({"tp": 2})
    bert = {
        f"encoder.layer.0.attention.self.{n}.weight": torch.empty(16, 16, device="meta")
        for n in ("query", "key", "value")
    }
    with pytest.raises(ShardingError) as err:
        sx.explain(bert, mesh, sx.rules.megatron("tp", names="auto"))
    text = str(err.value)
    assert "'encoder.layer.0.attention.self.query.weight'" in text and "3 tensors" in text
    for known in ("GPT_NAMES", "GPT2_NAMES", "LLAMA_NAMES", "Qwen2ForCausalLM"):
        assert known in text
    assert "names=sx.rules.TransformerNames(column=..., row=..." in text
    both = {**sx.params_of(build("gpt")), **sx.params_of(build("llama"))}
    with pytest.raises(ShardingError, match="fit the names of GPT_NAMES and of LLAMA_NAMES"):
        sx.explain(both, mesh, sx.rules.ulysses("sp", names="auto"))


def test_tensor_parallel_rules_warn_of_weights_they_leave_whole():
    params = sx.params_of(build("gpt"))
    params["adapter.weight"] = torch.zeros(16, 16)  # a layer the names miss
    params["adapter.bias"] = torch.zeros(16)  # 1-D: not a weight matrix
    mesh = sx.AbstractMesh({"tp": 2})
    rules = sx.rules.megatron("tp")
    with pytest.warns(sx.UnshardedWeightWarning) as record:
        sx.explain(params, mesh, rules)
    text = str(record[0].message)
    assert "leave 1 whole" in text and "'adapter.weight' (16, 16)" in text
    assert "wpe" not in text  # GPT_NAMES.replicated: whole on purpose
    assert "Rule('adapter\\\\.weight', P()) + rules" in text
    with pytest.raises(
        ShardingError, match=r"leave 1 whole there, on every rank: 'adapter\.weight'"
    ):
        sx.explain(params, mesh, sx.Rules(rules, strict=True))
    sx.explain(params, mesh, Rule(r"adapter\.weight", P()) + rules)  # replicated on purpose
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    assert sx.rules.megatron("tp", names="auto").unsplit_weights(shapes) == ["adapter.weight"]
    with pytest.warns(sx.UnshardedWeightWarning, match=r"'adapter\.weight'"):  # not over tp
        sx.explain(
            params, sx.AbstractMesh({"dp": 2, "tp": 2}), Rule("adapter.weight", P("dp")) + rules
        )
    sx.explain(params, mesh, sx.rules.ulysses("tp"))  # no weight is meant to split: no warning


def test_ulysses_refuses_a_sliding_window_shorter_than_the_sequence():
    """Ulysses runs full causal attention: Mistral's sliding window, shorter
    than the sequence, would be silently widened; it is an error instead."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
    )  # fmt: skip
    model = MistralForCausalLM(config)
    params = sx.shard(sx.params_of(model), sx.Mesh({"sp": 1}), sx.rules.ulysses("sp", names="auto"))
    positions = torch.arange(8)
    with pytest.raises(
        ShardingError, match="sliding window of 4 tokens, shorter than the sequence"
    ):
        sx.apply(model, params, torch.zeros(1, 8, dtype=torch.long), position_ids=positions[None],
                 cache_position=positions)  # fmt: skip
