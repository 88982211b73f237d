"""``render`` and ``shardax pipeline show``: a timeline drawn one row per
rank over the simulated spans, then makespan, bubble and peak activations;
bad sizes and settings are one line and exit status 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from shardax.cli import main
from shardax.errors import ScheduleError
from shardax.pipeline import SCHEDULES, gpipe, one_f_one_b, render, simulate


def _show(*args: str):
    return CliRunner().invoke(main, ["pipeline", "show", *args])


def test_render_draws_each_action_over_its_span():
    """F costs 1 and B 2: by default 5 columns a second (the shortest
    action's label and a space), so an F takes 5 columns and a B 10; idle
    time is dots."""
    text = render(simulate(gpipe(2, 1), {"F": 1.0, "B": 2.0}))
    rows = text.splitlines()
    assert rows[0] == "rank 0 |F0.0 ...............B0.0      |"
    assert rows[1] == "rank 1 |.....F1.0 B1.0      ..........|"
    assert rows[2:] == [
        "makespan: 6",
        "bubble: 0.5000 (50.0% of 2 ranks x 6)",
        "peak activations per rank (micro-batches held, counted per stage): 1 1",
    ]


def test_a_narrow_render_keeps_the_kinds():
    text = render(simulate(one_f_one_b(4, 8), {"F": 1.0, "B": 2.0}), width=33)
    rows = text.splitlines()[:4]
    assert all(len(row) == len("rank 0 |") + 33 + 1 for row in rows)  # one column a second
    assert rows[3] == "rank 3 |...FB FB FB FB FB FB FB FB ......|"
    with pytest.raises(ScheduleError, match="width is a number of columns >= 1; got 0"):
        render(simulate(gpipe(2, 1), {"F": 1.0, "B": 2.0}), width=0)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_show_draws_every_schedule(name):
    result = _show("--schedule", name, "--stages", "2", "--microbatches", "4")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{name}: 2 ranks, ")
    assert [line[:8] for line in lines[1:3]] == ["rank 0 |", "rank 1 |"]
    assert lines[3].startswith("makespan: ")


def test_show_prints_the_1f1b_bubble_and_memory():
    result = _show(
        "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--costs", "F=1,B=2"
    )
    assert result.exit_code == 0, result.output
    assert "makespan: 33\nbubble: 0.2727 (27.3% of 4 ranks x 33)\n" in result.output
    assert result.output.endswith("counted per stage): 4 3 2 1\n")


def test_show_takes_virtual_stages_and_comm():
    args = ["--schedule", "interleaved_1f1b", "--stages", "2", "--microbatches", "4"]
    result = _show(*args, "--virtual", "3", "--costs", "F=1,B=2", "--comm", "0.5")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("interleaved_1f1b: 2 ranks, 6 stages, 4 micro-batches; ")
    assert "costs F=1 B=2, comm 0.5" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--schedule", "dualpipe_v", "--stages", "4", "--microbatches", "5"],
            "Error: ScheduleError: dualpipe_v with 4 ranks needs at least 8 micro-batches",
        ),
        (
            ["--schedule", "interleaved_1f1b", "--stages", "4", "--microbatches", "6"],
            "Error: ScheduleError: interleaved_1f1b with 4 ranks needs a multiple of 4 "
            "micro-batches",
        ),
        (
            ["--schedule", "zbv", "--stages", "2", "--microbatches", "4", "--costs", "F=1,B=2"],
            "Error: ScheduleError: costs['",  # 'I' or 'W', whichever is checked first
        ),
        (
            ["--schedule", "gpipe", "--stages", "2", "--microbatches", "4", "--virtual", "2"],
            "--virtual: only interleaved_1f1b and looped_bfs take it",
        ),
        (
            ["--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--costs", "F=1,X=2"],
            "--costs: 'F=1,X=2': write KIND=SECONDS pairs",
        ),
    ],
    ids=["too-few", "not-a-multiple", "costs-lack-I", "virtual-unused", "bad-costs"],
)
def test_a_bad_setting_is_one_line_and_status_2(args, message):
    result = _show(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
