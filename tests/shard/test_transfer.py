"""``transfer`` on real ranks: every pair of layouts on a 2×2 mesh equals the
dense reference, forward and backward (the VJP of a transfer is the identity
on global values, represented in the dual layouts), for even, uneven and
empty shards; between meshes; and the psum-transpose pitfall."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist import run_ranks
from _layouts import all_layouts, assemble, blocked_layouts, integer_tensor, represent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardax as sx
from shardax import Layout, P
from shardax import collectives as C
from shardax.shard._packing import DIRECT_BYTES as _DEFAULT_DIRECT

SHAPES = [(4, 6), (5, 3), (1, 3)]  # even; uneven; mostly empty shards


def _layouts_for(mesh: sx.AbstractMesh, shape: tuple[int, ...], blocked: bool) -> list[Layout]:
    plain = all_layouts(mesh, len(shape))
    return blocked_layouts(mesh) + plain if blocked else plain


def _pairs(mesh_shape: dict[str, int], shape: tuple[int, ...], blocked: bool = False) -> dict:
    mesh = sx.Mesh(mesh_shape)
    layouts = _layouts_for(mesh, shape, blocked)
    x_dense, g_dense = integer_tensor(shape, 1), integer_tensor(shape, 2)
    out = {}
    for i, src in enumerate(layouts):
        for j, dst in enumerate(layouts):
            x = sx.Sharded(represent(x_dense, src, mesh.rank, seed=i).requires_grad_(), src, shape)
            y = sx.transfer(x, dst)
            assert y.layout == dst and y.shape == shape
            y.local.backward(represent(g_dense, dst.dual(), mesh.rank, seed=j))
            out[(i, j)] = (y.local.detach().clone(), x.local.grad.clone())
    return out


@pytest.mark.parametrize(
    ("world_size", "mesh_shape"),
    [(1, {"x": 1, "y": 1}), (2, {"x": 2}), (4, {"x": 2, "y": 2})],
    ids=["ws1", "ws2", "ws4-2x2"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_layout_pair_matches_dense(world_size, mesh_shape, shape):
    _check_pairs(world_size, mesh_shape, shape, blocked=False)


def _check_pairs(world_size: int, mesh_shape: dict, shape: tuple[int, ...], blocked: bool) -> None:
    """Every pair's result and gradient, assembled from the ranks, equal the dense ones."""
    results = run_ranks(_pairs, mesh_shape, shape, blocked, world_size=world_size)
    layouts = _layouts_for(sx.AbstractMesh(mesh_shape), shape, blocked)
    x_dense, g_dense = integer_tensor(shape, 1), integer_tensor(shape, 2)
    assert len(results[0]) == len(layouts) ** 2
    for (i, j), _ in results[0].items():
        src, dst = layouts[i], layouts[j]
        y = assemble([r[(i, j)][0] for r in results], dst, shape)
        g = assemble([r[(i, j)][1] for r in results], src.dual(), shape)
        torch.testing.assert_close(y, x_dense, rtol=0, atol=0, msg=f"forward {src} -> {dst}")
        torch.testing.assert_close(g, g_dense, rtol=0, atol=0, msg=f"backward {src} -> {dst}")


@pytest.mark.world_size(4)
@pytest.mark.parametrize(
    ("world_size", "mesh_shape"),
    [
        pytest.param(2, {"x": 2, "y": 1}, id="ws2"),
        pytest.param(4, {"x": 2, "y": 2}, id="ws4", marks=pytest.mark.slow),  # ws2's 2-D mesh
    ],
)
def test_blocked_layouts_to_and_from_every_layout_match_dense(world_size, mesh_shape):
    """A dim of equal blocks split block by block (``blocks``): to and from
    every plain layout and each other, forward and backward, exact; the
    shape stays (6, 4) throughout (blocks of 2 split over 4 ranks: uneven,
    some empty)."""
    _check_pairs(world_size, mesh_shape, (6, 4), blocked=True)


def _batched(mesh_shape: dict, shape: tuple[int, ...], blocked: bool, direct_bytes: int) -> list:
    """Every layout pair at once, through the batched forms: ``transfer_many``
    (the gathers' form) and the ``Reducer`` (the reductions', with buckets
    small enough to fill while adding), next to ``transfer`` one by one."""
    from shardax.shard import _packing
    from shardax.shard._transfer import Reducer, transfer_many

    mesh = sx.Mesh(mesh_shape)
    layouts = _layouts_for(mesh, shape, blocked)
    x_dense = integer_tensor(shape, 1)
    items = [
        (sx.Sharded(represent(x_dense, src, mesh.rank, seed=i), src, shape), dst)
        for i, src in enumerate(layouts)
        for dst in layouts
    ]
    saved, _packing.DIRECT_BYTES = _packing.DIRECT_BYTES, direct_bytes
    try:
        one_by_one = [sx.transfer(x, dst).local for x, dst in items]
        batched = transfer_many(items).wait()
        reduced: list = [None] * len(items)
        reducer = Reducer(bucket_bytes=64)
        for k, (x, dst) in enumerate(items):
            reducer.add(x.local, x.layout, dst, shape, functools.partial(reduced.__setitem__, k))
        reducer.finish()
    finally:
        _packing.DIRECT_BYTES = saved
    return [(a, b, c) for a, b, c in zip(one_by_one, batched, reduced, strict=True)]


