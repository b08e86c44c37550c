"""The daemon's command: run the reconcile loop."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from nodeagent.cli.common import load, log_format_option
from nodeagent.errors import NodeagentError

if TYPE_CHECKING:
    from nodeagent.report import TickRecord


def metrics_refused(listen: str | None) -> str | None:
    """Why this process cannot serve metrics at `listen`, found by trying what listening
    needs first: a socket of its address family. Under the shipped unit
    (RestrictAddressFamilies=AF_UNIX) an AF_INET socket is refused, and the daemon would
    exit at start into a Restart= loop; `validate`, its ExecStartPre=, says so instead.
    None when it can (or `listen` is not a TCP address this knows)."""
    import errno
    import socket

    from nodeagent.policyfile.listen import parse_listen

    if listen is None:
        return None
    try:
        host, _ = parse_listen(listen)
    except ValueError:
        return None  # another kind of address: its server checks it
    family, name = (socket.AF_INET6, "AF_INET6") if ":" in host else (socket.AF_INET, "AF_INET")
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as e:
        if e.errno not in (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES):
            return None
        unit = (
            "install systemd/nodeagent.service.d/metrics.conf"
            " (nodeagent unit --install --metrics), then restart nodeagent"
            if os.environ.get("INVOCATION_ID")
            else "allow it, or set agent.metrics.listen: null"
        )
        return (
            f"agent.metrics.listen {listen}: this process may not open {name} sockets"
            f" ({e.strerror}; a systemd unit's RestrictAddressFamilies= does that): {unit}"
        )
    return None


@click.command()
@click.option("--config", "-c", "config", required=True, metavar="FILE", help="Policy YAML.")
@click.option("--cgroup-root", default="/sys/fs/cgroup", show_default=True, metavar="DIR")
@click.option("--proc-root", default="/proc", show_default=True, metavar="DIR")
@click.option("--once", is_flag=True, help="Run one tick, then exit.")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing to any cgroup.")
@click.option("--interval", type=click.FloatRange(min=0.05), help="Seconds between ticks.")
@click.option("--socket", metavar="PATH", help="API socket (default: agent.socket in the policy).")
@click.option("--state-file", metavar="PATH", help="Default: agent.state_file in the policy.")
@click.option("--no-api", is_flag=True, help="Do not serve the local API.")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@log_format_option
def run(
    *,
    config: str,
    cgroup_root: str,
    proc_root: str,
    once: bool,
    dry_run: bool,
    interval: float | None,
    socket: str | None,
    state_file: str | None,
    no_api: bool,
    log_level: str,
    log_format: str,
) -> None:
    """Run the reconcile loop: discover workloads, apply the policy, serve the API.

    Needs root and a cgroup v2 hierarchy with the cpu and memory controllers;
    it checks both first and exits with a one-line error, writing nothing,
    when either is missing. SIGHUP reloads the policy file; a bad file is
    reported and the last good policy stays in force.
    """
    from nodeagent import logs
    from nodeagent.cgroupfs.detect import detect
    from nodeagent.cgroupfs.tree import CgroupTree
    from nodeagent.daemon import open_agent, serve, serve_metrics
    from nodeagent.sense.sensor import raise_fd_limit

    logs.configure(log_level, log_format)
    spec = load(config)
    overrides = {
        k: v
        for k, v in {"interval": interval, "socket": socket, "state_file": state_file}.items()
        if v is not None
    }
    host = detect(cgroup_root, proc_root)
    if os.environ.get("INVOCATION_ID") and not dry_run:
        _warn_if_workloads_die_with_the_unit(spec.agent.managed_root, proc_root)
    if not dry_run and os.geteuid() != 0:
        raise NodeagentError("nodeagent run writes cgroup files and needs root (or use --dry-run)")
    raise_fd_limit()  # before the sensor sizes its cache of open directories
    refused = None if once else metrics_refused(spec.agent.metrics.listen)
    if refused is not None:
        raise NodeagentError(refused)
    agent = open_agent(
        spec,
        CgroupTree(host.root),
        proc_root=proc_root,
        dry_run=dry_run,
        config_path=config,
        overrides=overrides,
    )
    agent.install_signal_handlers()
    agent.prepare()
    metrics = None if once else serve_metrics(agent)
    if not once:
        agent.commands.bind()  # before the API serves: its commands wait for the loop
    server = None if no_api or once else serve(agent)
    try:
        ok = agent.run(once=once, on_tick=_plan_printer() if dry_run else None)
    finally:
        if server is not None:
            server.close()
        if metrics is not None:
            metrics.close()
    if once and not ok:
        raise NodeagentError("the tick failed (see tick.failed in the log above)")


def _warn_if_workloads_die_with_the_unit(managed_root: str, proc_root: str) -> None:
    """Under systemd, a managed root inside the agent's own unit ends every job with each
    restart of the agent: say where it belongs."""
    import structlog

    from nodeagent.cgroupfs.subtree import own_cgroup

    own = own_cgroup(proc_root)
    if own and managed_root.startswith(own + "/"):
        structlog.get_logger("nodeagent").warning(
            "managed_root.inside_the_agents_unit",
            managed_root=managed_root,
            unit_cgroup=own,
            action="its workloads end whenever the agent restarts; use"
            " system.slice/nodeagent-workloads.service/workloads (docs/service.md)",
        )


def _plan_printer() -> Callable[[TickRecord], None]:
    """Dry-run: print the plan after the first tick and whenever it changes."""
    from nodeagent.cli.inspection import allocations_table
    from nodeagent.report import allocations

    shown: list[object] = []

    def show(record: TickRecord) -> None:
        key = [
            (c.path, sorted((str(a), t.render()) for a, t in c.targets.items()))
            for c in record.plan.cgroups
        ]
        if shown != [key]:
            shown[:] = [key]
            click.echo(allocations_table(allocations(record)))
            click.echo()
            sys.stdout.flush()

    return show
