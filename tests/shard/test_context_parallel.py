"""Context parallelism (``rules.context_parallel``: ring attention over a
``cp`` axis) on real gloo ranks.

Ring attention itself matches dense attention in fp64 — values and the
gradients of q, k and v — over 2 and 4 ranks, zigzag and contiguous
splits, causal or not, grouped-query heads, with a padding mask (rows
that see no key included). Then whole models, trained 5 AdamW steps on
batches split by ``sx.data`` with ``P(.., zigzag("cp"))``, match the
single-process PyTorch run (same init, same global batches): the loss and
every gradient of every step, to 1e-5 in fp32 — the example GPT on cp=2,
cp=4, dp=2 × cp=2 under ZeRO-3, cp=2 × tp=2 and sp=2 × cp=2 (Ulysses
inside the ring: USP); Hugging Face Llama (rotary positions, GQA) on cp=2
and cp=4 and with a padding mask; GPT-2 on cp=2. Misuse — a batch split
another way than the rule, masks ring attention cannot honour, attention
dropout — fails by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _tiny as tiny
import pytest
import torch
import torch.nn.functional as F
from _dist import RankFailed, run_ranks

import shardax as sx
from shardax import P
from shardax.shard._ring import local_positions, ring_attention

SEQ, BATCH, STEPS = 16, 4, 5
HYPER = (1e-2, (0.9, 0.95), 1e-4, 0.1)  # lr, betas, eps, weight decay (eps: test_tensor_parallel)


# --- ring attention against dense attention ---


def _dense(q, k, v, causal, keys):
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    allowed = keys[:, None, None, :].expand(b, 1, t, t)
    if causal:
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2)) * d**-0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ v


def ring_against_dense(n: int) -> list[tuple[str, float]]:
    """For every case: the largest difference from dense attention of the
    output and of the gradients of q, k, v (this rank's piece), in fp64."""
    mesh = sx.Mesh({"cp": n})
    out = []
    for order in ("zigzag", "contiguous"):
        for causal in (True, False):
            for kv_heads in (4, 2):
                for masked in (False, True):
                    g = torch.Generator().manual_seed(0)
                    b, h, t, d = 2, 4, 16, 8
                    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
                    k, v = torch.randn(2, b, kv_heads, t, d, generator=g, dtype=torch.float64)
                    keys = torch.ones(b, t, dtype=torch.bool)
                    if masked:  # right padding, and left: queries 0..2 of row 1 see no key
                        keys[0, 11:], keys[1, :3] = False, False
                    dout = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
                    whole = [x.clone().requires_grad_() for x in (q, k, v)]
                    (_dense(*whole, causal, keys) * dout).sum().backward()
                    ref = _dense(q, k, v, causal, keys)
                    pos = local_positions(t // n, n, mesh.axis_index("cp"), order)
                    mine = [x[:, :, pos].clone().requires_grad_() for x in (q, k, v)]
                    y = ring_attention(
                        *mine, "cp", mesh=mesh, order=order, is_causal=causal,
                        key_mask=keys[:, pos] if masked else None,
                    )  # fmt: skip
                    (y * dout[:, :, pos]).sum().backward()
                    worst = max(
                        (y - ref[:, :, pos]).abs().max().item(),
                        *((m.grad - w.grad[:, :, pos]).abs().max().item() for m, w in zip(mine, whole, strict=True)),
                    )  # fmt: skip
                    out.append((f"{order} causal={causal} kv={kv_heads} mask={masked}", worst))
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_equals_dense_attention(n: int) -> None:
    for rank in run_ranks(ring_against_dense, n, world_size=n):
        for case, worst in rank:
            assert worst < 1e-12, case


def test_ring_attention_on_one_rank_is_sdpa() -> None:
    q, k, v = (x.requires_grad_() for x in torch.randn(3, 2, 4, 8, 16).unbind(0))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.autograd.grad(expected.sum(), (q, k, v))
    got = ring_attention(q, k, v, mesh=sx.Mesh({"cp": 1}))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), (q, k, v)), want)


# --- whole models against one process ---


