"""Specs, named shardings and layouts: validation, chunk semantics, repr."""

from __future__ import annotations

import numpy as np
import pytest
from _layouts import dims_and_shape
from hypothesis import given, settings
from hypothesis import strategies as st

from shardax import AbstractMesh, Layout, NamedSharding, P, ShardingError

MESH = AbstractMesh({"dp": 2, "tp": 2})


def test_spec_entries_are_normalized():
    assert P(("dp",), None) == P("dp", None)
    assert P((), "tp") == P(None, "tp")
    assert P(["dp", "tp"]) == P(("dp", "tp"))
    assert P("dp").dim_axes(3) == (("dp",), (), ())
    assert P(("dp", "tp"), None).axes == ("dp", "tp")


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (("dp", ("tp", "dp")), "appears twice"),
        ((3,), "a spec entry is None, an axis name, a tuple of axis names or blocks"),
        ((("dp", 1),), "a spec entry is None"),
    ],
)
def test_bad_specs(entries, message):
    with pytest.raises(ShardingError, match=message):
        P(*entries)


def test_named_sharding_checks_axes_against_the_mesh():
    with pytest.raises(
        ShardingError,
        match=r"unknown mesh axis 'dq' in P\('dq'\).*has axes \('dp', 'tp'\).*did you mean 'dp'",
    ):
        NamedSharding(MESH, P("dq"))
    with pytest.raises(ShardingError, match="has 2 entries but the tensor has shape"):
        NamedSharding(MESH, P("dp", "tp")).shard_shape((8,))


@pytest.mark.parametrize(
    "value",
    [
        P(),
        P("dp", None),
        P(("dp", "tp"), None),
        NamedSharding(MESH, P(None, "tp")),
        Layout(MESH, P("dp"), partial="tp"),
        Layout(MESH),
    ],
    ids=repr,
)
def test_repr_rebuilds_the_value(value):
    env = {"P": P, "NamedSharding": NamedSharding, "Layout": Layout, "AbstractMesh": AbstractMesh}
    assert eval(repr(value), env) == value


def test_uneven_dims_follow_torch_chunk():
    s = NamedSharding(AbstractMesh({"x": 4}), P("x"))
    assert [s.local_shape((10,), r) for r in range(4)] == [(3,), (3,), (3,), (1,)]
    assert [s.local_shape((5,), r) for r in range(4)] == [(2,), (2,), (1,), (0,)]
    assert [s.local_shape((2,), r) for r in range(4)] == [(1,), (1,), (0,), (0,)]
    # two axes on one dim: chunk over the first, then each chunk over the second
    s2 = NamedSharding(AbstractMesh({"a": 2, "b": 2}), P(("a", "b")))
    assert [s2.local_bounds((5,), r) for r in range(4)] == [
        ((0, 2),),
        ((2, 3),),
        ((3, 4),),
        ((4, 5),),
    ]


def test_devices_indices_map_divisible_matches_jax_layout():
    # Golden values from jax 0.10.2 (NamedSharding.devices_indices_map on 8 CPU devices,
    # mesh axes ('dp', 'tp') = (4, 2), devices in row-major order).
    from _jax_golden import GOLDEN

    for (mesh_shape, entries, shape), expected in GOLDEN.items():
        mesh = AbstractMesh(dict(mesh_shape))
        got = NamedSharding(mesh, P(*entries)).devices_indices_map(shape)
        assert got == expected, (mesh_shape, entries, shape)


def test_layout_validation_and_dual():
    with pytest.raises(ShardingError, match="cannot both split a dim and be partial"):
        Layout(MESH, P("dp"), partial="dp")
    with pytest.raises(ShardingError, match="partial axis 'pp' is not an axis"):
        Layout(MESH, partial="pp")
    layout = Layout(MESH, P("dp"))
    assert layout.replicated == ("tp",)
    assert layout.dual() == Layout(MESH, P("dp"), partial="tp")
    assert layout.dual().dual() == layout


@st.composite
def mesh_spec_shape(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    sizes = [draw(st.integers(1, 4)) for _ in names]
    dims, shape = draw(dims_and_shape(names))
    return AbstractMesh(dict(zip(names, sizes, strict=True))), P.from_dim_axes(dims), shape


@settings(max_examples=300, deadline=None)
@given(mesh_spec_shape())
def test_devices_indices_map_covers_every_element_once_per_replica(case):
    mesh, spec, shape = case
    sharding = NamedSharding(mesh, spec)
    index_map = sharding.devices_indices_map(shape)
    replicated = [a for a in mesh.axis_names if a not in spec.axes]
    by_replica: dict[tuple, np.ndarray] = {}
    for rank, index in index_map.items():
        coords = mesh.coords(rank)
        key = tuple(coords[a] for a in replicated)
        count = by_replica.setdefault(key, np.zeros(shape, dtype=int))
        count[index] += 1
        local = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape, strict=True))
        assert local == sharding.local_shape(shape, rank)
    assert len(by_replica) == mesh.size(replicated) if replicated else len(by_replica) == 1
    for count in by_replica.values():
        assert (count == 1).all()
