"""``load_config``: a run config from an hjson (or JSON) file."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ._run import RunConfig


def load_config(path: str | Path) -> RunConfig:
    """Read a run config from an hjson (or JSON) file.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "run.hjson"
    >>> _ = path.write_text("steps: 10\\nparallel: {zero: 2}\\n")
    >>> load_config(path).parallel.zero
    2
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {str(path)!r}: {err.strerror or err}") from None
    return RunConfig.from_text(text, str(path))