def batches(vocab: int, padded: bool = False) -> list[dict[str, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(700 + step)
        x = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
        batch = {"x": x, "y": torch.roll(x, -1, dims=1)}
        if padded:  # right padding of a different length in each row; padded labels ignored
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            for row, keep in enumerate((SEQ, SEQ - 3, SEQ - 7, SEQ - 12)):
                mask[row, keep:] = 0
            batch["mask"] = mask
            batch["y"] = batch["y"].masked_fill(mask == 0, -100)
        out.append(batch)
    return out


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def build(family: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return tiny.example_gpt(seq_len=SEQ, **overrides)
    if family == "gpt2":
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        return tiny.gpt2(n_positions=SEQ, **no_dropout, attn_implementation="sdpa", use_cache=False)
    return tiny.llama(max_position_embeddings=SEQ, attn_implementation="sdpa", **overrides)


def call(family: str, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if family == "gpt":
        return model(batch["x"])
    kwargs = {"attention_mask": batch["mask"]} if "mask" in batch else {}
    return model(batch["x"], use_cache=False, **kwargs).logits


def reference(family: str, padded: bool = False) -> tuple[list[float], list[dict]]:
    """The single-process run: each step's loss and gradients."""
    model = build(family)
    lr, betas, eps, wd = HYPER
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    losses, grads = [], []
    for batch in batches(model.config.vocab_size if family != "gpt" else 32, padded):
        opt.zero_grad()
        loss = loss_of(call(family, model, batch), batch["y"])
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return losses, grads


NAMES = {"gpt": sx.rules.GPT_NAMES, "gpt2": sx.rules.GPT2_NAMES, "llama": sx.rules.LLAMA_NAMES}


def train_cp(
    family: str, shape: dict[str, int], extra: Callable[[str], sx.Rules] | None = None,
    padded: bool = False,
) -> tuple[list[float], list[dict]]:  # fmt: skip
    """5 AdamW steps under ``rules.context_parallel("cp")`` (plus ``extra``)
    on batches split by ``sx.data``: each step's loss and whole gradients."""
    mesh = sx.Mesh(shape)
    names = NAMES[family]
    rules = sx.rules.context_parallel("cp", names=names)
    if extra is not None:
        rules = rules + extra(names)
    model = build(family)
    params = sx.shard(sx.params_of(model), mesh, rules)
    lr, (b1, b2), eps, wd = HYPER
    opt = sx.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    state = opt.init(params)
    spec = P("dp" if "dp" in shape else None, sx.zigzag("cp"))
    vocab = 32 if family == "gpt" else model.config.vocab_size

    def loss_fn(p: dict, batch: dict) -> torch.Tensor:
        return loss_of(call(family, _Applied(model, p), batch), batch["y"])

    losses, grads = [], []
    for batch in batches(vocab, padded):
        local = sx.data.shard_batch(batch, mesh, spec)
        loss, g = sx.value_and_grad(loss_fn)(params, local)
        losses.append(loss.item())
        grads.append({k: v for k, v in sx.gather(g).items() if v is not None})
        params, state = sx.optim.step(opt, g, state, params)
    return losses, grads


class _Applied:
    """``model`` called through ``sx.apply`` with ``params``."""

    def __init__(self, model: torch.nn.Module, params: dict) -> None:
        self.model, self.params = model, params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return sx.apply(self.model, self.params, *args, **kwargs)


def check(got: tuple[list[float], list[dict]], want: tuple[list[float], list[dict]]) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for step, (mine, theirs) in enumerate(zip(got[1], want[1], strict=True)):
        assert mine.keys() >= theirs.keys() - {"lm_head.weight"}, step
        for key, g in theirs.items():
            if key in mine:
                torch.testing.assert_close(mine[key], g, rtol=1e-5, atol=1e-5, msg=f"{step} {key}")


def _zero3(names: Any) -> sx.Rules:
    return sx.rules.zero(3, ("dp", "cp"))


def _tp(names: Any) -> sx.Rules:
    return sx.rules.megatron("tp", names=names)


def _usp(names: Any) -> sx.Rules:
    return sx.rules.ulysses("sp", names=names)


def _remat(names: Any) -> sx.Rules:  # the blocks recomputed in backward: the ring runs again
    return sx.rules.remat(r"blocks\.\d+")


GPT_CASES = {
    "cp2": ({"cp": 2}, None),
    "cp2-remat": ({"cp": 2}, _remat),
    "cp4": ({"cp": 4}, None),
    "dp2xcp2-zero3": ({"dp": 2, "cp": 2}, _zero3),
    "cp2xtp2": ({"cp": 2, "tp": 2}, _tp),
    "sp2xcp2": ({"cp": 2, "sp": 2}, _usp),
}


@pytest.fixture(scope="module")
def gpt_reference() -> tuple[list[float], list[dict]]:
    return reference("gpt")


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_example_gpt_under_context_parallelism_equals_one_process(case, gpt_reference) -> None:
    shape, extra = GPT_CASES[case]
    world = 1
    for size in shape.values():
        world *= size
    for rank in run_ranks(train_cp, "gpt", shape, extra, world_size=world):
        check(rank, gpt_reference)


@pytest.mark.parametrize(
    ("family", "cp", "padded"),
    [
        pytest.param("llama", 2, False, marks=pytest.mark.slow),  # padded below; causal: GPT's
        pytest.param("llama", 4, False, marks=pytest.mark.slow),
        ("llama", 2, True),
        ("gpt2", 2, False),
    ],
    ids=["llama-cp2", "llama-cp4", "llama-cp2-padded", "gpt2-cp2"],
)
def test_hugging_face_models_under_context_parallelism_equal_one_process(
    family: str, cp: int, padded: bool
) -> None:
    want = reference(family, padded)
    for rank in run_ranks(train_cp, family, {"cp": cp}, None, padded, world_size=cp):
        check(rank, want)


# --- misuse, by name ---


def _one_rank_llama() -> tuple[Any, dict]:
    model = build("llama")
    mesh = sx.Mesh({"cp": 1})
    return model, sx.shard(sx.params_of(model), mesh, sx.rules.context_parallel("cp", names="auto"))


def test_the_ring_keeps_only_its_own_pieces_for_the_backward() -> None:
    """Queries, keys and values cut from one fused projection: what the
    ring saves is its own copy of them, the output and the log-sum-exp —
    never the projection's whole buffer — and its output lies token-major,
    so the model's ``transpose(1, 2)`` back to ``[B, T, H·D]`` copies
    nothing."""
    b, t, h, d = 2, 8, 2, 4
    qkv = torch.randn(b, t, 3, h, d, requires_grad=True)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    out = ring_attention(q, k, v, "cp", mesh=sx.Mesh({"cp": 1}))
    saved = out.grad_fn.saved_tensors
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in saved}
    assert qkv.untyped_storage().data_ptr() not in storages
    piece = b * t * h * d * 4
    assert sum(storages.values()) == 3 * piece + piece + b * h * t * 4  # q, k+v, out, lse
    assert out.transpose(1, 2).is_contiguous()
    out.sum().backward()
    want = qkv.detach().clone().requires_grad_()
    wq, wk, wv = (x.transpose(1, 2) for x in want.unbind(2))
    F.scaled_dot_product_attention(wq, wk, wv, is_causal=True).sum().backward()
    torch.testing.assert_close(qkv.grad, want.grad)


def test_position_ids_of_another_split_are_refused() -> None:
    model, params = _one_rank_llama()
    x = torch.randint(0, 32, (2, SEQ))
    own = sx.apply(model, params, x, position_ids=torch.arange(SEQ)[None], use_cache=False)
    assert own.logits.shape == (2, SEQ, 32)  # the global positions of the one rank's piece
    with pytest.raises(sx.ShardingError, match=r"position ids \[5, 6, .*zigzag\('cp'\)"):
        sx.apply(model, params, x, position_ids=torch.arange(5, 5 + SEQ)[None], use_cache=False)


def test_masks_ring_attention_cannot_honour_are_refused() -> None:
    mesh = sx.Mesh({"cp": 1})
    q = torch.randn(2, 4, 8, 8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    window = causal & ~causal.tril(-3)  # the last 3 tokens only
    with sx.RingAttention("cp", mesh), pytest.raises(sx.ShardingError, match="sliding windows"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=window)
    with sx.RingAttention("cp", mesh), pytest.raises(sx.ShardingError, match=r"dropout_p=0\.1"):
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
    with sx.RingAttention("cp", mesh), pytest.raises(sx.ShardingError, match="KV cache"):
        F.scaled_dot_product_attention(q[:, :, :1], q, q)


def test_a_padding_mask_is_read_as_the_key_mask_it_stands_for() -> None:
    """Hugging Face's causal mask with padding, bool or additive, becomes
    ring attention's key mask: the same result as the mask itself."""
    mesh = sx.Mesh({"cp": 1})
    q, k, v = torch.randn(3, 2, 4, 8, 8).unbind(0)
    keys = torch.ones(2, 8, dtype=torch.bool)
    keys[1, 5:] = False
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for given in (mask, additive):
        with sx.RingAttention("cp", mesh):
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=given)
        torch.testing.assert_close(got, want)


def test_a_zigzag_piece_of_odd_length_is_refused() -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(sx.ShardingError, match="multiple of 2"):
        ring_attention(q, q, q, mesh=sx.Mesh({"cp": 1}))


def test_attention_dropout_in_a_model_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = tiny.gpt2(n_positions=SEQ, attn_pdrop=0.1, attn_implementation="sdpa", use_cache=False)
    mesh = sx.Mesh({"cp": 1})
    params = sx.shard(sx.params_of(model), mesh, sx.rules.context_parallel("cp", names="auto"))
    with pytest.raises(sx.ShardingError, match="attention dropout"):
        sx.apply(model, params, torch.randint(0, 32, (2, SEQ)))


def test_explain_shows_each_ranks_activation_bytes_by_sequence_length() -> None:
    with torch.device("meta"):
        model = tiny.example_gpt(seq_len=SEQ)
    rules = sx.rules.context_parallel("cp") + sx.rules.zero(3, ("dp", "cp"))
    notes = sx.explain(sx.params_of(model), sx.AbstractMesh({"dp": 2, "cp": 4}), rules).notes
    assert notes[0].startswith("ring attention over 'cp' (4 ranks, zigzag): 2 attention layers")
    # 17·d·4 B per token per layer (fp32, d=16), 2 layers: 4,096 tokens over 4 ranks
    assert "4,096 tokens 2.1 MiB (one process 8.5 MiB)" in notes[1]


def _train_on_another_split(spec: P) -> None:
    mesh = sx.Mesh({"cp": 2})
    model = build("gpt")
    params = sx.shard(sx.params_of(model), mesh, sx.rules.context_parallel("cp"))
    x = torch.randint(0, 32, (2, SEQ))
    local = sx.data.shard_batch({"x": x}, mesh, spec)
    sx.apply(model, params, local["x"])


@pytest.mark.parametrize(
    ("spec", "said"),
    [(P(None, "cp"), "in contiguous chunks over"), (P(), "without splitting its sequence")],
    ids=["contiguous", "not-split"],
)
def test_a_batch_split_another_way_than_the_rule_is_refused(spec: P, said: str) -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_train_on_another_split, spec, world_size=2)
    for err in failed.value.errors.values():
        assert isinstance(err, sx.ShardingError)
        assert said in str(err) and "P(<data axes>, zigzag('cp'))" in str(err)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_the_plain_block_equals_the_kernel(causal: bool, masked: bool) -> None:
    """The blocks in plain matmuls (what CUDA runs) against the CPU flash
    kernel: the output, log-sum-exp and, given the whole attention's, the
    gradients — rows that see no key included."""
    from shardax.shard import _ring

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = torch.randn(4, 2, 3, 8, 4, generator=g, dtype=torch.float64).unbind(0)
    keys = torch.ones(2, 8, dtype=torch.bool)
    if masked:
        keys[1, :3] = False
    keys = keys if masked else None
    fast = _ring._forward_block(q, k, v, causal, keys, 0.5)
    plain = _ring._math_forward(q, k, v, causal, keys, 0.5)
    torch.testing.assert_close(plain, fast)
    out, lse = fast
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    want = _ring._backward_block(dout, q, k, v, out, lse, causal, keys, 0.5)
    torch.testing.assert_close(
        _ring._math_backward(dout, q, k, v, out, lse, causal, keys, 0.5), want
    )
