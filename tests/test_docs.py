"""Every ```python block of the README and of every page in docs/ runs as
written — a page's blocks in order, sharing names, as a reader runs them — on
one rank, and on two gloo ranks where the page builds a mesh, so the docs
cannot rot (and cannot hold a block that only works on one rank). Blocks
after a page's ``<!-- docs-test: one process from here -->`` are offline
tools (``shardax ckpt ...``) and run on one rank only."""

from __future__ import annotations

import contextlib
import io
import os
import re
import traceback
from pathlib import Path

import pytest
from _dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


ONE_PROCESS = "<!-- docs-test: one process from here -->"


def _blocks(page: str, world_size: int = 1) -> list[str]:
    """The page's blocks; on several ranks, those before the page's
    :data:`ONE_PROCESS` marker (offline tools that run outside a job)."""
    text = (ROOT / page).read_text()
    if world_size > 1:
        text = text.split(ONE_PROCESS)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run_page(page: str, cwd: str, world_size: int = 1) -> str:
    """Run ``page``'s blocks in ``cwd``, as a reader at the repository's root
    would (``examples/`` is there too); "" or the failing block's traceback."""
    here = os.getcwd()
    examples = Path(cwd, "examples")
    if not examples.exists():
        with contextlib.suppress(FileExistsError):  # the other rank made it
            examples.symlink_to(ROOT / "examples")
    os.chdir(cwd)
    namespace = {"__name__": "__doc__"}
    try:
        for i, code in enumerate(_blocks(page, world_size)):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(code, f"<{page} block {i}>", "exec"), namespace)
            except BaseException:
                return traceback.format_exc()
        return ""
    finally:
        os.chdir(here)


def test_every_page_is_here():
    assert {"README.md", "docs/sharding.md", "docs/launch.md"} <= set(PAGES)
    assert sum(len(_blocks(p)) for p in PAGES) > 40


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, tmp_path):
    assert _run_page(page, str(tmp_path)) == ""


MESH_PAGES = [p for p in PAGES if any("Mesh(" in b for b in _blocks(p, world_size=2))]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("page", MESH_PAGES)
def test_python_blocks_run_on_two_ranks(page, tmp_path):
    """Both ranks run the page in one folder (a checkpoint path is the same
    on every rank, as `save` asks)."""
    for rank, failure in enumerate(run_ranks(_run_page, page, str(tmp_path), 2, world_size=2)):
        assert failure == "", f"rank {rank}:\n{failure}"
