"""CI runs what a user runs: the README's test command verbatim, then the
heavy cases it leaves out (``pytest -m slow``), and nothing else but the
CPU build of torch first (issue 35: CI's limit is 90 minutes, so nothing
heavy is left unrun)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readmes_test_command_then_the_slow_cases():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S)
    assert block is not None, "README.md has a Quickstart with a bash block"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2, commands  # one runs the example, one the tests
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line for line in script if line.strip() and not line.lstrip().startswith("#")]
    assert steps == [
        "set -euo pipefail",
        'cd "$(dirname "$0")/.."',
        "pip install torch==2.13.0",
        commands[1],
        "python -m pytest -m slow",
    ]


def test_the_default_run_leaves_the_slow_cases_to_their_own_run():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "addopts = \"--import-mode=importlib -p no:cacheprovider -m 'not slow'\"" in pyproject
