"""What the commands share: the socket and --json options, and loading a policy file."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from nodeagent.policyfile.listen import DEFAULT_SOCKET

if TYPE_CHECKING:
    from nodeagent.policyfile.model import PolicySpec

F = TypeVar("F", bound=Callable[..., Any])


def socket_option(f: F) -> F:
    return click.option(
        "--socket",
        envvar="NODEAGENT_SOCKET",
        default=DEFAULT_SOCKET,
        show_default=True,
        help="The daemon's API socket (env NODEAGENT_SOCKET).",
    )(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def wide_option(f: F) -> F:
    return click.option(
        "--wide",
        "--no-trunc",
        "wide",
        is_flag=True,
        help="Every column, full container ids and pod UIDs, nothing cut to the terminal's"
        " width. By default ids are short (as docker ps shows them; explain takes them) and"
        " long cells are cut to fit COLUMNS or the terminal.",
    )(f)


def load(path: str) -> PolicySpec:
    """The policy at `path`, or a ClickException listing every problem as FILE:LINE:COL."""
    from nodeagent.policyfile.load import load_policy
    from nodeagent.policyfile.yamlfile import PolicyError

    try:
        return load_policy(path)
    except PolicyError as e:
        raise click.ClickException(str(e)) from e
