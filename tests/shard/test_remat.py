"""Activation checkpointing: ``rules.remat`` under ZeRO-3 and under
Megatron with dropout, on real ranks, gives the plain run's losses and
parameters over 5 AdamW steps (the recomputation regathers the blocks'
parameters and replays their dropout masks) and does recompute — each
rematerialised block runs twice a step; ``sx.remat`` on a plain function;
what a recomputation could not replay is refused by name."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _dropout import NAMES, Net
from _tiny import VOCAB, gpt2
from torch.utils._python_dispatch import TorchDispatchMode

import shardax as sx

POLICIES = [
    ("save_nothing", (), 1),
    ("save_matmuls", (), 1),
    ("save_names", ("attn",), 1),
    ("save_nothing", (), 2),  # every other block: h.0 only
    ("offload_names", ("attn",), 1),  # kept in files
]


def _hf_loss(model, p, x):
    return sx.apply(model, p, x, labels=x, use_cache=False).loss


def _net_loss(model, p, x):
    logits = sx.apply(model, p, x)  # whole: the head's output gathered over tp
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def _train(model, mesh, rules, batches, data_axis, block_paths, loss, probe):
    """5 AdamW steps of ``loss(model, params, tokens)``; ``(losses,
    gathered params, calls per step of each block's first module probe)``
    (a block's own hooks run once: only its forward is recomputed, and that
    only as far as backward needs)."""
    calls = dict.fromkeys(block_paths, 0)
    hooks = [
        model.get_submodule(f"{p}.{probe}").register_forward_hook(
            lambda *_, p=p: calls.__setitem__(p, calls[p] + 1)
        )
        for p in block_paths
    ]
    params = sx.shard(sx.params_of(model), mesh, rules)
    opt = sx.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    n = mesh.size(data_axis) if data_axis else 1
    me = mesh.axis_index(data_axis) if data_axis else 0
    losses = []
    for step, x in enumerate(batches):
        mine = x[me * len(x) // n : (me + 1) * len(x) // n]
        sx.manual_seed(step, mesh, vary=data_axis or ())

        value, grads = sx.value_and_grad(lambda p, x: loss(model, p, x))(params, mine)
        params, state = sx.optim.step(opt, grads, state, params)
        losses.append(value.item())
    for h in hooks:
        h.remove()
    gathered = {k: sx.gather(v) if isinstance(v, sx.Sharded) else v for k, v in params.items()}
    return losses, gathered, {p: c / len(batches) for p, c in calls.items()}


def _zero3(policy, names, every, folder):
    mesh = sx.Mesh({"dp": 2})
    kind = f"disk:{folder}/{mesh.axis_index('dp')}" if policy == "offload_names" else "host"
    batches = torch.randint(0, VOCAB, (5, 4, 8), generator=torch.Generator().manual_seed(1))
    blocks = ["transformer.h.0", "transformer.h.1"]
    runs = []
    for remat in (False, True):
        torch.manual_seed(0)
        model = gpt2(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
        rules = sx.rules.zero(3, "dp")
        if remat:
            rules += sx.rules.remat(
                r"transformer\.h\.\d+", policy, names=names, every=every, kind=kind
            )
        runs.append(_train(model, mesh, rules, batches, "dp", blocks, _hf_loss, "ln_1"))
    return runs


@pytest.mark.parametrize(("policy", "names", "every"), POLICIES)
def test_remat_under_zero3_matches_the_plain_run(tmp_path, policy, names, every):
    """Hugging Face GPT-2 with dropout everywhere, ZeRO-3 over dp=2."""
    for plain, remat in run_ranks(_zero3, policy, names, every, str(tmp_path)):
        torch.testing.assert_close(remat[0], plain[0], rtol=1e-6, atol=1e-6)
        for k, v in plain[1].items():
            torch.testing.assert_close(remat[1][k], v, rtol=1e-6, atol=1e-6, msg=k)
        assert plain[2] == {"transformer.h.0": 1, "transformer.h.1": 1}
        # a rematerialised block runs again in backward
        assert remat[2] == {"transformer.h.0": 2, "transformer.h.1": 2 if every == 1 else 1}


def _megatron(policy):
    mesh = sx.Mesh({"tp": 2})
    batches = torch.randint(0, 16, (5, 4, 6), generator=torch.Generator().manual_seed(2))
    runs = []
    for remat in (False, True):
        torch.manual_seed(0)
        model = Net()
        rules = sx.rules.megatron("tp", names=NAMES)
        if remat:
            rules += sx.rules.remat(r"blocks\.\d+", policy)
        runs.append(
            _train(model, mesh, rules, batches, None, ["blocks.0", "blocks.1"], _net_loss, "mlp.fc")
        )
    return runs


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls"])
def test_remat_under_megatron_replays_each_regions_dropout(policy):
    """tp=2: the blocks' MLPs draw per-tp-rank masks inside their regions
    and shared ones after the row-parallel sum; the recomputation draws the
    same."""
    for plain, remat in run_ranks(_megatron, policy):
        torch.testing.assert_close(remat[0], plain[0], rtol=1e-6, atol=1e-6)
        for k, v in plain[1].items():
            torch.testing.assert_close(remat[1][k], v, rtol=1e-6, atol=1e-6, msg=k)
        assert remat[2] == {"blocks.0": 2, "blocks.1": 2}


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls", "save_names", "offload_names"])
def test_remat_of_a_function_replays_dropout(tmp_path, policy):
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)
    )
    x = torch.randn(6, 4)
    grads = []
    names = ("0",) if policy.endswith("_names") else ()
    kind = f"disk:{tmp_path}" if policy == "offload_names" else "host"
    for fn in (net, sx.remat(net, policy, names=names, kind=kind)):
        torch.manual_seed(3)
        fn(x).square().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        net.zero_grad()
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_what_the_policies_keep():
    """A kept fused attention with dropout (the CUDA kernels) would not run
    again in the recomputation, and each draw after it would differ; one
    without dropout is kept, by every policy that keeps computations. A
    collective is never kept: it runs again on every rank alike."""
    from shardax.shard._keep import save_matmuls, takes_part

    aten = torch.ops.aten
    q = torch.zeros(1, 1, 2, 2)
    for op, args, kwargs in (
        (aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.1), {}),
        (aten._scaled_dot_product_efficient_attention.default, (q, q, q, None, True),
         {"dropout_p": 0.1}),
        (aten.native_dropout.default, (q, 0.1, True), {}),
        (torch.ops.c10d.allreduce_.default, (), {}),
        (torch.ops._c10d_functional.all_reduce.default, (q, "sum", "0"), {}),
    ):  # fmt: skip
        assert not save_matmuls(op, args, kwargs) and not takes_part(op, args, kwargs)
    for op, args in (
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q)),
        (aten._scaled_dot_product_flash_attention.default, (q, q, q, 0.0)),
        (aten.mm.default, (q[0, 0], q[0, 0])),
    ):
        assert save_matmuls(op, args, {}) and takes_part(op, args, {})


class _Counting(TorchDispatchMode):
    """Counts the linear layers' products that run (forward: ``addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.products += func is torch.ops.aten.addmm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("policy", "recomputed"),
    [("save_nothing", 2), ("save_names", 0), ("offload_names", 0), ("offload_names-disk", 0)],
)
def test_offload_names_keeps_the_named_work_elsewhere(tmp_path, policy, recomputed):
    """``attn``'s two products are not run again in backward (save_nothing
    runs them again; the recomputation stops before ``mlp``'s, which
    backward does not need), their outputs kept in host memory or in files:
    a folder where no file can be made fails the forward, by name."""
    block = torch.nn.Module()
    block.attn = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    block.mlp = torch.nn.Linear(4, 4)
    block.forward = lambda x: block.mlp(torch.relu(block.attn(x))) + x
    policy, _, disk = policy.partition("-")
    kind = f"disk:{tmp_path}" if disk else "host"
    names = ("attn",) if policy != "save_nothing" else ()
    y = sx.remat(block, policy, names=names, kind=kind)(torch.randn(3, 4, requires_grad=True))
    with _Counting() as counting:
        y.sum().backward()
    assert counting.products == recomputed
    if disk:
        bad = sx.remat(block, policy, names=names, kind="disk:/proc/shardax-no-files")
        with pytest.raises(sx.ShardingError, match="cannot create a file there"):
            bad(torch.randn(3, 4, requires_grad=True))