@pytest.mark.world_size(4)
@pytest.mark.parametrize("direct_bytes", [_DEFAULT_DIRECT, 0], ids=["packed", "direct"])
@pytest.mark.parametrize(
    ("world_size", "mesh_shape", "shape", "blocked"),
    [
        pytest.param(2, {"x": 2, "y": 1}, (6, 4), True, id="ws2-blocked"),
        pytest.param(4, {"x": 2, "y": 2}, (5, 3), False, id="ws4-uneven", marks=pytest.mark.slow),
    ],
)
def test_batched_transfers_equal_one_by_one(world_size, mesh_shape, shape, blocked, direct_bytes):
    """One executor: many leaves moved together — gathers fused into one
    collective, reductions packed in buckets, large even ones direct —
    give exactly what each leaf's own transfer gives."""
    results = run_ranks(_batched, mesh_shape, shape, blocked, direct_bytes, world_size=world_size)
    for rank, result in enumerate(results):
        for k, (alone, batched, reduced) in enumerate(result):
            msg = f"rank {rank}, pair {k}"
            torch.testing.assert_close(batched, alone, rtol=0, atol=0, msg=msg)
            torch.testing.assert_close(reduced, alone, rtol=0, atol=0, msg=msg)


def _mesh_cases(a, b, c) -> list[tuple[Layout, Layout]]:
    return [
        (Layout(a, P("x", "y")), Layout(b, P(None, "z"))),
        (Layout(a, P(("x", "y"))), Layout(b, P("z"))),
        (Layout(a, P("y"), partial="x"), Layout(c, P("x", "y"))),
        (Layout(b, P("z")), Layout(a, P(), partial=("x", "y"))),
        (Layout(c, P(None, "x")), Layout(a, P(None, "x"))),
    ]


def _between_meshes(shape: tuple[int, ...]) -> list:
    a = sx.Mesh({"x": 2, "y": 2})
    b = a.view({"z": 4})
    c = a.view({"y": 2, "x": 2})  # same names, other grid: a different mesh
    x_dense, g_dense = integer_tensor(shape, 3), integer_tensor(shape, 4)
    out = []
    for i, (src, dst) in enumerate(_mesh_cases(a, b, c)):
        x = sx.Sharded(represent(x_dense, src, a.rank, seed=i).requires_grad_(), src, shape)
        y = sx.transfer(x, dst)
        y.local.backward(represent(g_dense, dst.dual(), a.rank, seed=i + 7))
        out.append((y.local.detach().clone(), x.local.grad.clone()))
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("shape", [(4, 4), (5, 3)], ids=str)
def test_transfer_between_meshes_over_the_same_ranks(shape):
    results = run_ranks(_between_meshes, shape, world_size=4)
    abstract = [sx.AbstractMesh(m) for m in ({"x": 2, "y": 2}, {"z": 4}, {"y": 2, "x": 2})]
    cases = _mesh_cases(*abstract)
    x_dense, g_dense = integer_tensor(shape, 3), integer_tensor(shape, 4)
    for k, (src, dst) in enumerate(cases):
        y = assemble([r[k][0] for r in results], dst, shape)
        g = assemble([r[k][1] for r in results], src.dual(), shape)
        torch.testing.assert_close(y, x_dense, rtol=0, atol=0, msg=f"forward {src} -> {dst}")
        torch.testing.assert_close(g, g_dense, rtol=0, atol=0, msg=f"backward {src} -> {dst}")


def _replicated_loss_grads(w: torch.Tensor) -> dict:
    """Gradients of losses that every rank computes identically (replicated),
    through transfers and collectives: they equal the dense gradients, never
    the dense gradients times the axis size."""
    mesh = sx.Mesh({"dp": -1})
    out = {}
    # sharded -> replicated (all_gather; its transpose is psum_scatter), seeded once
    x = sx.shard(w, mesh, P("dp"))
    x.local.requires_grad_()
    loss = (sx.gather(x) ** 2).sum()
    C.count_once(loss, "dp", mesh=mesh).backward()
    out["gather"] = x.local.grad.clone()
    # the same, seeding through the loss's dual (partial) layout
    x = sx.shard(w, mesh, P("dp"))
    x.local.requires_grad_()
    loss = sx.Sharded((sx.transfer(x, P()).local ** 2).sum(), Layout(mesh), ())
    sx.transfer(loss, Layout(mesh, P(), partial="dp")).local.backward()
    out["dual"] = x.local.grad.clone()
    # partial -> replicated (psum; its transpose is psum): JAX issue 3970
    parts = represent(w, Layout(mesh, P(), partial="dp"), mesh.rank, seed=5).requires_grad_()
    z = sx.transfer(sx.Sharded(parts, Layout(mesh, P(), partial="dp"), tuple(w.shape)), P())
    C.count_once((z.local**2).sum(), "dp", mesh=mesh).backward()
    out["psum"] = parts.grad.clone()
    # data parallel: a replicated weight, different data per rank, the mean loss
    v = w.clone().requires_grad_()
    batch = integer_tensor((2, 5), 20 + mesh.rank)
    local_loss = (batch @ v).square().mean()
    C.count_once(C.pmean(local_loss, "dp", mesh=mesh), "dp", mesh=mesh).backward()
    out["dp"] = C.psum(v.grad, "dp", mesh=mesh)  # the data-parallel gradient reduction
    # replicated -> replicated is the identity: no psum of an identical value
    r = sx.shard(w, mesh, P())
    out["identity"] = sx.transfer(r, Layout(mesh, P())).local.clone()
    return out


