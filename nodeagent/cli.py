"""The nodeagent command line: run the daemon, and inspect and explain what it does."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import click

from nodeagent.api import client
from nodeagent.errors import NodeagentError
from nodeagent.tables import SHOWN, change, cores, size, table

if TYPE_CHECKING:
    from nodeagent.report import TickRecord
    from nodeagent.spec.model import PolicySpec

# Commands import what they need when they run: the read commands (allocations, explain)
# stay light, which matters where Python's imports are slow (a VM's shared filesystem).

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SOCKET = client.DEFAULT_SOCKET


def _socket_option(f: F) -> F:
    return click.option(
        "--socket",
        envvar="NODEAGENT_SOCKET",
        default=DEFAULT_SOCKET,
        show_default=True,
        help="The daemon's API socket (env NODEAGENT_SOCKET).",
    )(f)


def _json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def _load(path: str) -> PolicySpec:
    from nodeagent.spec.load import PolicyError, load_policy

    try:
        return load_policy(path)
    except PolicyError as e:
        raise click.ClickException(str(e)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nodeagent")
def main() -> None:
    """Set cgroup v2 CPU and memory controls for this host's workloads from a policy file.

    \b
    Start here:
      nodeagent validate config/policy.yaml     check a policy file
      nodeagent workloads --config FILE         what discovery finds, and which rule claims it
      nodeagent run --config FILE --dry-run     print the plan, write nothing
      nodeagent run --config FILE               the daemon (as root, on cgroup v2)
      nodeagent allocations                     what the daemon set, and why
      nodeagent explain CGROUP                  the full policy trace for one workload
    """


@main.command()
@click.argument("file", type=click.Path(dir_okay=True))
def validate(file: str) -> None:
    """Check a policy FILE; print FILE:LINE:COL: message for every problem.

    Exits 0 when the file is valid, 1 otherwise.
    """
    from nodeagent.spec.load import PolicyError, load_policy

    try:
        spec = load_policy(file)
    except PolicyError as e:
        click.echo(str(e), err=True)
        sys.exit(1)
    click.echo(f"{file}: ok ({len(spec.tenants)} tenants, {len(spec.rules)} rules)")


@main.command()
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
    from nodeagent.daemon import Agent, serve

    logs.configure(log_level)
    spec = _load(config)
    overrides = {
        k: v
        for k, v in {"interval": interval, "socket": socket, "state_file": state_file}.items()
        if v is not None
    }
    host = detect(cgroup_root, proc_root)
    if not dry_run and os.geteuid() != 0:
        raise NodeagentError("nodeagent run writes cgroup files and needs root (or use --dry-run)")
    agent = Agent(
        spec,
        CgroupTree(host.root),
        proc_root=proc_root,
        dry_run=dry_run,
        config_path=config,
        overrides=overrides,
    )
    agent.install_signal_handlers()
    agent.prepare()
    server = None if no_api or once else serve(agent)
    try:
        agent.run(once=once, on_tick=_plan_printer() if dry_run else None)
    finally:
        if server is not None:
            server.close()


def _plan_printer() -> Callable[[TickRecord], None]:
    """Dry-run: print the plan after the first tick and whenever it changes."""
    from nodeagent.report import allocations

    shown: list[object] = []

    def show(record: TickRecord) -> None:
        key = [
            (c.path, sorted((str(a), t.render()) for a, t in c.targets.items()))
            for c in record.plan.cgroups
        ]
        if shown != [key]:
            shown[:] = [key]
            click.echo(_allocations_table(allocations(record)))
            click.echo()
            sys.stdout.flush()

    return show


def _allocations_table(data: Mapping[str, Any]) -> str:
    rows = []
    for a in data["allocations"]:
        v = a["values"]
        rows.append(
            (
                a["cgroup"] + ("" if a["writable"] else " (read-only)"),
                a["tenant"],
                a["class"],
                change(v["cpu.weight"]["current"], v["cpu.weight"]["target"]),
                change(v["cpu.max"]["current"], v["cpu.max"]["target"]),
                change(size(v["memory.max"]["current"]), size(v["memory.max"]["target"])),
                change(size(v["memory.high"]["current"]), size(v["memory.high"]["target"])),
                cores(a["cpu_rate"]),
                a["reason"],
            )
        )
    mode = " (dry run: nothing written)" if data["dry_run"] else ""
    head = f"tick {data['tick']}{mode}: {len(rows)} workloads; OLD->NEW where the kernel differs"
    headers = (
        "CGROUP",
        "TENANT",
        "CLASS",
        "CPU.WEIGHT",
        "CPU.MAX",
        "MEM.MAX",
        "MEM.HIGH",
        "CPU",
        "REASON",
    )
    return head + "\n" + table(headers, rows)


@main.command("allocations")
@_socket_option
@_json_option
def allocations_cmd(socket: str, as_json: bool) -> None:
    """What the daemon set on each workload, the measured CPU (cores), and why.

    Values show OLD->NEW where the kernel still holds something else than the
    plan: in a dry run, for cgroups owned by systemd (read-only for now), or
    when a write failed.
    """
    data = client.get(socket, "/v1/allocations")
    assert isinstance(data, dict)
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else _allocations_table(data))


@main.command()
@click.argument("cgroup")
@_socket_option
@_json_option
def explain(cgroup: str, socket: str, as_json: bool) -> None:
    """The policy trace that produced CGROUP's values.

    CGROUP is a path relative to the cgroup root, an absolute path, a workload
    name or a container-id prefix.
    """
    data = client.get(socket, "/v1/explain", {"cgroup": cgroup})
    assert isinstance(data, dict)
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    lines = [
        f"{data['cgroup']}  ({data['kind']}, {data['runtime']}, owner {data['owner']}"
        + ("" if data["writable"] else ", read-only")
        + ")",
        f"  rule {data['rule']}  tenant {data['tenant']}  class {data['class']}",
        f"  cpu now: {cores(data['cpu_rate'])} cores   (tick {data['tick']}"
        + (", dry run" if data["dry_run"] else "")
        + ")",
        "values:",
    ]
    for attr in SHOWN:
        v = data["values"][attr]
        if v["target"] is not None or v["current"] is not None:
            why = f"  [{v['policy']}] {v['reason']}" if v["policy"] else ""
            lines.append(f"  {attr:<12} {change(v['current'], v['target'])}{why}")
    if data["sensed"]:
        lines.append("sensed this tick:")
        lines.extend(f"  {k:<28} {v}" for k, v in data["sensed"].items() if v not in (None, {}))
    lines.append("trace:")
    lines.extend(f"  {t}" for t in data["trace"])
    for w in data["writes"]:
        lines.append(
            f"last tick: {w['attribute']} {w['old']}->{w['new']}: {w['outcome']} {w['detail']}"
        )
    click.echo("\n".join(lines))


@main.command()
@click.option("--cgroup-root", default="/sys/fs/cgroup", show_default=True, metavar="DIR")
@click.option("--config", "-c", "config", metavar="FILE", help="Also show each workload's rule.")
@_json_option
def workloads(cgroup_root: str, config: str | None, as_json: bool) -> None:
    """List the workload cgroups discovery finds, reading the tree directly (no daemon)."""
    from nodeagent.cgroupfs.tree import CgroupTree
    from nodeagent.discovery.registry import Registry
    from nodeagent.policy.base import describe
    from nodeagent.policy.classify import assign
    from nodeagent.spec.model import AgentSettings

    spec = _load(config) if config else None
    managed_root = spec.agent.managed_root if spec else AgentSettings().managed_root
    if not os.path.isdir(cgroup_root):
        raise NodeagentError(f"cgroup root {cgroup_root} is not a directory")
    registry = Registry(CgroupTree(cgroup_root), managed_root, watch=False)
    registry.resync()
    found = sorted(registry.identities(), key=lambda i: i.path)
    assigned = assign(found, spec) if spec else {}
    rows: list[dict[str, Any]] = [describe(i, assigned.get(i.path)) for i in found]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    headers = ("CGROUP", "KIND", "RUNTIME", "OWNER", "ID", "POD", "QOS", "TENANT", "CLASS")
    click.echo(
        table(
            headers,
            [
                (
                    r["cgroup"],
                    r["kind"],
                    r["runtime"],
                    f"{r['owner']}" + ("" if r["writable"] else " (read-only)"),
                    (r["container_id"] or "")[:12] or None,
                    r["pod_uid"],
                    r["qos"],
                    r["tenant"],
                    r["class"],
                )
                for r in rows
            ],
        )
    )


def entrypoint() -> None:
    """Console script: one-line errors for everything an operator can get wrong."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except NodeagentError as e:
        click.echo(f"nodeagent: error: {e}", err=True)
        sys.exit(1)
