"""The relayout planner, in one process on abstract meshes: the collectives it
picks, that it always reaches the target, and that every step is legal."""

from __future__ import annotations

import pytest
from _layouts import all_layouts
from hypothesis import given, settings
from hypothesis import strategies as st

from shardax import AbstractMesh, Layout, P, plan_transfer

MESH = AbstractMesh({"x": 2, "y": 2})


def kinds(src: Layout, dst: Layout, shape=(4, 4)) -> list[tuple]:
    return [(s.kind, s.axes, s.dim, s.to_dim) for s in plan_transfer(src, dst, shape).steps]


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (Layout(MESH, P("x")), Layout(MESH, P()), [("all_gather", ("x",), 0, None)]),
        (Layout(MESH, P()), Layout(MESH, P("x")), [("slice", ("x",), 0, None)]),
        (Layout(MESH, partial="x"), Layout(MESH, P()), [("psum", ("x",), None, None)]),
        (Layout(MESH, partial="x"), Layout(MESH, P("x")), [("psum_scatter", ("x",), 0, None)]),
        (Layout(MESH, P("x")), Layout(MESH, P(None, "x")), [("all_to_all", ("x",), 0, 1)]),
        (Layout(MESH, P()), Layout(MESH, partial="y"), [("mask", ("y",), None, None)]),
        (Layout(MESH, P("y")), Layout(MESH, partial="y"), [("pad", ("y",), 0, None)]),
        # several axes in one collective
        (Layout(MESH, P(("x", "y"))), Layout(MESH, P()), [("all_gather", ("x", "y"), 0, None)]),
        (Layout(MESH, P()), Layout(MESH, P(("x", "y"))), [("slice", ("x", "y"), 0, None)]),
        (Layout(MESH, partial=("x", "y")), Layout(MESH, P()), [("psum", ("x", "y"), None, None)]),
        (
            Layout(MESH, partial=("x", "y")),
            Layout(MESH, P(("y", "x"))),
            [("psum_scatter", ("y", "x"), 0, None)],
        ),
        (
            Layout(MESH, P(("x", "y"))),
            Layout(MESH, P(None, ("x", "y"))),
            [("all_to_all", ("x", "y"), 0, 1)],
        ),
        # cheapest first: slice before gather, reduce-scatter before all-gather
        (
            Layout(MESH, P("x")),
            Layout(MESH, P(None, "y")),
            [("slice", ("y",), 1, None), ("all_gather", ("x",), 0, None)],
        ),
        (
            Layout(MESH, P("x"), partial="y"),
            Layout(MESH, P("y")),
            [("all_gather", ("x",), 0, None), ("psum_scatter", ("y",), 0, None)],
        ),
        # changed axis order on one dim
        (
            Layout(MESH, P(("x", "y"))),
            Layout(MESH, P(("y", "x"))),
            [("all_gather", ("x", "y"), 0, None), ("slice", ("y", "x"), 0, None)],
        ),
        (Layout(MESH, P("x")), Layout(MESH, P("x")), []),
    ],
    ids=str,
)
def test_plan_picks_the_expected_collectives(src, dst, expected):
    assert kinds(src, dst) == expected


def test_plan_between_meshes_redistributes():
    other = AbstractMesh({"z": 4})
    plan = plan_transfer(Layout(MESH, P("x"), partial="y"), Layout(other, P(None, "z")), (4, 4))
    assert [s.kind for s in plan.steps] == ["psum", "redistribute"]
    assert plan.layouts[-1] == Layout(other, P(None, "z"))
    with pytest.raises(Exception, match="different numbers of ranks"):
        plan_transfer(Layout(MESH, P()), Layout(AbstractMesh({"z": 8}), P()), (4,))


def test_plan_prints_as_a_list_of_collectives():
    text = str(plan_transfer(Layout(MESH, P("x"), partial="y"), Layout(MESH, P("y")), (4, 4)))
    assert text.splitlines() == [
        "P('x') partial=('y',) -> P('y') for shape (4, 4):",
        "  all_gather over ('x') on dim 0",
        "  psum_scatter over ('y') on dim 0",
    ]


def _legal(state_layout: Layout, step) -> bool:
    """Each step applies to the layout it starts from."""
    dims = state_layout.dim_axes(2)
    if step.kind in ("all_gather", "pad"):
        return tuple(dims[step.dim][-len(step.axes) :]) == step.axes
    if step.kind == "all_to_all":
        return tuple(dims[step.dim][-len(step.axes) :]) == step.axes
    if step.kind in ("psum", "psum_scatter"):
        return set(step.axes) <= set(state_layout.partial)
    if step.kind in ("slice", "mask"):
        return set(step.axes) <= set(state_layout.replicated)
    return True


LAYOUTS = all_layouts(MESH, 2)
MESH3 = AbstractMesh({"a": 2, "b": 1, "c": 3})
LAYOUTS3 = all_layouts(MESH3, 2)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([(MESH, LAYOUTS), (MESH3, LAYOUTS3)]).flatmap(
        lambda m: st.tuples(st.sampled_from(m[1]), st.sampled_from(m[1]))
    ),
    st.tuples(st.integers(0, 7), st.integers(0, 7)),
)
def test_plans_reach_the_target_with_legal_steps(pair, shape):
    src, dst = pair
    plan = plan_transfer(src, dst, shape)
    assert plan.layouts[0] == src and plan.layouts[-1] == dst
    assert len(plan.layouts) == len(plan.steps) + 1
    for before, step in zip(plan.layouts, plan.steps, strict=False):
        assert _legal(before, step), (str(plan), step)
    # never more collectives than axes moved twice, plus one psum
    assert len(plan.steps) <= 2 * len(MESH3.axis_names) + 1
