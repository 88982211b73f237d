"""The command lines' one error for a bad setting: its message on one line
(``Error: ...``) and exit status 2, as for a bad option — no traceback."""

from __future__ import annotations

import click

__all__ = ["BadSetting"]


class BadSetting(click.ClickException):
    """A setting or input a command refuses (exit status 2).

    >>> BadSetting("--mesh dp=3 needs 3 ranks").exit_code
    2
    """

    exit_code = 2
