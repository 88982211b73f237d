"""``init_params`` on ``meta`` models reproduces the dense initialisation
under the same seed, shard by shard: Hugging Face models by replaying their
construction (constructor draws, ``_init_weights`` including GPT-2's
parent-level rescaling of ``c_proj``, rotary buffers, ties), other models by
``reset_parameters`` and ``init_fn`` — also where an initialiser writes a
child's tensor. A tensor that nothing initialises is an error naming it."""

from __future__ import annotations

import _tiny as tiny
import pytest
import torch
from _dist import run_ranks
from torch import nn

import shardax as sx


def gpt2() -> nn.Module:
    return tiny.gpt2()


def llama(tie: bool = False) -> nn.Module:
    return tiny.llama(tie_word_embeddings=tie)


def dense_and_meta(make, seed: int = 0) -> tuple[dict[str, torch.Tensor], nn.Module]:
    torch.manual_seed(seed)
    dense = sx.params_of(make())
    with torch.device("meta"):
        meta = make()
    return dense, meta


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different


@pytest.mark.parametrize(
    "make",
    [gpt2, llama, lambda: llama(tie=True)],
    ids=["gpt2", "llama", "llama-tied"],
)
def test_a_hugging_face_model_initialises_as_its_dense_constructor(make):
    want, meta = dense_and_meta(make)
    torch.manual_seed(0)
    got = sx.gather(sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(3)))
    assert_same(got, want)
    if make is gpt2:  # c_proj rescaled by its parent: std 0.02 / sqrt(2 · n_layer)
        scaled, plain = (
            got["transformer.h.0.attn.c_proj.weight"],
            got["transformer.h.0.attn.c_attn.weight"],
        )
        assert scaled.std() < 0.75 * plain.std()


def test_the_rotary_buffers_get_their_values():
    want, meta = dense_and_meta(llama)
    torch.manual_seed(0)
    got = sx.gather(sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(0)))
    assert torch.equal(got["model.rotary_emb.inv_freq"], want["model.rotary_emb.inv_freq"])
    assert got["model.rotary_emb.inv_freq"][0] == 1.0


def _gpt2_sharded() -> dict[str, torch.Tensor]:
    mesh = sx.Mesh({"tp": 2})
    rules = sx.rules.megatron("tp", names=sx.rules.GPT2_NAMES)
    with torch.device("meta"):
        meta = gpt2()
    torch.manual_seed(0)
    params = sx.init_params(meta, mesh, rules)
    assert params["transformer.h.0.attn.c_attn.weight"].local.numel() == 16 * 48 // 2
    return sx.gather(params)


def test_gpt2_initialises_shard_by_shard_on_two_ranks_as_densely():
    """Megatron over tp (c_attn split block by block): the rescaled c_proj
    (row-parallel, split) is gathered from its shards, rescaled, split again."""
    want, _ = dense_and_meta(gpt2)
    for got in run_ranks(_gpt2_sharded, world_size=2):
        assert_same(got, want)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.empty(4))  # no reset_parameters gives it values


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(), Mlp()])
        self.head = nn.Linear(4, 6)


def scaled_init(module: nn.Module) -> None:
    """A parent-level rule as GPT-2's: each block's ``down`` drawn with a
    smaller std, and its own ``gain`` set."""
    if isinstance(module, Mlp):
        nn.init.normal_(module.down.weight, std=0.02 / 2)
        nn.init.ones_(module.gain)
    elif isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


def test_init_fn_runs_after_construction_and_may_write_a_childs_tensor():
    torch.manual_seed(3)
    dense = Net()
    dense.apply(scaled_init)
    with torch.device("meta"):
        meta = Net()
    torch.manual_seed(3)
    got = sx.gather(sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(3), init_fn=scaled_init))
    assert_same(got, sx.params_of(dense))
    assert meta.blocks[0].gain.device.type == "meta"  # the model is left as it was


def test_a_tensor_nothing_initialises_is_an_error_naming_it():
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(
        sx.ShardingError, match=r"'blocks\.0\.gain', 'blocks\.1\.gain' are on the meta"
    ):
        sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(3))
    with pytest.raises(sx.ShardingError, match="init_fn is a function"):
        sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(3), init_fn="normal")


def test_init_fn_on_a_hugging_face_model_runs_after_its_own_init():
    want, meta = dense_and_meta(llama)

    def zero_norms(module: nn.Module) -> None:
        if type(module).__name__ == "LlamaRMSNorm":
            nn.init.zeros_(module.weight)

    torch.manual_seed(0)
    got = sx.gather(sx.init_params(meta, sx.Mesh({"dp": 1}), sx.rules.zero(3), init_fn=zero_norms))
    for k, v in want.items():
        if k.endswith("norm.weight"):
            assert not got[k].any(), k
        else:
            assert torch.equal(got[k], v), k


@pytest.mark.parametrize("make", [tiny.example_gpt, tiny.llama])
def test_only_keeps_some_tensors_with_the_dense_values(make):
    """A pipeline rank initialises its stages alone: every draw is still
    made (the kept values are the dense model's), the rest is never kept."""
    torch.manual_seed(0)
    dense = sx.params_of(make())
    with torch.device("meta"):
        model = make()
    keep = [k for k in dense if ".1." in k] + [next(iter(dense))]
    torch.manual_seed(0)
    part = sx.init_params(model, sx.Mesh({"dp": 1}), sx.rules.zero(3), only=keep)
    assert sorted(part) == sorted(keep)
    for k, v in part.items():
        assert torch.equal(sx.gather(v), dense[k]), k
    with pytest.raises(sx.ShardingError, match=r"\['blocks\.9\.x'\] are not key paths"):
        sx.init_params(model, sx.Mesh({"dp": 1}), sx.rules.zero(3), only=["blocks.9.x"])


def test_the_dry_run_draws_nothing_on_meta() -> None:
    """``init_params`` finds what each initialiser writes by running it on
    ``meta`` copies; the random fills there are skipped, not run (torch's
    meta kernel for one imports ``torch._dynamo``: some 75 MiB in every
    process that merely builds its parameters). In a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, torch, shardax as sx\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8))\n"
        "params = sx.init_params(model, sx.Mesh({'dp': 1}), sx.rules.zero(3))\n"
        "assert set(params) == {'0.weight', '1.weight', '1.bias', '2.weight', '2.bias'}\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
