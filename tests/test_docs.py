"""Every ```python block in the README and the docs runs as written (world
size 1), so the docs cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/sharding.md", "docs/collectives.md"]


def blocks():
    for page in PAGES:
        text = (ROOT / page).read_text()
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S)):
            yield pytest.param(code, id=f"{page}#{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_python_blocks_run(code, capsys):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc__"})
