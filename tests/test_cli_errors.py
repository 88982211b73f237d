"""A bad setting on a command line is one line and exit status 2 — the typed
error's message with its remedy, no traceback unless --debug or
SHARDAX_DEBUG=1 — and every command's --help shows the defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from shardax.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _commands(group: click.Group, prefix: tuple[str, ...] = ()):
    for name, command in sorted(group.commands.items()):
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from _commands(command, (*prefix, name))


@pytest.mark.parametrize("path", [p for p, _ in _commands(main)], ids=lambda p: " ".join(p))
def test_help_shows_every_default(path):
    command = dict(_commands(main))[path]
    result = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden or param.is_flag:
            continue
        if param.required or param.multiple or param.show_default is False:
            continue
        if not isinstance(param.default, (int, float, str)) or param.default == "":
            continue  # no default (click's UNSET, None), or nothing to show
        options = result.output[result.output.index("Options:") :]
        start = options.index(f"  {param.opts[0]}")
        end = options.find("\n  -", start + 1)
        entry = options[start : end if end > 0 else None]
        assert "[default: " in entry, (path, param.name, entry)


def test_a_typed_error_is_one_line_and_status_2(tmp_path):
    (tmp_path / "specs.json").write_text('{"w": ["tp"]}')
    import torch

    import shardax as sx

    path = sx.ckpt.save(tmp_path / "c", {"w": torch.ones(4)})
    args = ["ckpt", "reshard", str(path), str(tmp_path / "d"), "--mesh", "dp=2"]
    args += ["--specs", str(tmp_path / "specs.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "'tp'" in result.output  # names the axis the mesh lacks


def _example(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--mesh", "dp=3", "--steps", "2", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_the_example_prints_one_line_for_a_bad_setting():
    done = _example()
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train_gpt.py: error: MeshError: mesh"), lines
    assert "world size is 1" in lines[0] and "use -1 for one axis" in lines[0]


@pytest.mark.parametrize("how", ["--debug", "SHARDAX_DEBUG=1"])
def test_debug_shows_the_traceback(how):
    done = _example("--debug") if how == "--debug" else _example(env={"SHARDAX_DEBUG": "1"})
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr and "MeshError" in done.stderr
