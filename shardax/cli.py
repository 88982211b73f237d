"""The ``shardax`` command line: one click group, subcommands from each layer.

>>> from click.testing import CliRunner
>>> from shardax.cli import main
>>> result = CliRunner().invoke(main, ["--help"])
>>> "launch" in result.output
True
"""

from __future__ import annotations

import os
from typing import Any

import click

from ._bad_setting import BadSetting
from .ckpt._cli import RUN_CONFIG, ckpt_command
from .config import RunConfig, from_deepspeed, load_config
from .config._cli import _config_cli
from .errors import USER_ERRORS, debugging
from .launch._cli import launch_command
from .pipeline._cli import pipeline_command
from .plan._cli import plan_command

__all__ = ["main"]


class _Main(click.Group):
    """The ``shardax`` group: a typed shardax error from any command prints
    its message as a bad setting does (``Error: MeshError: ...``, exit
    status 2), with no traceback unless ``--debug`` or ``SHARDAX_DEBUG=1``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as err:
            if ctx.meta.get("shardax.debug") or debugging():
                raise
            raise BadSetting(f"{type(err).__name__}: {err}") from None


def _debug(ctx: click.Context, _param: Any, value: bool) -> bool:
    ctx.meta["shardax.debug"] = value
    if value:
        os.environ["SHARDAX_DEBUG"] = "1"  # launched ranks show tracebacks too
    return value


@click.group(
    cls=_Main,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(package_name="shardax")
@click.option(
    "--debug", is_flag=True, expose_value=False, is_eager=True, callback=_debug,
    help="Show the Python traceback of an error (also SHARDAX_DEBUG=1).",
)  # fmt: skip
@click.pass_context
def main(ctx: click.Context) -> None:
    """shardax: JAX-style functional sharding for PyTorch."""
    ctx.meta[RUN_CONFIG] = _run_config  # for `ckpt import --from-deepspeed`, a layer below config


def _run_config(source: Any) -> RunConfig:
    """A run config: an hjson file read, or a DeepSpeed config (a dict) converted."""
    if isinstance(source, dict):
        return RunConfig.from_dict(from_deepspeed(source)[0], "the DeepSpeed config")
    return load_config(source)


main.add_command(launch_command, "launch")
main.add_command(ckpt_command, "ckpt")
main.add_command(_config_cli(), "config")
main.add_command(pipeline_command, "pipeline")
main.add_command(plan_command, "plan")


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
