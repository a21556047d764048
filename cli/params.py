"""What `qm`'s commands share: the gateway options, `--json`, paths and ordered groups.

`qm` is built on click alone. Its commands are decorated functions; the group in cli.main
imports a command's module only when that command (or the full help) is asked for, so
`qm list` loads the job commands and nothing else (tests/unit/cli/test_startup.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class OrderedGroup(click.Group):
    """A group whose help lists its commands in the order they were defined (click sorts
    them): `qm rollout --help` shows status, pause, resume, undo."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def gateway_options(fn: F) -> F:
    """``--gateway`` and ``--token`` (or QM_GATEWAY_URL and QM_TOKEN), as ``url`` and ``token``."""
    fn = click.option(
        "--token", "token", envvar="QM_TOKEN", show_envvar=True, help="Bearer token."
    )(fn)
    fn = click.option(
        "--gateway", "url", envvar="QM_GATEWAY_URL", show_envvar=True, help="Gateway URL."
    )(fn)
    return fn


def json_option(fn: F) -> F:
    """``--json``, as ``as_json``."""
    return click.option("--json", "as_json", is_flag=True, help="Print the raw JSON answer.")(fn)


def path_type(*, exists: bool = False, dir_okay: bool = True) -> click.Path:
    """A path parameter that reaches the command as a ``pathlib.Path``."""
    return click.Path(exists=exists, dir_okay=dir_okay, path_type=Path)