class _Switching(torch.nn.Module):
    """Its ``attn`` reads a flag the caller flips between forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.attn.register_forward_pre_hook(
            lambda _, args: (torch.cat([args[0], args[0]]),) if self.wide else args
        )
        self.wide = False

    def forward(self, x):
        return torch.tanh(self.attn(x)).sum(0)


def test_a_recomputation_that_runs_differently_is_refused(tmp_path):
    """offload_names hands back each kept output by its call's place in the
    forward: a region that runs differently in backward is an error naming
    the call, not another call's values."""
    block = _Switching()
    y = sx.remat(block, "offload_names", names=("attn",), kind=f"disk:{tmp_path}")(
        torch.randn(3, 4, requires_grad=True)
    )
    block.wide = True
    with pytest.raises(sx.ShardingError, match=r"kept op 0 is aten.addmm.default of .*\(6, 4\)"):
        y.sum().backward()


class _Counted(torch.nn.Module):
    """A statistic of its input, once per forward (``recomputing()``)."""

    def __init__(self, hidden: bool) -> None:
        super().__init__()
        self.lin1, self.lin2, self.hidden = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), hidden

    def forward(self, x):
        if not sx.recomputing():
            with sx.uncounted() if self.hidden else contextlib.nullcontext():
                self.stat = torch.sigmoid(x).mean().item()
        return self.lin2(torch.sigmoid(self.lin1(x)))


