"""Every ```python block in the README and the docs runs as written (world
size 1; a page's blocks in order, sharing names), so the docs cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "docs/sharding.md",
    "docs/collectives.md",
    "docs/training.md",
    "docs/optim.md",
    "docs/data.md",
    "docs/ckpt.md",
    "docs/tensor_parallel.md",
    "docs/ulysses.md",
    "docs/report.md",
    "docs/config.md",
    "docs/monitor.md",
]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, capsys):
    """A page's blocks run in order in one namespace, as a reader runs them."""
    text = (ROOT / page).read_text()
    namespace = {"__name__": "__doc__"}
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S)):
        exec(compile(code, f"<{page} block {i}>", "exec"), namespace)
