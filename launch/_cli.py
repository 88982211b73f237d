"""The ``shardax launch`` command: a thin click wrapper over :func:`launch`.

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(launch_command, ["--nproc-per-node", "0", "t.py"])
>>> result.exit_code, "0 is not in the range" in result.output
(2, True)
"""

from __future__ import annotations

import difflib

import click

from ..errors import LaunchError
from ._launcher import launch
from ._spec import DEFAULT_MASTER_ADDR, rank_command, validate_ranks

__all__ = ["launch_command", "parse_log_ranks"]

_EPILOG = """\b
Examples:
  shardax launch --nproc-per-node 4 train.py --lr 3e-4
  shardax launch --nproc-per-node 2 -m mypkg.train --config run.hjson
  shardax launch --nproc-per-node 8 --log-ranks 0 train.py
  shardax launch --nproc-per-node 2 --no-python bash -c 'echo $RANK'

\b
Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0,
NODE_RANK=0, MASTER_ADDR, MASTER_PORT, SHARDAX_LAUNCHED=1, PYTHONUNBUFFERED=1,
and, unless already set, GLOO_SOCKET_IFNAME=lo,
OMP_NUM_THREADS=max(1, CPUs // nproc-per-node) and THP_MEM_ALLOC_ENABLE=1.
Its stdin is /dev/null.

\b
If a rank fails, the others get SIGTERM (their whole process groups), then
SIGKILL after --kill-grace seconds; the failed rank's traceback is printed
and its exit code returned (128+N if killed by signal N). Ctrl-C / SIGTERM
stop all ranks the same way and exit 130 / 143. See docs/launch.md.
"""


def parse_log_ranks(text: str) -> tuple[int, ...] | None:
    """Parse ``--log-ranks``: ``all`` (``None``), or ranks and ranges
    separated by commas.

    >>> parse_log_ranks("all") is None
    True
    >>> parse_log_ranks("0,2-4")
    (0, 2, 3, 4)
    """
    text = text.strip()
    if text.lower() == "all":
        return None
    ranks: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise click.BadParameter(
                f"{text!r} is not 'all' or a list of ranks like '0', '0,2' or '0-3'"
            ) from None
        if lo < 0 or hi < lo:
            raise click.BadParameter(f"{part.strip()!r} is not a rank or a range lo-hi of ranks")
        ranks.extend(range(lo, hi + 1))
    return tuple(ranks)


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    },
    epilog=_EPILOG,
)
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    "nproc_per_node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Number of ranks to start on this machine.",
)
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    default=DEFAULT_MASTER_ADDR,
    show_default=True,
    help="Address of rank 0's rendezvous store (MASTER_ADDR).",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port of the rendezvous store (MASTER_PORT).  [default: a free port from the OS]",
)
@click.option(
    "--log-ranks",
    default="all",
    show_default=True,
    metavar="RANKS",
    help="Ranks whose output is shown: 'all', or e.g. '0', '0,2', '0-3'. "
    "A failed rank's traceback is shown regardless.",
)
@click.option(
    "--kill-grace",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when stopping ranks.",
)
@click.option("-m", "--module", is_flag=True, help="Run SCRIPT as a module, like 'python -m'.")
@click.option(
    "--no-python",
    is_flag=True,
    help="Run SCRIPT as an executable, not with the Python interpreter.",
)
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[SCRIPT_ARGS]...")
@click.pass_context
def launch_command(
    ctx: click.Context,
    nproc_per_node: int,
    master_addr: str,
    master_port: int | None,
    log_ranks: str,
    kill_grace: float,
    module: bool,
    no_python: bool,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Start NPROC_PER_NODE local ranks running SCRIPT [SCRIPT_ARGS]...

    Every line a rank prints is shown prefixed '[rank k] '. Everything after
    SCRIPT is passed to it untouched, options included.
    """
    if script.startswith("-") and script != "-":  # an unknown option, not a script
        names = [name for param in ctx.command.params for name in param.opts]
        close = difflib.get_close_matches(script, names)
        raise click.NoSuchOption(script, possibilities=close, ctx=ctx)
    shown = parse_log_ranks(log_ranks)
    try:
        if shown is not None:
            validate_ranks(shown, nproc_per_node, repr(log_ranks))
    except LaunchError as e:
        raise click.BadParameter(str(e), param_hint="--log-ranks") from None
    try:
        cmd = rank_command(script, script_args, module=module, no_python=no_python)
    except LaunchError as e:
        raise click.UsageError(str(e), ctx=ctx) from None
    try:
        code = launch(
            cmd,
            nproc_per_node=nproc_per_node,
            master_addr=master_addr,
            master_port=master_port,
            log_ranks=shown,
            kill_grace=kill_grace,
        )
    except LaunchError as e:
        raise click.ClickException(str(e)) from None
    ctx.exit(code)
