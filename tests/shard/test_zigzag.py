"""The zigzag (head–tail) spec entry: how it normalizes and prints, which
chunks each member holds (every position once, equal causal work), the
pieces it gives a NamedSharding, and the clear refusals where a piece must be
one box or where a parameter would be laid out zigzag."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardax as sx
from shardax import AbstractMesh, NamedSharding, P, ShardingError, Zigzag, zigzag
from shardax.shard._spec import zigzag_bounds

REFUSED = "zigzag lays out batches (sx.data) and activations under rules.context_parallel"


# -- the entry -----------------------------------------------------------------
def test_entry_normalizes_prints_and_names_its_axes():
    assert zigzag("cp") == Zigzag(("cp",))
    assert zigzag(("a", "b")) == zigzag("a", "b") == zigzag(["a"], "b")
    assert repr(zigzag("cp")) == "zigzag('cp')"
    assert repr(zigzag("a", "b")) == "zigzag('a', 'b')"
    spec = P("dp", zigzag("cp"))
    assert repr(spec) == "P('dp', zigzag('cp'))"
    assert spec.axes == ("dp", "cp")
    assert spec.dim_axes(3) == (("dp",), ("cp",), ())
    assert spec.dim_blocks(2) == (1, 1)
    assert spec.zigzagged and not spec.blocked
    assert not P("dp", "cp").zigzagged
    assert spec == P("dp", zigzag("cp"), None) and hash(spec) == hash(P("dp", zigzag("cp")))
    assert spec != P("dp", "cp")


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: zigzag(), "needs the mesh axes"),
        (lambda: Zigzag("cp"), "e.g. zigzag('cp')"),
        (lambda: Zigzag((1,)), "got (1,)"),
        (lambda: P("cp", zigzag("cp")), "mesh axis 'cp' appears twice"),
        (lambda: NamedSharding(AbstractMesh({"cp": 2}), P(zigzag("cq"))), "did you mean 'cp'"),
    ],
)
def test_bad_entry_is_a_clear_error(build, fragment):
    with pytest.raises(ShardingError) as err:
        build()
    assert fragment in str(err.value), str(err.value)


# -- zigzag_bounds ---------------------------------------------------------------
def test_bounds_of_eight_over_two_and_four():
    assert [zigzag_bounds(8, 2, i) for i in range(2)] == [((0, 2), (6, 8)), ((2, 4), (4, 6))]
    assert [zigzag_bounds(8, 4, i) for i in range(4)] == [
        ((0, 1), (7, 8)),
        ((1, 2), (6, 7)),
        ((2, 3), (5, 6)),
        ((3, 4), (4, 5)),
    ]
    assert zigzag_bounds(6, 1, 0) == ((0, 3), (3, 6))  # one member: the whole dim, in order


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(0, 12))
def test_every_position_once_and_equal_causal_work(n, chunk):
    length = 2 * n * chunk
    seen = torch.zeros(length, dtype=torch.int64)
    work = []
    for i in range(n):
        first, second = zigzag_bounds(length, n, i)
        assert first[1] - first[0] == second[1] - second[0] == chunk
        assert first[0] <= second[0]  # the head chunk first, then the tail one
        positions = torch.cat([torch.arange(*first), torch.arange(*second)])
        seen[positions] += 1
        # causal attention: the token at position p attends to p + 1 tokens
        work.append(int((positions + 1).sum()))
    assert seen.tolist() == [1] * length
    assert len(set(work)) == 1, work


@pytest.mark.parametrize(("length", "n", "fix"), [(6, 2, "4 or 8"), (3, 1, "2 or 4"), (5, 3, "6")])
def test_bounds_of_a_length_not_a_multiple_of_2n_name_it_and_the_fix(length, n, fix):
    with pytest.raises(ShardingError) as err:
        zigzag_bounds(length, n, 0)
    text = str(err.value)
    for fragment in (f"got {length}", f"over {n} members", f"multiple of {2 * n}", fix):
        assert fragment in text, (fragment, text)


@pytest.mark.parametrize(("n", "index"), [(0, 0), (2, 2), (2, -1)])
def test_bounds_of_a_member_not_there_is_an_error(n, index):
    with pytest.raises(ShardingError):
        zigzag_bounds(8, n, index)


# -- a sharding with a zigzag dim --------------------------------------------------
def test_local_boxes_are_the_two_chunks_times_the_other_dims():
    mesh = AbstractMesh({"dp": 2, "cp": 2})
    s = NamedSharding(mesh, P("dp", zigzag("cp")))
    assert s.local_shape((4, 8, 3), 1) == (2, 4, 3)
    assert s.shard_shape((4, 8, 3)) == (2, 4, 3)
    # rank 1: dp 0, cp 1 -> rows 0..2, sequence chunks 1 and 2 of 4
    assert s.local_boxes((4, 8, 3), 1) == [((0, 2, 0), (2, 2, 3)), ((0, 4, 0), (2, 2, 3))]
    assert s.local_boxes((4, 8, 3), 2) == [((2, 0, 0), (2, 2, 3)), ((2, 6, 0), (2, 2, 3))]


def test_local_boxes_tile_the_tensor_once_per_replica():
    mesh = AbstractMesh({"dp": 2, "cp": 2, "tp": 2})
    s = NamedSharding(mesh, P("dp", zigzag("cp")))
    shape = (4, 16)
    count = torch.zeros(shape, dtype=torch.int64)
    for rank in range(mesh.world_size):
        for offsets, sizes in s.local_boxes(shape, rank):
            count[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] += 1
    assert count.eq(2).all()  # tp holds two identical copies


def test_local_boxes_of_an_uneven_zigzag_dim_name_it():
    s = NamedSharding(AbstractMesh({"cp": 2}), P(None, zigzag("cp")))
    with pytest.raises(ShardingError) as err:
        s.local_boxes((2, 6), 0)
    text = str(err.value)
    for fragment in ("dim 1", "(2, 6)", "P(None, zigzag('cp'))", "multiple of 4", "4 or 8"):
        assert fragment in text, (fragment, text)


def test_blocks_and_zigzag_in_one_spec_are_refused():
    s = NamedSharding(AbstractMesh({"cp": 2, "tp": 2}), P(sx.blocks(3, "tp"), zigzag("cp")))
    with pytest.raises(ShardingError, match="one or the other"):
        s.local_boxes((6, 8), 0)


@pytest.mark.parametrize("method", ["local_bounds", "devices_indices_map", "expand", "dim_axes"])
def test_one_box_methods_refuse_a_zigzag_spec(method):
    s = NamedSharding(AbstractMesh({"cp": 2}), P(None, zigzag("cp")))
    args = {"local_bounds": ((2, 8), 0), "dim_axes": (2,)}.get(method, ((2, 8),))
    with pytest.raises(ShardingError) as err:
        getattr(s, method)(*args)
    text = str(err.value)
    for fragment in (method, "P(None, zigzag('cp'))", REFUSED, "local_boxes", "blocks(...)"):
        assert fragment in text, (fragment, text)


# -- parameters are never zigzag ---------------------------------------------------
ZIGZAG_RULE = sx.Rule(".*", P(zigzag("cp")))


@pytest.mark.parametrize(
    "lay_out",
    [
        lambda: sx.shard({"w": torch.zeros(8)}, sx.Mesh({"cp": 1}), ZIGZAG_RULE),
        lambda: sx.shard({"w": torch.zeros(8)}, sx.Mesh({"cp": 1}), {"w": P(zigzag("cp"))}),
        lambda: sx.explain(
            {"w": torch.zeros(8, device="meta")}, AbstractMesh({"cp": 2}), ZIGZAG_RULE
        ),
        lambda: sx.Rules(ZIGZAG_RULE).placement("w", (8,), AbstractMesh({"cp": 2})),
    ],
    ids=["shard-rule", "shard-spec", "explain", "placement"],
)
def test_a_zigzag_parameter_is_refused_naming_path_spec_and_fix(lay_out):
    with pytest.raises(ShardingError) as err:
        lay_out()
    text = str(err.value)
    for fragment in ("'w'", "P(zigzag('cp'))", "splits a dim zigzag", "rules.context_parallel"):
        assert fragment in text, (fragment, text)
    assert "P('cp') rather than P(zigzag('cp'))" in text


@pytest.mark.parametrize(
    ("src", "dst"),
    [(P(zigzag("cp")), P()), (P(), P(zigzag("cp"))), (P("cp"), P(zigzag("cp")))],
)
def test_a_transfer_to_or_from_zigzag_is_refused(src, dst):
    mesh = AbstractMesh({"cp": 2})
    with pytest.raises(ShardingError, match="transfers use plain splits or blocks"):
        sx.plan_transfer(sx.Layout(mesh, src), sx.Layout(mesh, dst), (8,))


def test_transfer_of_a_tensor_to_zigzag_is_refused_even_on_one_member():
    x = sx.shard(torch.arange(8.0), sx.Mesh({"cp": 1}), P("cp"))
    with pytest.raises(ShardingError, match=re.escape(REFUSED)):
        sx.transfer(x, P(zigzag("cp")))