@pytest.mark.parametrize("policy", ["save_names", "offload_names"])
def test_forward_only_code_runs_uncounted_or_is_refused(tmp_path, policy):
    """Ops that run only in the forward would shift the kept outputs onto
    other calls (same shapes: the same sigmoid): under ``uncounted`` they
    are not kept, and the gradients are exact; outside it, refused."""
    kind = f"disk:{tmp_path}" if policy == "offload_names" else "host"
    x = torch.randn(3, 4)
    for hidden in (True, False):
        torch.manual_seed(0)
        block = torch.nn.Module()
        block.attn = _Counted(hidden)
        block.forward = lambda x, block=block: block.attn(x) * 2
        grads = []
        for fn in (block.forward, sx.remat(block, policy, names="attn", kind=kind)):
            block.zero_grad()
            try:
                fn(x).square().sum().backward()
            except sx.ShardingError as err:
                assert not hidden and "recomputing() — runs ops the policy keeps" in str(err)
                break
            grads.append([p.grad.clone() for p in block.parameters()])
        else:
            assert hidden
            for a, b in zip(*grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["save_nothing", "save_matmuls", "offload_names"])
def test_a_second_backward_through_a_region(tmp_path, policy):
    """``retain_graph``: the recomputation runs again, from the start — the
    kept outputs it handed back are computed again, the rest handed back."""
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.attn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    block.forward = lambda x: torch.relu(block.attn(x))
    names = ("attn",) if policy == "offload_names" else ()
    kind = f"disk:{tmp_path}" if policy == "offload_names" else "host"
    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(block.forward(x).sum(), [x, *block.parameters()])
    y = sx.remat(block, policy, names=names, kind=kind)(x)
    first = torch.autograd.grad(y.sum(), [x], retain_graph=True)
    second = torch.autograd.grad(y.sum(), [x, *block.parameters()])
    torch.testing.assert_close(first[0], want[0], rtol=0, atol=0)
    for a, b in zip(second, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Doubling(torch.nn.Module):
    """Changes its linear's output in place after the linear made it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.attn(x)
        h.mul_(2)
        return torch.tanh(h)


@pytest.mark.parametrize("policy", ["save_matmuls", "save_names", "offload_names"])
def test_a_kept_output_changed_in_place_is_refused_or_copied(tmp_path, policy):
    """Kept where it is (on the device), the recomputation would double it
    again: refused, by name. Kept as a copy (offload_names), exact."""
    x = torch.randn(3, 4)
    block = _Doubling()
    want = torch.autograd.grad(block(x).sum(), list(block.parameters()))
    names = ("attn",) if policy != "save_matmuls" else ()
    kind = f"disk:{tmp_path}" if policy == "offload_names" else "host"
    y = sx.remat(block, policy, names=names, kind=kind)(x)
    if policy == "offload_names":
        got = torch.autograd.grad(y.sum(), list(block.parameters()))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        with pytest.raises(sx.ShardingError, match=r"addmm.default that the policy keeps was chan"):
            y.sum().backward()


class _Twice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        for block in self.blocks:
            block.attn = torch.nn.Linear(8, 8)
            block.forward = lambda x, b=block: torch.tanh(b.attn(torch.tanh(b.attn(x)))) + x

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.float().square().mean()


@pytest.mark.parametrize(
    ("policy", "names"),
    [("save_nothing", ()), ("save_matmuls", ()), ("save_names", ("attn",)),
     ("offload_names", ("attn",))],
)  # fmt: skip
def test_remat_under_autocast_with_a_weight_used_twice(policy, names):
    """ZeRO-3 under bf16 autocast: the forward's parameters are lifted (not
    leaves: cast at each use), and so are the recomputation's — the same
    casts, in the same order."""
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(4, 8)
    mesh = sx.Mesh({"dp": 1})
    grads = []
    for extra in (sx.rules.Rules(), sx.rules.remat(r"blocks\.\d+", policy, names=names)):
        params = sx.shard(sx.params_of(model), mesh, sx.rules.zero(3, "dp") + extra)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, g = sx.value_and_grad(lambda p: sx.apply(model, p, x))(params)
        grads.append({k: sx.gather(v) for k, v in g.items()})
    for k, v in grads[0].items():
        torch.testing.assert_close(grads[1][k], v, rtol=0, atol=0, msg=k)


class _Cached(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x, past_key_values=None, cache=None):
        return self.lin(x) + (0 if cache is None else cache), past_key_values


def test_remat_leaves_out_only_a_key_value_cache():
    """Hugging Face's cache is dropped, with a warning (the recomputation
    would fill it twice); an argument that merely is named ``cache`` stays."""
    layer, x = _Cached(), torch.ones(1, 2)
    with pytest.warns(UserWarning, match=r"key/value cache \(past_key_values\)"):
        _, past = sx.remat(layer)(x, past_key_values=[1])
    assert past is None
    y, _ = sx.remat(layer)(x, cache=torch.full((2,), 5.0))
    torch.testing.assert_close(y, layer.lin(x) + 5.0)


def _refusals():
    mesh = sx.Mesh({"tp": 2})
    model = Net()
    x = torch.zeros(2, 3, dtype=torch.long)
    errors = []
    for extra in (
        sx.rules.remat(r"blocks\.\d+") + sx.rules.remat(r"blocks\.\d+\.mlp"),  # nested
        sx.rules.remat(r"blocks\.\d+\.mlp"),  # the forked region itself: its rejoin inside
    ):
        params = sx.shard(sx.params_of(model), mesh, sx.rules.megatron("tp", names=NAMES) + extra)
        try:
            sx.value_and_grad(lambda p: sx.apply(model, p, x).sum())(params)
        except sx.ShardingError as err:
            errors.append(str(err))
    return errors


def test_what_a_recomputation_could_not_replay_is_refused():
    nested, rejoin = run_ranks(_refusals)[0]
    assert "'blocks.0.mlp' is rematerialised inside 'blocks.0', which is too" in nested
    assert "'blocks.0.mlp' holds 'blocks.0.mlp.proj', which rejoins" in rejoin


class _RematInside(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sx.remat(self.lin)(x)


def test_remat_inside_apply_points_to_the_rule():
    """Its recomputation would run after apply put the model's own
    parameters back: silently the wrong weights."""
    model = _RematInside()
    params = sx.shard(sx.params_of(model), sx.Mesh({"dp": 1}), sx.rules.zero(3))
    assert sx.remat(model)(torch.ones(1, 2)).shape == (1, 2)  # outside apply: fine
    with pytest.raises(
        sx.ShardingError, match=r"remat\(Linear\) inside shardax.apply.*rules.remat"
    ):
        sx.value_and_grad(lambda p: sx.apply(model, p, torch.ones(1, 2)).sum())(params)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: sx.Remat("save_all"),
            r"policy is one of save_nothing, save_matmuls, save_names, offload_names",
        ),
        (lambda: sx.Remat("save_names"), r"'save_names' keeps .* none given"),
        (lambda: sx.Remat(names=("attn",)), r"names=\('attn',\) are for policies 'save_names' and"),
        (lambda: sx.Remat(kind="disk:/x"), r"kind= says where policy 'offload_names' keeps what"),
        (
            lambda: sx.Remat("save_names", names="a", kind="device"),
            r"got kind='device' with policy",
        ),
        (
            lambda: sx.Remat("offload_names", names="attn", kind="device"),
            r"off the device: kind='host' .* or 'disk:PATH'; for the device, policy 'save_names'",
        ),
        (lambda: sx.Remat("offload_names", names="attn", kind="nvme"), r"'disk:PATH'.*got 'nvme'"),
        (lambda: sx.Remat(every=0), r"every is a positive number of modules; got 0"),
        (lambda: sx.Remat("save_names", names=("(",)), r"names are regexes"),
        (
            lambda: sx.remat(torch.nn.Linear(2, 2), "save_names", names=("attn",))(
                torch.ones(1, 2, requires_grad=True)
            ),
            r"match none of Linear's submodules \(it has none\)",
        ),
    ],
)
def test_bad_remat_settings_are_named(call, match):
    with pytest.raises(sx.ShardingError, match=match):
        call()
