"""`nodeagent release`: hand back every freeze and cap the agent made (like `tuned-adm off`)."""

from __future__ import annotations

import os
import sys

import click

from nodeagent.cli.common import json_option, load, log_format_option
from nodeagent.cli.output import document, echo_json, report
from nodeagent.errors import NodeagentError

DEFAULT_CONFIG = "/etc/nodeagent/policy.yaml"


@click.command()
@click.argument("cgroups", nargs=-1, metavar="[CGROUP]...")
@click.option("--all", "everything", is_flag=True, help="Every cgroup the agent changed.")
@click.option(
    "--config",
    "-c",
    "config",
    default=DEFAULT_CONFIG,
    show_default=True,
    metavar="FILE",
    help="The policy the agent ran with: its state file, managed root and systemd settings.",
)
@click.option("--cgroup-root", default="/sys/fs/cgroup", show_default=True, metavar="DIR")
@click.option("--state-file", metavar="PATH", help="Default: agent.state_file in the policy.")
@click.option(
    "--on-stop",
    "unit",
    metavar="UNIT",
    help="As UNIT's ExecStopPost=: release only when UNIT is stopped for good (not restarted,"
    " not failed with Restart= to follow).",
)
@json_option
@log_format_option
def release(
    *,
    cgroups: tuple[str, ...],
    everything: bool,
    config: str,
    cgroup_root: str,
    state_file: str | None,
    unit: str | None,
    as_json: bool,
    log_format: str,
) -> None:
    """Hand back what the stopped agent changed: each value it wrote goes back to what the
    attribute held before (a frozen cgroup is thawed, a cap lifted), where it still holds
    what the agent set. Cgroups systemd owns are handed back through systemd. Workloads keep
    running. The state file records what to hand back; it is updated after.

    Refused while the daemon runs (it would apply its policy again at its next tick).
    `systemctl stop nodeagent` and `systemctl disable --now nodeagent` run it by themselves,
    `systemctl restart nodeagent` does not.

    \b
    Examples:
      nodeagent release --all                 everything the agent changed
      nodeagent release system.slice/docker-0123abcd.scope
      nodeagent release --all --json
    """
    from nodeagent import logs, state
    from nodeagent.cgroupfs.tree import CgroupTree
    from nodeagent.logs import audit_write
    from nodeagent.policyfile.model import AgentSettings
    from nodeagent.release import pending_job, release, stopped_for_good, summary
    from nodeagent.sdbus import Systemd

    if everything == bool(cgroups):
        raise click.UsageError("name the cgroups to release, or pass --all (not both)")
    logs.configure("info", log_format)
    if unit is not None:
        go, why = stopped_for_good(pending_job(unit), os.environ.get("SERVICE_RESULT"))
        if not go:
            _say(as_json, log_format, f"nodeagent release: {unit}: {why}", skipped=why)
            return
    try:
        agent = load(config).agent
    except click.ClickException as e:
        # as ExecStopPost= of a stop with a broken policy file, a refusal here would leave
        # every freeze and cap in place after the agent has gone
        agent = AgentSettings()
        where = state_file or agent.state_file
        report(
            log_format,
            "release.policy_unusable",
            f"nodeagent release: {e.message.splitlines()[0]}; handing back with the default"
            f" agent settings (state file {where})",
            level="warning",
            file=config,
            state_file=where,
        )
    path = state_file or agent.state_file
    if unit is None:  # as ExecStopPost= the agent is gone, but its socket file may be left
        _refuse_while_running(agent.socket, path)
    saved = state.load(path)
    if saved is None:
        text = f"nodeagent release: no state file {path}: nothing to hand back"
        _say(as_json, log_format, text, skipped="no state file", state_file=path)
        return
    with Systemd() as systemd:
        results, after = release(
            CgroupTree(cgroup_root),
            saved,
            managed_root=agent.managed_root,
            settings=agent,
            units=systemd,
            audit=audit_write,
            only=None if everything else list(cgroups),
        )
    state.save(path, after)
    counts = summary(results)
    if as_json:
        body = {"skipped": None, "state_file": path, "results": [r.to_json() for r in results]}
        echo_json(document("Release", body))
    else:
        for r in results:
            change = f"{r.now} -> {r.to}" if r.outcome == "released" else (r.now or "")
            line = f"{r.outcome:<9} {r.cgroup}  {r.attribute} {change}".rstrip()
            line += f"  ({r.detail})" if r.detail else ""
            report(log_format, "release.result", line, **r.to_json())
        told = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        text = f"nodeagent release: {told or 'nothing recorded to hand back'}; {path} updated"
        report(log_format, "release.done", text, state_file=path, counts=dict(counts))
    if counts.get("failed"):
        sys.exit(1)


def _refuse_while_running(socket: str, state_file: str) -> None:
    """NodeagentError when a daemon answers on `socket`, even with an answer we do not know,
    or when one runs on `state_file` (one run with --no-api or --socket elsewhere answers on
    no socket the policy names: nodeagent.running)."""
    from nodeagent import running
    from nodeagent.api import client
    from nodeagent.api.answers import Status

    if running.held(state_file):
        raise NodeagentError(
            f"nodeagent is running on {state_file} (it holds a lock on"
            f" {running.lock_path(state_file)}):"
            " it would apply its policy again at its next tick; stop it first"
            " (systemctl stop nodeagent releases by itself)"
        )
    try:
        status = client.get(socket, "/v1/status", timeout=2)
    except NodeagentError:
        return
    try:
        pid = str(client.fit(Status, socket, "/v1/status", status).pid)
    except NodeagentError:
        pid = "?"
    raise NodeagentError(
        f"nodeagent is running (pid {pid}, {socket}): it would apply its policy again at its"
        " next tick; stop it first (systemctl stop nodeagent releases by itself)"
    )


def _say(as_json: bool, log_format: str, line: str, **why: str) -> None:
    """Why nothing was handed back: the Release document, or one line."""
    if as_json:
        echo_json(document("Release", {"skipped": why["skipped"], "results": [], **why}))
    else:
        report(log_format, "release.skipped", line, **why)