@pytest.mark.world_size(2)
def test_gradients_are_never_scaled_by_the_axis_size():
    w = integer_tensor((5, 3), 9)
    results = run_ranks(_replicated_loss_grads, w, world_size=2)
    dense = 2 * w
    mesh = sx.AbstractMesh({"dp": 2})
    for key in ("gather", "dual"):
        got = assemble([r[key] for r in results], Layout(mesh, P("dp")), (5, 3))
        torch.testing.assert_close(got, dense, rtol=0, atol=0, msg=key)
    v = w.clone().requires_grad_()
    batches = [integer_tensor((2, 5), 20 + rank) for rank in range(2)]
    (sum((b @ v).square().mean() for b in batches) / 2).backward()
    for r in results:
        torch.testing.assert_close(r["psum"], dense, rtol=0, atol=0)
        torch.testing.assert_close(r["dp"], v.grad)
        torch.testing.assert_close(r["identity"], w, rtol=0, atol=0)


def test_transfer_rejects_dense_tensors_and_abstract_targets():
    mesh = sx.Mesh({"dp": 1})
    with pytest.raises(sx.ShardingError, match="transfer moves Sharded values"):
        sx.transfer(torch.ones(2), P())
    x = sx.shard(torch.ones(2), mesh, P())
    with pytest.raises(sx.ShardingError, match="live Mesh"):
        sx.transfer(x, Layout(sx.AbstractMesh({"dp": 1}), P("dp")))
    with pytest.raises(sx.ShardingError, match="has 2 entries but the tensor has shape"):
        sx.transfer(x, P("dp", None))


MESH3 = {"a": 2, "b": 1, "c": 2}
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _random_pairs(cases: list) -> list:
    """Transfers of 3-D tensors between given layouts on a 3-axis mesh (one
    axis of size 1), from non-contiguous local tensors, in several dtypes."""
    mesh = sx.Mesh(MESH3)
    layouts = all_layouts(mesh, 3)
    out = []
    for i, j, shape, dtype_index in cases:
        dtype = DTYPES[dtype_index]
        src, dst = layouts[i], layouts[j]
        x_dense = integer_tensor(shape, i + 13 * j, dtype)
        local = represent(x_dense, src, mesh.rank, seed=i)
        local = local.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
        if dtype.is_floating_point:
            local.requires_grad_()
        y = sx.transfer(sx.Sharded(local, src, shape), dst)
        grad = None
        if dtype.is_floating_point:
            g_dense = integer_tensor(shape, 7 * i + j, dtype)
            y.local.backward(represent(g_dense, dst.dual(), mesh.rank, seed=j))
            grad = local.grad.clone()
        out.append((y.local.detach().clone(), grad))
    return out


@pytest.mark.world_size(4)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(all_layouts(sx.AbstractMesh(MESH3), 3)) - 1),
            st.integers(0, len(all_layouts(sx.AbstractMesh(MESH3), 3)) - 1),
            st.tuples(st.integers(0, 5), st.integers(1, 4), st.integers(0, 3)),
            st.integers(0, len(DTYPES) - 1),
        ),
        min_size=10,
        max_size=10,
    )
)
def test_property_transfers_on_a_three_axis_mesh(cases):
    results = run_ranks(_random_pairs, cases, world_size=4)
    mesh = sx.AbstractMesh(MESH3)
    layouts = all_layouts(mesh, 3)
    for k, (i, j, shape, dtype_index) in enumerate(cases):
        dtype = DTYPES[dtype_index]
        src, dst = layouts[i], layouts[j]
        y = assemble([r[k][0] for r in results], dst, shape)
        torch.testing.assert_close(y, integer_tensor(shape, i + 13 * j, dtype), rtol=0, atol=0)
        if dtype.is_floating_point:
            g = assemble([r[k][1] for r in results], src.dual(), shape)
            torch.testing.assert_close(g, integer_tensor(shape, 7 * i + j, dtype), rtol=0, atol=0)
