"""The ``shardax pipeline`` commands: ``show`` draws a schedule's simulated
timeline, its bubble and memory, before any rank runs it. No process group,
no model.

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(pipeline_command, ["show", "--schedule", "1f1b",
...     "--stages", "2", "--microbatches", "2"])
>>> print(result.output, end="")
1f1b: 2 ranks, 2 stages, 2 micro-batches; costs F=1 B=2 I=1 W=1, comm 0
rank 0 |F0.0 F0.1 ..........B0.0      .....B0.1      |
rank 1 |.....F1.0 B1.0      F1.1 B1.1      ..........|
makespan: 9
bubble: 0.3333 (33.3% of 2 ranks x 9)
peak activations per rank (micro-batches held, counted per stage): 2 1
"""

from __future__ import annotations

import click

from ._named import SCHEDULES, schedule
from ._show import render
from ._simulate import simulate

__all__ = ["parse_costs", "pipeline_command"]

_VIRTUAL = ("interleaved_1f1b", "looped_bfs")


def parse_costs(text: str) -> dict[str, float]:
    """``F=1,B=2`` → ``{"F": 1.0, "B": 2.0}``: seconds per action kind.

    >>> parse_costs("F=1,B=2,I=1,W=1")
    {'F': 1.0, 'B': 2.0, 'I': 1.0, 'W': 1.0}
    """
    costs: dict[str, float] = {}
    for part in text.split(","):
        kind, eq, value = (x.strip() for x in part.partition("="))
        try:
            cost = float(value)
        except ValueError:
            cost = -1.0
        if not eq or kind not in ("F", "B", "I", "W") or kind in costs or not cost >= 0:
            raise click.BadParameter(
                f"{text!r}: write KIND=SECONDS pairs separated by commas, each kind (F, B, I, W) "
                f"once and each cost >= 0, e.g. F=1,B=2,I=1,W=1",
                param_hint="--costs",
            )
        costs[kind] = cost
    return costs


@click.group(
    "pipeline", context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
def pipeline_command() -> None:
    """Pipeline schedules, before any rank runs one."""


@pipeline_command.command("show")
@click.option(
    "--schedule",
    "name",
    type=click.Choice(list(SCHEDULES)),
    required=True,
    help="The schedule to draw.",
)
@click.option(
    "--stages",
    "ranks",
    type=int,
    required=True,
    help="Pipeline ranks (one stage each; two for zbv and dualpipe_v, --virtual for "
    "interleaved_1f1b and looped_bfs).",
)
@click.option("--microbatches", type=int, required=True, help="Micro-batches per step.")
@click.option(
    "--virtual",
    type=int,
    default=None,
    help="Stages per rank, for interleaved_1f1b and looped_bfs.  [default: 2]",
)
@click.option(
    "--costs",
    default="F=1,B=2,I=1,W=1",
    help="Seconds per action of each kind, per stage.",
)
@click.option(
    "--comm",
    type=float,
    default=0.0,
    help="Seconds for each activation or gradient that crosses ranks.",
)
@click.option(
    "--width",
    type=click.IntRange(min=1),
    default=None,
    help="Columns for the timeline (default: enough for the shortest action's label).",
)
def show_command(
    name: str,
    ranks: int,
    microbatches: int,
    virtual: int | None,
    costs: str,
    comm: float,
    width: int | None,
) -> None:
    """Draw a schedule's simulated timeline, one row per rank (F0.1: the
    forward of stage 0 on micro-batch 1; a dot: idle), then its makespan,
    bubble and each rank's peak activations."""
    if virtual is not None and name not in _VIRTUAL:
        raise click.BadParameter(
            f"only {' and '.join(_VIRTUAL)} take it; {name} places its stages itself",
            param_hint="--virtual",
        )
    parsed = parse_costs(costs)
    s = schedule(name, ranks, microbatches, virtual=2 if virtual is None else virtual)
    timeline = simulate(s, parsed, comm=comm)
    shown = " ".join(f"{k}={v:g}" for k, v in parsed.items())
    click.echo(
        f"{name}: {ranks} ranks, {s.stages} stages, {microbatches} micro-batches; "
        f"costs {shown}, comm {comm:g}"
    )
    click.echo(render(timeline, width))
