"""The ``shardax ckpt`` commands: inspect, verify, reshard, consolidate,
import (dense weights, or a DeepSpeed checkpoint with ``--from-deepspeed``).
Thin click wrappers over :mod:`shardax.ckpt`; none needs a process group,
and none runs code from a checkpoint (pickles are read with
``weights_only=True``).

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(ckpt_command, ["reshard", "a", "b", "--mesh", "dp=two"])
>>> result.exit_code, "dp=two" in result.output
(2, True)
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from .._bad_setting import BadSetting
from ..errors import CheckpointError, ConfigError, MeshError, ShardingError
from ..mesh._mesh import AbstractMesh
from ..shard._matching import Rule, Rules
from ._deepspeed_cli import RUN_CONFIG, import_deepspeed_command
from ._format import ValueEntry, live_dir, parse_dtype, read_index
from ._offline import (
    as_rules,
    consolidate,
    dense_total_bytes,
    import_dense,
    reshard,
    total_bytes,
    total_tensors,
    verify,
)
from ._save import check_replaceable

__all__ = ["RUN_CONFIG", "ckpt_command", "load_rules", "parse_mesh"]

_MIB = 1 << 20


def parse_mesh(text: str) -> AbstractMesh:
    """``dp=4,tp=2`` → ``AbstractMesh({"dp": 4, "tp": 2})``.

    >>> parse_mesh("dp=4,tp=2")
    AbstractMesh({'dp': 4, 'tp': 2})
    """
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        size = size.strip()
        if not eq or not name or not (size.isascii() and size.isdigit()):
            raise click.BadParameter(
                f"{text!r}: write the mesh as axis=size pairs separated by commas, e.g. dp=4,tp=2"
            )
        if name in shape:
            raise click.BadParameter(f"{text!r} names axis {name!r} twice")
        shape[name.strip()] = int(size)
    try:
        return AbstractMesh(shape)
    except MeshError as e:
        raise click.BadParameter(str(e)) from None


def load_rules(ref: str) -> Rules:
    """Rules from ``module_or_file:NAME``: a module path (``mypkg.rules``) or
    a ``.py`` file, and the name in it of a ``Rules``, a ``Rule``, a list of
    rules or a mapping pattern → spec."""
    where, colon, name = ref.rpartition(":")
    if not colon or not where or not name:
        raise click.BadParameter(
            f"{ref!r}: write MODULE:NAME or FILE.py:NAME (e.g. mypkg.sharding:RULES)"
        )
    try:
        if where.endswith(".py") or Path(where).is_file():
            spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            if spec is None or spec.loader is None:
                raise click.BadParameter(f"cannot load {where} as Python")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError) as e:
        raise click.BadParameter(f"cannot import {where!r}: {e}") from None
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, (Rule, Rules)))
        raise click.BadParameter(f"{where} has no {name!r}; rules defined there: {found}")
    try:
        return as_rules(getattr(module, name))
    except (CheckpointError, ShardingError) as e:
        raise click.BadParameter(f"{ref}: {e}") from None


def _specs_file(path: str) -> Rules:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise click.BadParameter(
            f'{path} must hold a JSON object of regex pattern → spec, e.g. {{".*weight": ["tp", null]}}'
        )
    try:
        return as_rules(data)
    except (CheckpointError, ShardingError) as e:
        raise click.BadParameter(f"{path}: {e}") from None


def _target_rules(rules: str | None, specs: str | None) -> Rules:
    if rules and specs:
        raise click.UsageError("give --rules or --specs, not both")
    if rules:
        return load_rules(rules)
    if specs:
        return _specs_file(specs)
    return Rules()  # every leaf replicated (useful for one-rank targets)


@contextlib.contextmanager
def _bar(total: int, label: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    if quiet or total == 0:
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=False) as bar:
        yield bar.update


def _fail(e: Exception) -> None:
    raise BadSetting(str(e))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


_COMMON = dict(
    buffer=click.option(
        "--buffer-mib",
        type=click.IntRange(1),
        default=64,
        show_default=True,
        help="MiB read or written at a time (one tensor row at least): bounds the memory used.",
    ),
    quiet=click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
)


@click.group("ckpt", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def ckpt_command() -> None:
    """Inspect, verify, reshard, consolidate and import sharded checkpoints.

    \b
    Examples:
      shardax ckpt inspect checkpoints/step-00001000
      shardax ckpt verify checkpoints/step-00001000
      shardax ckpt reshard ckpt/ ckpt-tp2/ --mesh dp=4,tp=2 --rules mypkg.sharding:RULES
      shardax ckpt consolidate ckpt/ model.safetensors --only params --dtype bf16
      shardax ckpt import model.safetensors ckpt/ --mesh dp=8 --specs specs.json --prefix params
      shardax ckpt import --from-deepspeed ds_ckpt/ ckpt/ --config run.hjson

    See docs/ckpt.md for the format.
    """


@ckpt_command.command("inspect")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect_command(path: str, as_json: bool) -> None:
    """Show a checkpoint's leaves (path, shape, dtype, spec, bytes), the mesh
    it was saved from, totals and metadata.

    \b
    Examples:
      shardax ckpt inspect checkpoints/step-00001000
      shardax ckpt inspect checkpoints/step-00001000 --json | jq .total_bytes
    """
    try:
        index = read_index(path)
    except CheckpointError as e:
        _fail(e)
    root = live_dir(path)
    on_disk = sum((root / f).stat().st_size for f in index.files() if (root / f).exists())
    leaves, values = [], {}
    for p, e in index.leaves.items():
        if isinstance(e, ValueEntry):
            values[p] = e.value
        else:
            leaves.append(
                {
                    "path": p,
                    "shape": list(e.shape),
                    "dtype": e.dtype,
                    "spec": repr(e.spec),
                    "mesh": e.mesh,
                    "bytes": e.nbytes,
                    "boxes": len(e.boxes),
                }
            )
    total = sum(x["bytes"] for x in leaves)
    if as_json:
        summary = {
            "path": str(root),
            "version": index.version,
            "mesh": index.mesh,
            "world_size": index.world_size,
            "metadata": index.metadata,
            "leaves": leaves,
            "values": values,
            "total_bytes": total,
            "bytes_on_disk": on_disk,
            "files": sorted(index.files()),
        }
        click.echo(json.dumps(summary, indent=1))
        return
    mesh = ", ".join(f"{k}={v}" for k, v in index.mesh.items()) or "(none)"
    click.echo(f"{root}  (format version {index.version})")
    click.echo(f"saved from mesh {mesh} by {index.world_size} rank(s)")
    rows = [
        (
            x["path"],
            "×".join(map(str, x["shape"])) or "()",
            x["dtype"],
            x["spec"],
            _human(x["bytes"]),
        )
        for x in leaves
    ]
    heads = ("path", "shape", "dtype", "spec", "bytes")
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))
    click.echo(line.rstrip())
    for r in rows:
        cells = [
            c.ljust(w) if i != 4 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        click.echo("  ".join(cells).rstrip())
    click.echo(
        f"{len(leaves)} tensors, {_human(total)} ({total} bytes); {len(index.files())} files, "
        f"{_human(on_disk)} on disk"
    )
    for p, v in values.items():
        click.echo(f"value {p} = {json.dumps(v)}")
    if index.metadata:
        click.echo(f"metadata {json.dumps(index.metadata)}")


@ckpt_command.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@_COMMON["buffer"]
@_COMMON["quiet"]
def verify_command(path: str, buffer_mib: int, quiet: bool) -> None:
    """Recompute every checksum of a checkpoint; exit 1 naming each bad
    file and tensor.

    \b
    Example:
      shardax ckpt verify checkpoints/step-00001000 && echo intact
    """
    try:
        index = read_index(path)
        total = sum(e.nbytes for e in index.tensors().values())
        total += sum(b.numel for s in index.rng.values() for b in s["tensors"].values())
        with _bar(total, "verifying", quiet) as progress:
            problems = verify(path, buffer_bytes=buffer_mib * _MIB, progress=progress)
    except CheckpointError as e:
        _fail(e)
    if problems:
        for p in problems:
            click.echo(f"BAD {p}", err=True)
        click.echo(f"{len(problems)} problem(s) in {path}", err=True)
        sys.exit(1)
    click.echo(f"{path}: every checksum matches ({_human(total)})")


def _mesh_option(required: bool) -> Callable[[Any], Any]:
    return click.option(
        "--mesh",
        "mesh",
        required=required,
        callback=lambda _ctx, _p, v: parse_mesh(v) if v is not None else None,
        help="Target mesh as axis=size pairs, e.g. dp=4,tp=2.",
    )


_RULES = click.option(
    "--rules",
    metavar="MODULE_OR_FILE:NAME",
    help="Rules (Rules, Rule, list or pattern→spec dict) to lay leaves out by.",
)
_SPECS = click.option(
    "--specs",
    type=click.Path(exists=True, dir_okay=False),
    help='JSON object of regex pattern → spec, e.g. {".*qkv\\\\.weight": ["tp", null]}.',
)
_DTYPE = click.option("--dtype", help="Cast floating tensors to this dtype (bf16, fp16, fp32, …).")
_FORCE = click.option(
    "--force",
    is_flag=True,
    help="Replace the output if it exists (only a shardax checkpoint or a file; never "
    "another directory).",
)


def _check_dtype(dtype: str | None) -> None:
    if dtype is not None:
        try:
            parse_dtype(dtype)
        except CheckpointError as e:
            raise click.BadParameter(str(e), param_hint="--dtype") from None


def _check_dst(dst: str, force: bool, *, directory: bool = True) -> None:
    path = Path(dst)
    if not path.exists():
        return
    if not force:
        raise BadSetting(f"{dst} exists; pass --force to replace it")
    try:
        if directory:
            check_replaceable(path.absolute())
        elif path.is_dir():
            raise CheckpointError(f"{dst} is a directory; the output is one .safetensors file")
    except CheckpointError as e:
        _fail(e)


@ckpt_command.command("reshard")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path())
@_mesh_option(required=True)
@_RULES
@_SPECS
@_DTYPE
@_FORCE
@_COMMON["buffer"]
@_COMMON["quiet"]
def reshard_command(
    src: str,
    dst: str,
    mesh: AbstractMesh,
    rules: str | None,
    specs: str | None,
    dtype: str | None,
    force: bool,
    buffer_mib: int,
    quiet: bool,
) -> None:
    """Rewrite checkpoint SRC as DST, laid out for another mesh and specs —
    offline, no process group, streaming (memory bounded by --buffer-mib).

    A rule written for a parameter path (blocks.0.attn.qkv.weight) also
    applies to that parameter's optimizer state (opt_state.0.mu.blocks.0...).
    Leaves no rule matches are stored replicated.

    \b
    Examples:
      shardax ckpt reshard ckpt/ ckpt-8/ --mesh dp=8 --specs specs.json
      shardax ckpt reshard ckpt/ ckpt-tp/ --mesh dp=2,tp=2 --rules train.py:RULES
    """
    _check_dtype(dtype)
    _check_dst(dst, force)
    target = _target_rules(rules, specs)
    try:
        index = read_index(src)
        with _bar(total_bytes(index, dtype=dtype), "resharding", quiet) as progress:
            out = reshard(
                src,
                dst,
                target,
                mesh=mesh,
                dtype=dtype,
                buffer_bytes=buffer_mib * _MIB,
                progress=progress,
            )
    except (CheckpointError, ShardingError) as e:
        _fail(e)
    click.echo(f"wrote {out} for mesh {mesh!r}")


@ckpt_command.command("consolidate")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path())
@click.option(
    "--only",
    metavar="KEY",
    help="Keep the leaves under this key path (e.g. params), named below it.",
)
@click.option(
    "--hf",
    is_flag=True,
    help="OUT is a folder for Hugging Face's from_pretrained: model.safetensors and the "
    "config.json the checkpoint recorded (save with metadata=sx.ckpt.model_metadata(model)).",
)
@_DTYPE
@_FORCE
@_COMMON["buffer"]
@_COMMON["quiet"]
def consolidate_command(
    src: str,
    out: str,
    only: str | None,
    hf: bool,
    dtype: str | None,
    force: bool,
    buffer_mib: int,
    quiet: bool,
) -> None:
    """Write checkpoint SRC as one dense safetensors file OUT, streaming: the
    memory used is bounded by --buffer-mib, not by the model, and with --only
    nothing else (optimizer state, say) is read. A checkpoint that recorded
    its model (sx.ckpt.model_metadata) gets tied weights under each name and
    no non-persistent buffers: model.load_state_dict(..., strict=True) takes
    the file.

    \b
    Examples:
      shardax ckpt consolidate ckpt/ model.safetensors --only params --dtype bf16
      python -c "import safetensors.torch as s; print(list(s.load_file('model.safetensors')))"
      shardax ckpt consolidate ckpt/ gpt2-out/ --only params --hf
    """
    _check_dtype(dtype)
    _check_dst(out, force, directory=hf)
    try:
        index = read_index(src)
        with _bar(total_bytes(index, only, dtype), "consolidating", quiet) as progress:
            path = consolidate(
                src,
                out,
                only=only,
                dtype=dtype,
                buffer_bytes=buffer_mib * _MIB,
                progress=progress,
                hf=hf,
            )
    except CheckpointError as e:
        _fail(e)
    n = total_tensors(index, only)
    file = path / "model.safetensors" if hf else path
    click.echo(f"wrote {path} ({_human(file.stat().st_size)}; {n} tensors from {src})")


@ckpt_command.command("import")
@click.argument("src", type=click.Path(exists=True))
@click.argument("dst", type=click.Path())
@click.option(
    "--from-deepspeed",
    is_flag=True,
    help="SRC is a DeepSpeed ZeRO checkpoint (its tag directory, or the folder holding "
    "`latest`): write the training state to continue from — params, optimizer state, step.",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    help="With --from-deepspeed: the run config (hjson) the run continues with; its optimizer, "
    "precision, rules and mesh shape the state.  [default: the DeepSpeed config the checkpoint "
    "recorded, converted]",
)
@_mesh_option(required=False)
@_RULES
@_SPECS
@click.option("--prefix", metavar="KEY", help="Nest every tensor under this key (e.g. params).")
@_DTYPE
@_FORCE
@_COMMON["buffer"]
@_COMMON["quiet"]
@click.pass_context
def import_command(
    ctx: click.Context,
    src: str,
    dst: str,
    from_deepspeed: bool,
    config: str | None,
    mesh: AbstractMesh | None,
    rules: str | None,
    specs: str | None,
    prefix: str | None,
    dtype: str | None,
    force: bool,
    buffer_mib: int,
    quiet: bool,
) -> None:
    """Turn dense weights SRC (a .safetensors file, read in place, or a torch
    state dict, loaded with weights_only=True) into a sharded checkpoint DST
    for MESH, to start sharded training from pretrained weights.

    With --from-deepspeed, SRC is a DeepSpeed ZeRO-1/2/3 (or universal)
    checkpoint and DST the training state {params, opt_state, step} a run of
    --config resumes from on any mesh (examples/train_gpt.py --config FILE
    --resume DST), DeepSpeed's loss scaler and LR scheduler in its metadata.
    Its pickles are read with weights_only=True allowing only DeepSpeed's own
    classes: nothing in them runs, and DeepSpeed need not be installed.

    \b
    Examples:
      shardax ckpt import model.safetensors ckpt/ --mesh dp=8 --prefix params
      shardax ckpt import pytorch_model.bin ckpt/ --mesh dp=4,tp=2 --rules mypkg.sharding:RULES
      shardax ckpt import --from-deepspeed ds_ckpt/ ckpt/ --config run.hjson
    """
    _check_dtype(dtype)
    if from_deepspeed:
        if prefix is not None or dtype is not None:
            raise click.UsageError(
                "--prefix and --dtype do not apply to --from-deepspeed: the state's keys are "
                "params, opt_state and step, its params in the run config's precision"
            )
        _check_dst(dst, force)
        target = _target_rules(rules, specs) if rules or specs else None
        try:
            lines = import_deepspeed_command(
                ctx.meta.get(RUN_CONFIG), src, dst, config, mesh, target, buffer_mib * _MIB
            )
        except (CheckpointError, ConfigError, ShardingError) as e:
            _fail(e)
        click.echo("\n".join(lines))
        return
    if config is not None:
        raise click.UsageError("--config goes with --from-deepspeed")
    if Path(src).is_dir():
        raise click.BadParameter(
            f"{src} is a directory; for a DeepSpeed checkpoint pass --from-deepspeed",
            param_hint="SRC",
        )
    if mesh is None:
        raise click.UsageError("Missing option '--mesh' (the mesh to lay the weights out for).")
    _check_dst(dst, force)
    target = _target_rules(rules, specs)
    try:
        with _bar(dense_total_bytes(src, dtype), "importing", quiet) as progress:
            out = import_dense(
                src,
                dst,
                target,
                mesh=mesh,
                prefix=prefix,
                dtype=dtype,
                buffer_bytes=buffer_mib * _MIB,
                progress=progress,
            )
    except (CheckpointError, ShardingError) as e:
        _fail(e)
    count = len(read_index(out).tensors())
    click.echo(f"wrote {out}: {count} tensors for mesh {mesh!r} ({mesh.world_size} ranks)")
