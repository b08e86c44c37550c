"""What the commands share: the socket, --json and --log-format options, and loading a policy
file."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from nodeagent.journal import FORMATS
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


def log_format_option(f: F) -> F:
    """--log-format, for the commands a unit runs (run; validate, reload and release as its
    ExecStartPre=, ExecReload= and ExecStopPost=): one setting, NODEAGENT_LOG_FORMAT in the
    unit's environment, makes all their lines alike."""
    return click.option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="auto",
        show_default=True,
        envvar="NODEAGENT_LOG_FORMAT",
        help="journal: native journal entries, a readable MESSAGE and every field as"
        " NODEAGENT_<KEY>; json: one JSON object a line, for log shippers; console: for a"
        " person. auto: the daemon's log goes to the journal when stderr is the journal,"
        " to a terminal as console, anywhere else as json; the other commands' lines stay"
        " text unless json is asked for (env NODEAGENT_LOG_FORMAT).",
    )(f)


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
