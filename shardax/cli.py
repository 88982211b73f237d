"""The ``shardax`` command line: one click group, subcommands from each layer.

>>> from click.testing import CliRunner
>>> from shardax.cli import main
>>> result = CliRunner().invoke(main, ["--help"])
>>> "launch" in result.output
True
"""

from __future__ import annotations

import click

from .ckpt._cli import ckpt_command
from .config import _config_cli
from .launch._cli import launch_command

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardax")
def main() -> None:
    """shardax: JAX-style functional sharding for PyTorch."""


main.add_command(launch_command, "launch")
main.add_command(ckpt_command, "ckpt")
main.add_command(_config_cli(), "config")


@main.command("report")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def report_command(as_json: bool) -> None:
    """What this machine gives shardax: Python, torch, CUDA/NCCL/CuPy, GPUs,
    collective transports (and why one is unusable), the native-kernel
    toolchain, /dev/shm, CPU and memory, relevant environment variables.
    Never fails: a probe that breaks becomes a line saying why."""
    from .report import report_command_impl

    click.echo(report_command_impl(as_json))


if __name__ == "__main__":
    main()
