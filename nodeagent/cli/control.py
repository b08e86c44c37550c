"""`nodeagent reload` and `nodeagent status`: the running daemon, asked through its API.

`reload` is what the unit's ExecReload= runs: the daemon reads its policy file itself, on its
loop's thread, so that a file it refuses fails `systemctl reload` with the daemon's own
problems, shows as 0 in nodeagent_config_last_reload_successful, and leaves the last good
policy in force; a validate run beforehand would refuse the file without the daemon ever
knowing, and the metric (and its alert) would never say so.

Both take `--config FILE` to find the daemon of that policy: its `agent.socket`, read
leniently, since the file may be the broken one whose reload is to be refused.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from nodeagent.cli.common import json_option, log_format_option
from nodeagent.cli.output import counted, document, echo_json, renamed, report
from nodeagent.errors import NodeagentError
from nodeagent.policyfile.listen import DEFAULT_SOCKET
from nodeagent.tables import age, fold, printable

if TYPE_CHECKING:
    from nodeagent.api.answers import Status

F = TypeVar("F", bound=Callable[..., Any])
RELOAD_TIMEOUT = 35.0
"""Seconds for the whole reload call: the daemon runs it between two ticks and gives up
after 30 s (nodeagent.commands), whose 503 should be what the CLI shows."""
LABEL = 14
"""The status block's labels' column."""


def _daemon_options(f: F) -> F:
    """--socket and --config, as reload and status take them (see `daemon_socket`)."""
    f = click.option(
        "--config",
        "-c",
        "config",
        metavar="FILE",
        help="The daemon's policy file: its agent.socket is the socket asked.",
    )(f)
    return click.option(
        "--socket",
        envvar="NODEAGENT_SOCKET",
        metavar="PATH",
        help=f"The daemon's API socket (env NODEAGENT_SOCKET; default: agent.socket in"
        f" --config, else {DEFAULT_SOCKET}).",
    )(f)


def daemon_socket(socket: str | None, config: str | None) -> str:
    """The socket to ask: --socket (or NODEAGENT_SOCKET), else `agent.socket` in --config,
    else the default. The file is read leniently: a policy with problems elsewhere (the one a
    reload is to refuse) still names its daemon's socket."""
    if socket:
        return socket
    if config is None:
        return DEFAULT_SOCKET
    import yaml

    from nodeagent.policyfile.yamlfile import PolicyError, read_text

    try:
        data = yaml.safe_load(read_text(config, "a policy"))
    except (PolicyError, yaml.YAMLError):
        return DEFAULT_SOCKET
    agent = data.get("agent") if isinstance(data, dict) else None
    found = agent.get("socket") if isinstance(agent, dict) else None
    return found if isinstance(found, str) and found else DEFAULT_SOCKET


@click.command()
@_daemon_options
@json_option
@log_format_option
def reload(socket: str | None, config: str | None, as_json: bool, log_format: str) -> None:
    """Have the running daemon re-read its policy file, and say whether it applied it.

    The daemon reads the file itself: a file it refuses is listed here as
    FILE:LINE:COL: message (or names the settings only a restart applies), the
    command exits 1, and the daemon keeps its last good policy (the metric
    nodeagent_config_last_reload_successful reads 0). Exits 0 when the file is
    in force. The unit's ExecReload= runs it (systemctl reload nodeagent). Root
    only. With --config, the daemon must run with that FILE. --json: kind
    PolicyReload, on stdout in both cases.

    \b
    Examples:
      sudo nodeagent reload --config /etc/nodeagent/policy.yaml
      sudo nodeagent reload --json
    """
    from nodeagent.api import client
    from nodeagent.api.answers import Reloaded

    where = daemon_socket(socket, config)
    body = {} if config is None else {"file": os.path.abspath(config)}
    try:
        done = client.post_as(Reloaded, where, "/v1/reload", body, timeout=RELOAD_TIMEOUT)
    except client.ApiRefused as e:
        if e.status != 409:  # not root, another file, no file: one line, as any error
            raise
        problems = [printable(line) for line in e.lines]
        if as_json:
            echo_json(_reload_document(config, False, None, problems))
            sys.exit(1)
        # as ExecReload=, each problem is filed at priority err (`journalctl -p err`)
        for line in problems:
            report(log_format, "policy.invalid", line, level="error", file=config)
        raise NodeagentError(
            f"the daemon on {where} refused the file ({counted(len(problems), 'problem')},"
            " above) and keeps its last good policy"
        ) from None
    if as_json:
        echo_json(_reload_document(done.file, True, done, []))
        return
    found = f"{counted(done.tenants, 'tenant')}, {counted(done.rules, 'rule')}"
    text = f"{printable(done.file)}: reloaded ({found}; sha256 {done.policy_sha256[:12]})"
    report(
        log_format,
        "policy.reloaded",
        text,
        file=done.file,
        tenants=done.tenants,
        rules=done.rules,
        sha256=done.policy_sha256,
    )


