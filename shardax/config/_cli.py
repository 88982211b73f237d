"""The ``shardax config`` command line: ``check`` (validate a file, print
the plan, optionally explain a model's sharding) and ``from-deepspeed``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._deepspeed import to_hjson
from ._deepspeed_file import convert_deepspeed_file
from ._load import load_config
from ._run import RunConfig


def _load_model(spec: str) -> Any:
    """``path/to/file.py:factory`` or ``package.module:factory`` → the module
    it returns (called without arguments, under the meta device)."""
    import importlib
    import importlib.util

    import torch

    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not attr:
        raise ConfigError(f"--model {spec!r} is FILE.py:NAME or MODULE:NAME")
    if target.endswith(".py"):
        path = Path(target).resolve()
        import sys

        sys.path.insert(0, str(path.parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"--model: cannot load {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"--model: {target!r} has no {attr!r}")
    try:
        with torch.device("meta"):
            model = factory() if not isinstance(factory, torch.nn.Module) else factory
    except TypeError as err:
        raise ConfigError(
            f"--model {spec!r}: calling {attr}() failed ({err}); name a function that builds "
            "the model without arguments"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"--model {spec!r} gave a {type(model).__name__}, not an nn.Module")
    return model


def _config_cli() -> Any:
    import click

    from .._bad_setting import BadSetting

    @click.group("config")
    def config_command() -> None:
        """Check run configs and convert DeepSpeed ones."""

    @config_command.command("check")
    @click.argument("path", type=click.Path(dir_okay=False))
    @click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True,
                  help="Plan for this many ranks.")  # fmt: skip
    @click.option("--model", default=None, metavar="FILE.py:NAME",
                  help="Also explain how the presets shard this model (built on meta).")  # fmt: skip
    def check(path: str, world_size: int, model: str | None) -> None:
        """Validate PATH and print the resolved plan."""
        try:
            config = load_config(path)
            click.echo(config.plan(world_size))
            if model is not None:
                from ..shard import explain
                from ..shard._params import params_of

                built = _load_model(model)
                mesh = config.abstract_mesh(world_size)
                click.echo(str(explain(params_of(built), mesh, config.make_rules())))
        except ConfigError as err:
            raise BadSetting(str(err)) from None

    @config_command.command("from-deepspeed")
    @click.argument("path", type=click.Path(dir_okay=False))
    @click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
                  help="Write the hjson here (default: stdout).")  # fmt: skip
    @click.option("--lossy", is_flag=True,
                  help="Drop keys whose loss changes what the run computes (listed in the "
                       "output's header) instead of refusing them.")  # fmt: skip
    def convert(path: str, output: str | None, lossy: bool) -> None:
        """Convert the DeepSpeed config PATH (JSON or hjson) into a shardax run
        config; keys that cannot be mapped are listed (in the file and on
        stderr), and a key whose loss would change the math is an error
        unless --lossy."""
        try:
            data, unmapped = convert_deepspeed_file(path, lossy=lossy)
        except ConfigError as err:
            raise BadSetting(str(err)) from None
        try:
            RunConfig.from_text(to_hjson(data), path)  # the result must pass `config check`
        except ConfigError as err:
            raise BadSetting(f"the converted config is invalid: {err}") from None
        text = to_hjson(data, unmapped, path)
        if output is None:
            click.echo(text, nl=False)
        else:
            Path(output).write_text(text)
        for key, why in unmapped:
            click.echo(f"not mapped: {key}: {why}", err=True)

    return config_command
