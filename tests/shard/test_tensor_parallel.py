"""Tensor parallelism as rules (``rules.megatron``) on real gloo ranks: the
example GPT trained on tp=2, and dp=2 × tp=2 with ZeRO-1 and ZeRO-3, matches
the single-process PyTorch reference (same init, same global batch,
torch.optim.AdamW) over 5 steps — with a plain ``F.cross_entropy`` on the
whole logits ``apply`` returns, and with the marked vocabulary-parallel
piece and its loss; the vocab-parallel pieces agree with their dense
counterparts, values and gradients; misuse gets clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _parity import MEGATRON_CASES, MEGATRON_IDS, adamw_steps

import shardax as sx
from shardax import P

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=4)
BATCH, STEPS = 4, 5
# Attention's key bias has a zero gradient in exact arithmetic (softmax ignores
# a shift shared by all keys); in floats it is rounding noise, which Adam with
# eps=1e-8 would blow up to steps of ~lr in either direction. eps=1e-4 keeps
# such noise negligible without changing the other parameters' steps much.
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-4, 0.1


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in sx.params_of(model).items()}


def gpt_params(mesh: sx.Mesh, rules: sx.Rules) -> tuple[GPT, dict]:
    with torch.device("meta"):
        model = GPT(CFG)
    torch.manual_seed(0)
    return model, sx.init_params(model, mesh, rules)


def train_tp(
    shape: dict[str, int], stage: int, sp: bool = False, logits: str = "gather"
) -> tuple[list[float], dict, dict]:
    mesh = sx.Mesh(shape)
    rules = sx.rules.megatron("tp", sequence_parallel=sp, logits=logits)
    if "dp" in shape:
        rules = rules + sx.rules.zero(stage, "dp")
    model, params = gpt_params(mesh, rules)

    def loss_fn(p, x, y):
        out = sx.apply(model, p, x)  # the params carry the module rules
        if logits == "vocab_parallel":  # this rank's vocabulary piece, marked
            return sx.vocab_parallel_cross_entropy(out, y)
        return F.cross_entropy(out.flatten(0, 1), y.flatten())  # whole logits: a plain loss

    batches = [batch(step) for step in range(STEPS)]
    losses, params, _ = adamw_steps(params, loss_fn, batches, mesh, (LR, BETAS, EPS, WD))
    specs = {k: v.spec for k, v in params.items()}
    return losses, sx.gather(params), specs


# dp2 x tp2 under ZeRO-1 and ZeRO-3 without sequence parallelism with pytest -m slow:
# ZeRO-3 with it runs by default, dp2 x tp2 ZeRO-3 alone on Llama (test_hf_models.py)
# and GPT-2 (tests/ckpt/test_hf_roundtrip.py), ZeRO-1's own path in test_train.py.
SLOW = {"dp2xtp2-zero1", "dp2xtp2-zero3"}
# The marked vocabulary-parallel logits by default on tp2 and dp2 x tp2 ZeRO-3 with SP.
FAST_DEFAULT = {"tp2", "dp2xtp2-zero3-sp"}
GPT_CASES = [
    pytest.param(
        *case,
        logits,
        id=name if logits == "gather" else f"{name}-vocab-parallel",
        marks=[pytest.mark.slow]
        if name in SLOW or (logits != "gather" and name not in FAST_DEFAULT)
        else [],
    )
    for logits in ("gather", "vocab_parallel")
    for case, name in zip(MEGATRON_CASES, MEGATRON_IDS, strict=True)
]


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("shape", "stage", "sp", "logits"), GPT_CASES)
def test_megatron_gpt_matches_pytorch(shape, stage, sp, logits):
    """Both kinds of logits: whole ones (the default) under a plain
    ``F.cross_entropy``, and the marked piece under
    ``vocab_parallel_cross_entropy``."""
    ref_losses, ref_params = reference()
    world = 2 if shape == {"tp": 2} else 4
    runs = run_ranks(train_tp, shape, stage, sp, logits, world_size=world)
    for losses, params, specs in runs:
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        assert sorted(params) == sorted(ref_params)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5, msg=k)
        assert "tp" in specs["blocks.0.attn.qkv.weight"].axes
        assert "tp" in specs["blocks.1.mlp.proj.weight"].axes
        assert ("dp" in specs["blocks.1.mlp.proj.weight"].axes) == (stage == 3)
        assert "tp" not in specs["blocks.0.ln_1.weight"].axes


def vocab_parallel_pieces(vocab: int) -> tuple[bool, bool, bool, bool]:
    """Embedding and cross-entropy over a vocabulary split on tp equal their
    dense versions, in value and gradient."""
    mesh = sx.Mesh({"tp": -1})
    n, i = mesh.size("tp"), mesh.axis_index("tp")
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(vocab, 6, generator=g)
    logits = torch.randn(5, 3, vocab, generator=g)
    ids = torch.randint(0, vocab, (5, 3), generator=g)
    rows = slice(i * vocab // n, (i + 1) * vocab // n)

    emb = torch.nn.Embedding(vocab, 6)
    emb.weight = torch.nn.Parameter(weight[rows].clone())
    partial = sx.vocab_parallel_embedding("tp")(emb, mesh, ids)
    emb_ok = torch.equal(sx.collectives.psum(partial, "tp", mesh=mesh), F.embedding(ids, weight))

    split = sx.Layout(mesh, sx.P(None, None, "tp"))
    piece = logits[..., rows].clone().requires_grad_(True)
    loss = sx.vocab_parallel_cross_entropy(sx.Sharded(piece, split, logits.shape), ids)
    sx.collectives.count_once(loss, "tp", mesh=mesh).backward()
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), ids.flatten())
    ref.backward()
    value_ok = torch.allclose(loss, ref, rtol=1e-6, atol=1e-6)
    grad_ok = torch.allclose(piece.grad, full.grad[..., rows], rtol=1e-5, atol=1e-7)
    ignored = ids.clone()
    ignored[0] = -100
    masked = sx.vocab_parallel_cross_entropy(
        sx.Sharded(logits[..., rows], split, logits.shape), ignored
    )
    ignore_ok = torch.allclose(
        masked, F.cross_entropy(logits.flatten(0, 1), ignored.flatten()), rtol=1e-6, atol=1e-6
    )
    return emb_ok, value_ok, grad_ok, ignore_ok


@pytest.mark.world_size(2)
def test_vocab_parallel_embedding_and_cross_entropy_equal_the_dense_ones():
    for result in run_ranks(vocab_parallel_pieces, 10, world_size=2):
        assert result == (True, True, True, True)


def marked_logits() -> dict[str, str]:
    """The vocabulary-parallel head's piece, marked, under plain torch: each
    use a SplitTensorError naming the call and the fix, never a number; it
    gathers into the whole logits the default head returns."""
    mesh = sx.Mesh({"tp": 2})
    x, y = batch(0)
    out: dict[str, str] = {}
    model, whole_params = gpt_params(mesh, sx.rules.megatron("tp"))
    model, params = gpt_params(mesh, sx.rules.megatron("tp", logits="vocab_parallel"))
    whole = sx.apply(model, whole_params, x)
    piece = sx.apply(model, params, x)
    out["whole"] = f"{type(whole).__name__} {tuple(whole.shape)}"
    out["piece"] = f"{type(piece).__name__} {piece.shape} {piece.local_shape}"
    out["gathered"] = str(torch.equal(sx.gather(piece), whole))
    uses = {
        "cross_entropy": lambda: F.cross_entropy(piece, y),
        "flatten": lambda: piece.flatten(0, 1),
        "float": lambda: piece.float(),
        "softmax": lambda: torch.softmax(piece, -1),
        "index": lambda: piece[:, -1],
        "mul": lambda: piece * 2.0,
        "argmax": lambda: piece.argmax(-1),
    }
    for name, use in uses.items():
        try:
            use()
            out[name] = "no error"
        except sx.SplitTensorError as err:
            out[name] = str(err)
    loss = sx.vocab_parallel_cross_entropy(piece, y)
    out["loss"] = str(torch.allclose(loss, F.cross_entropy(whole.flatten(0, 1), y.flatten())))
    return out


@pytest.mark.world_size(2)
def test_marked_logits_refuse_every_plain_use():
    for out in run_ranks(marked_logits, world_size=2):
        assert out["whole"] == f"Tensor {(BATCH, CFG.seq_len, CFG.vocab_size)}"
        assert out["piece"] == (
            f"Sharded {(BATCH, CFG.seq_len, CFG.vocab_size)} "
            f"{(BATCH, CFG.seq_len, CFG.vocab_size // 2)}"
        )
        assert out["gathered"] == "True" and out["loss"] == "True"
        for name, where in [
            ("cross_entropy", "torch.nn.functional.cross_entropy"),
            ("flatten", ".flatten"),
            ("float", ".float"),
            ("softmax", "torch.softmax"),
            ("index", "__getitem__"),
            ("mul", "__mul__"),
            ("argmax", ".argmax"),
        ]:
            message = out[name]
            assert message.startswith(f"{where} got a Sharded value") or where in message, message
            assert "shardax.gather" in message and "vocab_parallel_cross_entropy" in message
            assert "(4, 8, 16) of a (4, 8, 32) tensor" in message, message


def test_marked_logits_on_one_rank():
    """tp=1 (``examples/finetune_hf.py --tp 1``): the piece is the whole
    vocabulary, still marked, and its loss the dense one."""
    mesh = sx.Mesh({"tp": 1})
    x, y = batch(0)
    model, params = gpt_params(mesh, sx.rules.megatron("tp", logits="vocab_parallel"))
    logits = sx.apply(model, params, x)
    assert isinstance(logits, sx.Sharded) and logits.local_shape == logits.shape
    dense = F.cross_entropy(logits.local.flatten(0, 1), y.flatten())
    torch.testing.assert_close(sx.vocab_parallel_cross_entropy(logits, y), dense)


def test_vocab_parallel_cross_entropy_refuses_a_plain_tensor():
    """Whole logits passed as a piece were a silent wrong loss: the plain
    tensor is refused, the message naming F.cross_entropy and the marked
    piece."""
    with pytest.raises(sx.ShardingError, match=r"got a plain tensor of shape \(3, 7\)") as err:
        sx.vocab_parallel_cross_entropy(torch.randn(3, 7), torch.zeros(3, dtype=torch.long))
    assert "F.cross_entropy" in str(err.value) and "logits='vocab_parallel'" in str(err.value)
    mesh = sx.Mesh({"tp": 1})
    piece = sx.Sharded(torch.randn(3, 7), sx.Layout(mesh, sx.P("tp")), (3, 7))
    with pytest.raises(sx.ShardingError, match="split over the last dim"):
        sx.vocab_parallel_cross_entropy(piece, torch.zeros(3, dtype=torch.long))
    piece = sx.Sharded(torch.randn(3, 7), sx.Layout(mesh, sx.P(None, "tp")), (3, 7))
    with pytest.raises(sx.ShardingError, match="split over \\('tp',\\)"):
        sx.vocab_parallel_cross_entropy(piece, torch.zeros(3, dtype=torch.long), "dp")
    with pytest.raises(sx.ShardingError, match=r"need targets of shape \(3,\)"):
        sx.vocab_parallel_cross_entropy(piece, torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(sx.ShardingError, match=r"logits='whole'\): 'gather'"):
        sx.rules.megatron("tp", logits="whole")


def split_output_edges() -> dict[str, object]:
    """What review found passing for whole outputs, each on 2 ranks: a head
    kept whole by a rule before the preset's (its output is whole: not
    gathered again), a tied head the names leave out (refused), a head
    split unevenly (the marked piece's layout is torch.chunk's, the loss
    exact), a vocabulary smaller than the axis (one rank's piece empty), a
    sequence that does not divide by the axis (refused)."""
    mesh = sx.Mesh({"tp": 2})
    x, y = batch(0)
    out: dict[str, object] = {}
    torch.manual_seed(0)
    untied = GPT(attrs.evolve(CFG, tie_embeddings=False))
    with torch.no_grad():
        reference = F.cross_entropy(untied(x).flatten(0, 1), y.flatten())
        kept = sx.Rule(r"lm_head\.weight", P()) + sx.rules.megatron("tp")
        whole = sx.apply(untied, sx.shard(sx.params_of(untied), mesh, kept), x)
    out["kept"] = (
        tuple(whole.shape),
        bool(torch.allclose(F.cross_entropy(whole.flatten(0, 1), y.flatten()), reference)),
    )
    fast = sx.Rule(r"lm_head\.weight", P()) + sx.rules.megatron("tp", logits="vocab_parallel")
    with torch.no_grad():
        marked = sx.apply(untied, sx.shard(sx.params_of(untied), mesh, fast), x)
    out["kept marked"] = (
        marked.spec,
        bool(torch.allclose(sx.vocab_parallel_cross_entropy(marked, y), reference)),
    )
    names = sx.rules.TransformerNames(
        column=r"blocks\.\d+\.(attn\.qkv|mlp\.fc)", row=r"blocks\.\d+\.(attn|mlp)\.proj",
        vocab="wte", replicated="wpe",
    )  # fmt: skip
    tied = GPT(CFG)  # its head tied to wte, which the names split; no head named
    try:
        sx.apply(tied, sx.shard(sx.params_of(tied), mesh, sx.rules.megatron("tp", names=names)), x)
        out["tied"] = "no error"
    except sx.ShardingError as err:
        out["tied"] = str(err)
    head = torch.nn.Sequential()
    head.add_module("head", torch.nn.Linear(4, 7, bias=False))
    h = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0, 3, 4, 6, 2])
    uneven = sx.Rules(
        sx.Rule(r"head\.weight", P("tp", None)),
        sx.ModuleRule("head", output=sx.SplitOutput("tp", gather=False)),
    )
    piece = sx.apply(head, sx.shard(sx.params_of(head), mesh, uneven), h)
    loss = sx.vocab_parallel_cross_entropy(piece, t)
    out["uneven"] = (
        piece.shape,
        piece.local_shape,
        bool(torch.allclose(loss, F.cross_entropy(head(h), t))),
    )
    logits = torch.randn(5, 1, generator=torch.Generator().manual_seed(3))
    tiny = sx.vocab_parallel_cross_entropy(sx.shard(logits, mesh, P(None, "tp")), t * 0)
    out["empty"] = bool(torch.allclose(tiny, F.cross_entropy(logits, t * 0)))
    try:
        sx.Relayout(P(), P(None, "tp"))(torch.ones(2, 5, 3), mesh, "wte output")
        out["odd"] = "no error"
    except sx.ShardingError as err:
        out["odd"] = str(err)
    return out


@pytest.mark.world_size(2)
def test_split_outputs_at_their_edges_are_whole_or_refused():
    for out in run_ranks(split_output_edges, world_size=2):
        assert out["kept"] == ((BATCH, CFG.seq_len, CFG.vocab_size), True)
        assert out["kept marked"] == (P(), True)
        assert "params['wte.weight'] (32, 16) computes split over ['tp']" in out["tied"]
        assert "shared with 'lm_head' (Linear)" in out["tied"] and "head=" in out["tied"]
        shape, local, exact = out["uneven"]
        assert shape == (5, 7) and local in ((5, 4), (5, 3)) and exact
        assert out["empty"] is True
        assert "splits dim 1 of a (2, 5, 3) activation over ('tp',) (2 ranks)" in out["odd"]
        assert "divides by 2" in out["odd"]


def test_megatron_needs_even_splits_and_names():
    mesh = sx.AbstractMesh({"tp": 3})
    with pytest.raises(sx.ShardingError, match=r"blocks\.0\.mlp\.fc\.weight"):
        sx.rules.megatron("tp").spec_for("blocks.0.mlp.fc.weight", (8, 4), mesh)
    with pytest.raises(sx.ShardingError, match="names is a TransformerNames"):
        sx.rules.megatron("tp", names={"column": "x"})
    with pytest.raises(sx.ShardingError, match="not a valid regex"):
        sx.rules.TransformerNames(column="(", row="x")


def test_module_rules_need_sharded_params_and_rules():
    with torch.device("meta"):
        model = GPT(CFG)
    params = {k: torch.zeros(v.shape) for k, v in sx.params_of(model).items()}
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(sx.ShardingError, match="no parameter is Sharded"):
        sx.apply(model, params, x, rules=sx.rules.megatron("tp"))
    with pytest.raises(sx.ShardingError, match=r"apply\(rules=\.\.\.\) takes Rules"):
        sx.apply(model, params, x, rules={"tp": 2})


def _peak_mib(fn) -> float:
    """The rise of this process's peak RSS while ``fn`` runs (Linux)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current RSS
    before = status("VmRSS")
    fn()
    return (status("VmHWM") - before) / 1024


def cross_entropy_memory(tokens: int, vocab: int) -> tuple[float, float]:
    """Peak memory of forward + backward: the vocab-parallel loss on this
    rank's half of the logits, and the dense loss on the full logits."""
    mesh = sx.Mesh({"tp": -1})
    n, i = mesh.size("tp"), mesh.axis_index("tp")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    piece = torch.randn(tokens, vocab // n, generator=g).requires_grad_(True)
    full = torch.randn(tokens, vocab, generator=g).requires_grad_(True)
    split = sx.Layout(mesh, sx.P(None, "tp"))

    def parallel() -> None:
        loss = sx.vocab_parallel_cross_entropy(sx.Sharded(piece, split, (tokens, vocab)), ids)
        sx.collectives.count_once(loss, "tp", mesh=mesh).backward()

    def dense() -> None:
        F.cross_entropy(full, ids).backward()

    parallel()  # warm up both paths (first-call allocations are not the loss's)
    dense()
    piece.grad = full.grad = None
    ours = _peak_mib(parallel)
    piece.grad = None
    theirs = _peak_mib(dense)
    del i
    return ours, theirs


@pytest.mark.world_size(2)
def test_vocab_parallel_cross_entropy_needs_a_tp_th_of_the_memory():
    """On a 64k vocabulary (full logits 128 MiB), forward + backward of the
    vocab-parallel loss on tp=2 peaks at about half of the dense loss's."""
    for ours, theirs in run_ranks(cross_entropy_memory, 512, 65536, world_size=2):
        assert theirs > 200, theirs  # the dense loss holds several full-size tensors
        print(f"vocab-parallel {ours:.0f} MiB, dense {theirs:.0f} MiB")
        assert ours < 0.6 * theirs, (ours, theirs)


def train_ulysses(shape: dict[str, int], stage: int) -> tuple[list[float], dict, list[str]]:
    mesh = sx.Mesh(shape)
    rules = sx.rules.ulysses("sp")
    if "dp" in shape:
        rules = rules + sx.rules.zero(stage, "dp")
    model, params = gpt_params(mesh, rules)

    def loss_fn(p, x, y):
        logits = sx.apply(model, p, x, rules=rules)  # [B, T, V]: the whole sequence's
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    batches = [batch(step) for step in range(STEPS)]
    losses, params, ops = adamw_steps(params, loss_fn, batches, mesh, (LR, BETAS, EPS, WD))
    return losses, sx.gather(params), ops


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("shape", "stage"),
    [
        pytest.param({"sp": 2}, 0, id="sp2"),
        pytest.param({"dp": 2, "sp": 2}, 3, id="dp2xsp2-zero3", marks=pytest.mark.slow),
    ],
)
def test_ulysses_gpt_matches_pytorch(shape, stage):
    """Ulysses on the example GPT (causal SDPA): the sequence split over sp,
    all-to-alls around attention; losses and final params as on one process."""
    ref_losses, ref_params = reference()
    world = 2 if "dp" not in shape else 4
    for losses, params, ops in run_ranks(train_ulysses, shape, stage, world_size=world):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        for k, v in ref_params.items():
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-5, msg=k)
        assert "all_to_all over sp" in ops, ops