def _reload_document(
    file: str | None, applied: bool, done: Any, problems: list[str]
) -> dict[str, Any]:
    return document(
        "PolicyReload",
        {
            "file": file,
            "applied": applied,
            "sha256": None if done is None else done.policy_sha256,
            "tenants": None if done is None else done.tenants,
            "rules": None if done is None else done.rules,
            "timestamp_seconds": None if done is None else done.at,
            "problems": problems,
        },
    )


@click.command()
@_daemon_options
@json_option
def status(socket: str | None, config: str | None, as_json: bool) -> None:
    """Who the running daemon is and what is wrong with it.

    Its version, pid and uptime; the policy in force (file, sha256, when it was
    loaded); the last reload (applied, or refused with its problems); the last
    tick and its age; the workloads and missed deadlines; then its problems:
    services that do not answer (runtimes, Slurm, systemd, the kubelet), a
    refused reload, ticks that stopped. --json: kind AgentStatus.

    Exits 0 when the daemon answers without problems, 1 when it lists problems,
    and 1 with one line on stderr when no daemon answers.

    \b
    Examples:
      nodeagent status
      nodeagent status --json | jq -r '.problems[]'
    """
    from nodeagent.api import client
    from nodeagent.api.answers import Status
    from nodeagent.cli.output import terminal_width

    where = daemon_socket(socket, config)
    answer = client.get_as(Status, where, "/v1/status")
    now = time.time()
    if as_json:
        echo_json(status_document(answer, now))
    else:
        click.echo(status_text(answer, now, terminal_width()))
    if answer.problems:
        sys.exit(1)


def status_document(answer: Status, now: float) -> dict[str, Any]:
    """`status --json`: kind AgentStatus, the answer with units in its keys, and the ages
    the text shows."""
    data = answer.model_dump(by_alias=True)
    body = renamed(
        data,
        {
            "started": "started_timestamp_seconds",
            "tick_time": "tick_timestamp_seconds",
            "policy_loaded": "policy_loaded_timestamp_seconds",
        },
    )
    body["uptime_seconds"] = None if answer.started is None else now - answer.started
    body["tick_age_seconds"] = None if answer.tick_time is None else now - answer.tick_time
    if body.get("last_reload") is not None:
        body["last_reload"] = renamed(body["last_reload"], {"at": "timestamp_seconds"})
    peer_units = {
        "since": "since_timestamp_seconds",
        "last_success": "last_success_timestamp_seconds",
    }
    body["peers"] = [renamed(p, peer_units) for p in body["peers"]]
    return document("AgentStatus", body)


def _at(t: float | None, now: float) -> str:
    """A Unix time in local time, to the second, with its age: '2025-01-02 10:00:00 (5m 2s
    ago)'; '?' from a daemon that does not say it."""
    if t is None:
        return "?"
    local = dt.datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    return f"{local} ({age(now - t)} ago)"


def _reload_line(answer: Status, now: float) -> str:
    r = answer.last_reload
    if r is None:
        return "none since start" if answer.version is not None else "?"
    if r.applied:
        return f"applied {age(now - r.at)} ago"
    return f"refused {age(now - r.at)} ago ({counted(len(r.problems), 'problem')}, below)"


def status_text(answer: Status, now: float, width: int | None = None) -> str:
    """The status as a short aligned block; `width`: each line wider is folded
    (`tables.fold`), nothing cut, its continuation under the value (a problem's under its
    text), a path wider than a line after a `/`."""
    version = answer.version or "? (an older daemon)"
    mode = " (dry run: writes nothing)" if answer.dry_run else ""
    tick = "none yet" if answer.tick is None else str(answer.tick)
    if answer.tick is not None and answer.tick_time is not None:
        tick += f", {age(now - answer.tick_time)} ago"
    rows = [
        ("nodeagent", f"{version}, pid {answer.pid}{mode}"),
        ("started", _at(answer.started, now)),
        ("policy", answer.policy_file or "none (no --config)"),
        ("sha256", answer.policy_sha256 or "?"),
        ("loaded", _at(answer.policy_loaded, now)),
        ("last reload", _reload_line(answer, now)),
        ("last tick", tick),
        ("workloads", f"{answer.workloads} (managed root {answer.managed_root})"),
        ("deadlines", f"{answer.deadline_misses} missed since the start"),
        ("problems", str(len(answer.problems)) if answer.problems else "none"),
    ]
    lines = [fold(printable(f"{label:<{LABEL}}{value}"), width, LABEL) for label, value in rows]
    lines += [fold(f"  - {printable(problem)}", width, 4) for problem in answer.problems]
    return "\n".join(lines)
