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
from .launch._cli import launch_command

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardax")
def main() -> None:
    """shardax: JAX-style functional sharding for PyTorch."""


main.add_command(launch_command, "launch")
main.add_command(ckpt_command, "ckpt")


if __name__ == "__main__":
    main()