def test_rules_name_what_they_leave_replicated():
    """The check a user runs on new names: every large weight of the GPT is
    split over tp by rules.megatron; what stays whole is small."""
    with torch.device("meta"):
        model = GPT(CFG)
    params = sx.params_of(model)
    mesh = sx.AbstractMesh({"tp": 2})
    whole = sx.rules.megatron("tp").replicated(params, mesh, "tp")
    assert {p for p, _, _ in whole} == {
        "wpe.weight",
        *(
            f"blocks.{i}.{n}"
            for i in range(2)
            for n in (
                "ln_1.weight",
                "ln_1.bias",
                "ln_2.weight",
                "ln_2.bias",
                "attn.proj.bias",
                "mlp.proj.bias",
            )
        ),
        "ln_f.weight",
        "ln_f.bias",
    }
    missed = sx.rules.megatron(
        "tp", names=sx.rules.TransformerNames(column="nothing", row="nothing")
    )
    whole = missed.replicated(params, mesh, "tp")
    assert whole[0] == ("blocks.0.mlp.fc.weight", (64, 16), 64 * 16 * 4)  # largest first
    assert ("wte.weight", (CFG.vocab_size, CFG.d_model), CFG.vocab_size * CFG.d_model * 4) in whole


def test_packed_tensors_are_split_block_by_block():
    """``blocks``: a [d, 3·d] q|k|v weight split block by block gives each
    rank its part of q, of k and of v and keeps its shape; ``apply`` hands
    the module that piece as it is; an activation Relayout moves blocks
    too; a block count that does not divide the dim is an error naming it."""
    rule = sx.Rule("qkv", sx.P(None, sx.blocks(3, "tp")))
    assert eval(repr(rule), {"Rule": sx.Rule, "P": sx.P, "blocks": sx.blocks}) == rule
    mesh = sx.AbstractMesh({"tp": 2})
    layout = sx.Layout(mesh, sx.Rules(rule).spec_for("qkv", (4, 12), mesh))
    assert layout.local_shape((4, 12), 1) == (4, 6)
    assert layout.local_boxes((4, 12), 1) == [((0, 2), (4, 2)), ((0, 6), (4, 2)), ((0, 10), (4, 2))]
    w = torch.arange(48.0).reshape(4, 12)
    piece = torch.cat(
        [view for _, _, view in layout.box_views(w[:, [2, 3, 6, 7, 10, 11]], (4, 12), 1)], 1
    )
    assert torch.equal(piece, w[:, [2, 3, 6, 7, 10, 11]])

    live = sx.Mesh({"tp": 1})
    linear = torch.nn.Linear(4, 12, bias=False)  # weight [12, 4]: blocks on dim 0
    params = sx.shard(
        {"weight": linear.weight.detach()}, live, sx.Rule("weight", sx.P(sx.blocks(3, "tp")))
    )
    assert params["weight"].shape == (12, 4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(sx.apply(linear, params, x), linear(x))
    with pytest.raises(sx.ShardingError, match=r"params\['weight'\] has shape \(5, 4\)"):
        sx.apply(linear, sx.shard({"weight": torch.zeros(5, 4)}, live, sx.P()), x)
    with pytest.raises(
        sx.ShardingError, match=r"dim 1 \(size 13\) of shape \(4, 13\) cannot be 3 equal blocks"
    ):
        sx.Rules(rule).spec_for("qkv", (4, 13), mesh)
    with pytest.raises(sx.ShardingError, match="a positive whole number of blocks"):
        sx.blocks(0, "tp")

    to_heads = sx.rules.Relayout(sx.P(), sx.P(None, sx.blocks(3, "tp")))
    assert torch.equal(to_heads(w, live), w)  # one rank: every block whole
    with pytest.raises(sx.ShardingError, match=r"a dim of 13 cannot be 3 equal blocks"):
        to_heads(torch.zeros(4, 13), live)


def test_params_carry_their_module_rules_and_one_set_at_a_time():
    mesh = sx.Mesh({"tp": 1})
    rules = sx.rules.megatron("tp")
    model, params = gpt_params(mesh, rules)
    assert params["blocks.0.mlp.proj.weight"].placement.modules == rules.modules
    x, _ = batch(0)
    torch.testing.assert_close(sx.apply(model, params, x), sx.apply(model, params, x, rules=rules))
    other = sx.init_params(model, mesh, sx.rules.megatron("tp", sequence_parallel=True))
    mixed = {**params, "blocks.1.mlp.proj.weight": other["blocks.1.mlp.proj.weight"]}
    with pytest.raises(sx.ShardingError, match=r"placed by rules with different module rules"):
        sx.apply(model, mixed, x)
    sx.apply(model, mixed, x, rules=rules)  # rules= says which


def test_local_sizes_needs_divisible_integer_attributes():
    class Split(torch.nn.Module):
        width = 3

        def forward(self, x):
            return x.split(self.width, dim=-1)[0]

    forward = sx.local_sizes("tp", "width")
    module = Split()
    assert forward(module, sx.Mesh({"tp": 1}), torch.arange(6.0)).shape == (3,)
    assert "width" not in module.__dict__  # the class attribute is back
    with pytest.raises(sx.ShardingError, match=r"Split\.missing is None"):
        sx.local_sizes("tp", "missing")(module, sx.Mesh({"tp": 1}), torch.zeros(2))
    with pytest.raises(sx.ShardingError, match="needs attribute names"):
        sx.local_sizes("tp")
    with pytest.raises(sx.ShardingError, match="give attention="):
        sx.rules.TransformerNames(column="a", row="b", attention_sizes=("split_size",))
