"""Layouts for tests: enumerate them, represent a dense tensor in one (with
random partial splits), and assemble ranks' pieces back into the dense tensor."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from shardax import Layout, P, blocks
from shardax.mesh import AbstractMesh
from shardax.shard._sharded import local_piece


def all_layouts(mesh: AbstractMesh, ndim: int) -> list[Layout]:
    """Every layout of an ``ndim`` tensor: each axis replicated, partial, or
    splitting some dim (every order of axes on a dim)."""
    out = []
    names = mesh.axis_names
    for choice in itertools.product(["rep", "partial", *range(ndim)], repeat=len(names)):
        partial = [a for a, c in zip(names, choice, strict=True) if c == "partial"]
        per_dim = [[a for a, c in zip(names, choice, strict=True) if c == d] for d in range(ndim)]
        for orders in itertools.product(*[list(itertools.permutations(axes)) for axes in per_dim]):
            out.append(Layout(mesh, P.from_dim_axes(orders), partial=partial))
    return out


def integer_tensor(
    shape: Sequence[int], seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)


def represent(x: torch.Tensor, layout: Layout, rank: int, seed: int = 0) -> torch.Tensor:
    """``rank``'s local tensor for dense ``x`` under ``layout``: its piece, split
    over the partial axes into random integer parts that sum to it."""
    piece = local_piece(x, layout, rank).clone()
    if not layout.partial:
        return piece
    mesh = layout.mesh
    n = mesh.size(layout.partial)
    k = mesh.axis_index(layout.partial, rank)

    def noise(i: int) -> torch.Tensor:
        return integer_tensor(piece.shape, seed * 1009 + i, x.dtype)

    if k:
        return noise(k)
    return piece - sum((noise(i) for i in range(1, n)), torch.zeros_like(piece))


def assemble(pieces: Sequence[torch.Tensor], layout: Layout, shape: Sequence[int]) -> torch.Tensor:
    """The dense tensor that ranks' ``pieces`` represent under ``layout``
    (partial parts summed); checks replicas agree."""
    mesh = layout.mesh
    out = torch.zeros(tuple(shape), dtype=pieces[0].dtype)
    first: dict[tuple, torch.Tensor] = {}
    for rank, piece in enumerate(pieces):
        local = layout.local_shape(shape, rank)
        assert tuple(piece.shape) == local, (rank, piece.shape, local, layout)
        boxes = layout.box_views(piece, shape, rank)  # one, or one per block of a blocked dim
        coords = mesh.coords(rank)
        key = (tuple((o, n) for o, n, _ in boxes), tuple(coords[a] for a in layout.partial))
        if key in first:
            torch.testing.assert_close(
                piece, first[key], rtol=0, atol=0, msg=f"replicas differ: rank {rank} {layout}"
            )
            continue
        first[key] = piece
        for offsets, sizes, view in boxes:
            out[tuple(slice(a, a + n) for a, n in zip(offsets, sizes, strict=True))] += view
    return out


def blocked_layouts(mesh: AbstractMesh) -> list[Layout]:
    """Layouts of a 2-d tensor with a blocked dim (dim 0: 3 or 2 blocks, dim
    1: 2), the other axes replicated, partial or splitting the other dim."""
    x, y = mesh.axis_names
    return [
        Layout(mesh, P(blocks(3, x))),
        Layout(mesh, P(blocks(3, x, y))),
        Layout(mesh, P(blocks(2, y), x)),
        Layout(mesh, P(blocks(3, x)), partial=y),
        Layout(mesh, P(None, blocks(2, x))),
        Layout(mesh, P(y, blocks(2, x))),
        Layout(mesh, P(None, blocks(2, y, x))),
    ]


@st.composite
def dims_and_shape(
    draw, names: Sequence[str], max_len: int = 9
) -> tuple[list[tuple[str, ...]], tuple[int, ...]]:
    """A random split of ``names`` over 1-3 dims (some axes unused, any
    order), and a shape with possibly empty dims."""
    ndim = draw(st.integers(1, 3))
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for a in draw(st.permutations(list(names))):
        d = draw(st.integers(-1, ndim - 1))
        if d >= 0:
            dims[d].append(a)
    shape = tuple(draw(st.integers(0, max_len)) for _ in range(ndim))
    return [tuple(d) for d in dims], shape
