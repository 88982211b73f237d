"""``transfer`` on real ranks: every pair of layouts on a 2×2 mesh equals the
dense reference, forward and backward (the VJP of a transfer is the identity
on global values, represented in the dual layouts), for even, uneven and
empty shards; between meshes; and the psum-transpose pitfall."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _layouts import all_layouts, assemble, integer_tensor, represent

import shardax as sx
from shardax import Layout, P

SHAPES = [(4, 6), (5, 3), (1, 3)]  # even; uneven; mostly empty shards


def _pairs(mesh_shape: dict[str, int], shape: tuple[int, ...]) -> dict:
    mesh = sx.Mesh(mesh_shape)
    layouts = all_layouts(mesh, len(shape))
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
    results = run_ranks(_pairs, mesh_shape, shape, world_size=world_size)
    mesh = sx.AbstractMesh(mesh_shape)
    layouts = all_layouts(mesh, len(shape))
    x_dense, g_dense = integer_tensor(shape, 1), integer_tensor(shape, 2)
    assert len(results[0]) == len(layouts) ** 2
    for (i, j), _ in results[0].items():
        src, dst = layouts[i], layouts[j]
        y = assemble([r[(i, j)][0] for r in results], dst, shape)
        g = assemble([r[(i, j)][1] for r in results], src.dual(), shape)
        torch.testing.assert_close(y, x_dense, rtol=0, atol=0, msg=f"forward {src} -> {dst}")
        torch.testing.assert_close(g, g_dense, rtol=0, atol=0, msg=f"backward {src} -> {dst}")


def _between_meshes(shape: tuple[int, ...]) -> list:
    a = sx.Mesh({"x": 2, "y": 2})
    b = a.view({"z": 4})
    c = a.view({"y": 2, "x": 2})  # same names, other grid: a different mesh
    x_dense, g_dense = integer_tensor(shape, 3), integer_tensor(shape, 4)
    cases = [
        (Layout(a, P("x", "y")), Layout(b, P(None, "z"))),
        (Layout(a, P(("x", "y"))), Layout(b, P("z"))),
        (Layout(a, P("y"), partial="x"), Layout(c, P("x", "y"))),
        (Layout(b, P("z")), Layout(a, P(), partial=("x", "y"))),
        (Layout(c, P(None, "x")), Layout(a, P(None, "x"))),
    ]
    out = []
    for i, (src, dst) in enumerate(cases):
        x = sx.Sharded(represent(x_dense, src, a.rank, seed=i).requires_grad_(), src, shape)
        y = sx.transfer(x, dst)
        y.local.backward(represent(g_dense, dst.dual(), a.rank, seed=i + 7))
        out.append((y.local.detach().clone(), x.local.grad.clone()))
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("shape", [(4, 4), (5, 3)], ids=str)
def test_transfer_between_meshes_over_the_same_ranks(shape):
    results = run_ranks(_between_meshes, shape, world_size=4)
    a = sx.AbstractMesh({"x": 2, "y": 2})
    b, c = sx.AbstractMesh({"z": 4}), sx.AbstractMesh({"y": 2, "x": 2})
    cases = [
        (Layout(a, P("x", "y")), Layout(b, P(None, "z"))),
        (Layout(a, P(("x", "y"))), Layout(b, P("z"))),
        (Layout(a, P("y"), partial="x"), Layout(c, P("x", "y"))),
        (Layout(b, P("z")), Layout(a, P(), partial=("x", "y"))),
        (Layout(c, P(None, "x")), Layout(a, P(None, "x"))),
    ]
    x_dense, g_dense = integer_tensor(shape, 3), integer_tensor(shape, 4)
    for k, (src, dst) in enumerate(cases):
        y = assemble([r[k][0] for r in results], dst, shape)
        g = assemble([r[k][1] for r in results], src.dual(), shape)
        torch.testing.assert_close(y, x_dense, rtol=0, atol=0, msg=f"forward {src} -> {dst}")
        torch.testing.assert_close(g, g_dense, rtol=0, atol=0, msg=f"backward {src} -> {dst}")


def _replicated_loss_grads(w: torch.Tensor) -> dict:
    """Gradients of a loss every rank computes identically (replicated),
    seeded through its dual (partial) layout: they must equal the dense
    gradients, not be multiplied by the axis size."""
    mesh = sx.Mesh({"dp": -1})
    out = {}
    # sharded -> replicated (all_gather; its transpose is psum_scatter)
    x = sx.shard(w, mesh, P("dp"))
    x.local.requires_grad_()
    y = sx.transfer(x, P())
    loss = sx.Sharded((y.local**2).sum(), Layout(mesh), ())
    sx.transfer(loss, Layout(mesh, P(), partial="dp")).local.backward()
    out["gather"] = x.local.grad.clone()
    # partial -> replicated (psum; its transpose is psum): JAX issue 3970
    parts = represent(w, Layout(mesh, P(), partial="dp"), mesh.rank, seed=5).requires_grad_()
    z = sx.transfer(sx.Sharded(parts, Layout(mesh, P(), partial="dp"), tuple(w.shape)), P())
    loss = sx.Sharded((z.local**2).sum(), Layout(mesh), ())
    sx.transfer(loss, Layout(mesh, P(), partial="dp")).local.backward()
    out["psum"] = parts.grad.clone()
    # replicated -> replicated is the identity: no psum of an identical value
    r = sx.shard(w, mesh, P())
    out["identity"] = sx.transfer(r, Layout(mesh, P())).local.clone()
    # the naive seed (1 on every rank of a replicated loss) is what scales by n
    x2 = sx.shard(w, mesh, P("dp"))
    x2.local.requires_grad_()
    (sx.transfer(x2, P()).local ** 2).sum().backward()
    out["naive"] = x2.local.grad.clone()
    return out


@pytest.mark.world_size(2)
def test_gradients_are_never_scaled_by_the_axis_size():
    w = integer_tensor((5, 3), 9)
    results = run_ranks(_replicated_loss_grads, w, world_size=2)
    dense = 2 * w
    mesh = sx.AbstractMesh({"dp": 2})
    got = assemble([r["gather"] for r in results], Layout(mesh, P("dp")), (5, 3))
    torch.testing.assert_close(got, dense, rtol=0, atol=0)
    for r in results:
        torch.testing.assert_close(r["psum"], dense, rtol=0, atol=0)
        torch.testing.assert_close(r["identity"], w, rtol=0, atol=0)
    naive = assemble([r["naive"] for r in results], Layout(mesh, P("dp")), (5, 3))
    torch.testing.assert_close(naive, 2 * dense)  # what seeding a replicated loss everywhere does


def test_transfer_rejects_dense_tensors_and_abstract_targets():
    mesh = sx.Mesh({"dp": 1})
    with pytest.raises(sx.ShardingError, match="transfer moves Sharded values"):
        sx.transfer(torch.ones(2), P())
    x = sx.shard(torch.ones(2), mesh, P())
    with pytest.raises(sx.ShardingError, match="live Mesh"):
        sx.transfer(x, Layout(sx.AbstractMesh({"dp": 1}), P("dp")))
    with pytest.raises(sx.ShardingError, match="has 2 entries but the tensor has shape"):
        sx.transfer(x, P("dp", None))
