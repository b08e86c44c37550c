"""The job reaper on a real kernel (issue 33 item 3): a job whose cgroup empties with no word
from its `nodeagent exec` (killed, or gone with the machine's session) is forgotten by the
loop itself: its cgroup removed, its record gone, its GPU hold returned. The GPUs are a
simulated node (a labelled fake, gpu.simulate); the jobs' processes are real.

Each job is launched as `nodeagent exec` launches it, by this process, which then never
says the job ended (DELETE /v1/jobs), as an exec killed with its command would not: only
the reaper can end the job. Its child is a stand-in for exec's own
(`nodeagent.cli.exec._child`, which imports the CLI: under TCG on a busy host it did not
reach its exec within 120 s): it waits for the daemon's go on a pipe, then execs the
command, a failed exec exiting 127 (not found) or 126 (not executable) as _child's does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, agent, read, rel, running, spec, wait_for

from nodeagent.api import client
from nodeagent.api.answers import GpuGrant, StartedJob
from nodeagent.cli.exec import GO
from nodeagent.daemon import Agent
from nodeagent.policyfile.model import PolicySpec

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml"
REAPED_WITHIN_S = 60.0  # a tick every 0.5 s; generous under TCG on a busy host
CHILD = """\
import os, sys
if not sys.stdin.buffer.read().startswith(b"1"):
    os._exit(125)
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as e:
    sys.stderr.write(f"{sys.argv[1]}: {e.strerror}\\n")
    os._exit(126 if isinstance(e, PermissionError) else 127)
"""
"""Waits for the go on its stdin (the pipe), then execs its arguments (stdlib only: starts
at once)."""


def policy_for(cgroup_sandbox: Path, tmp_path: Path) -> PolicySpec:
    node = tmp_path / "idle-node.yaml"  # the shipped node without its busy processes
    node.write_text(NODE.read_text().split("\nprocesses:")[0] + "\n")
    return spec(
        rel(cgroup_sandbox) + "/managed",
        tmp_path,
        agent={"socket": str(tmp_path / "api.sock"), "interval": 0.5},
        tenants={"research": {"shares": 1}},
        jobs={"default_tenant": "research"},
        gpu={"simulate": str(node)},
    )


@pytest.fixture
def policy(cgroup_sandbox: Path, tmp_path: Path) -> PolicySpec:
    return policy_for(cgroup_sandbox, tmp_path)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The jobs' processes this test started; killed and reaped after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def launch(
    policy: PolicySpec,
    children: list[subprocess.Popen[bytes]],
    name: str,
    argv: list[str],
    gpus: int = 0,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start job `name` running argv as `nodeagent exec` does (its GPUs asked for first);
    its process (this process's child) and the daemon's answer."""
    sock = policy.agent.socket
    body: dict[str, Any] = {"name": name}
    if gpus:
        grant = client.post_as(GpuGrant, sock, "/v1/gpus/requests", {"name": name, "count": gpus})
        assert grant.status == "granted", grant
        body["gpu_request"] = grant.id
    go_read, go_write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", CHILD, *argv], stdin=go_read, stderr=subprocess.PIPE
    )
    children.append(child)
    os.close(go_read)
    try:
        started = client.post_as(StartedJob, sock, "/v1/jobs", {**body, "pid": child.pid})
        os.write(go_write, GO + json.dumps(started.env).encode())
    finally:
        os.close(go_write)
    return child, started.model_dump()


def runs(child: subprocess.Popen[bytes], command: str) -> None:
    """Wait until `child` has exec'd `command` (the daemon let it go)."""

    def named() -> bool:
        try:
            return Path(f"/proc/{child.pid}/comm").read_text().strip() == command
        except FileNotFoundError:
            return False

    assert wait_for(named, 60), f"process {child.pid} never exec'd {command}"


def cgroup_of(policy: PolicySpec, name: str) -> Path:
    return Path(ROOT, policy.agent.managed_root, name)


def reaped(a: Agent, policy: PolicySpec, name: str) -> bool:
    """Job `name` forgotten: no record, no cgroup, no GPU hold of its name."""
    return (
        all(j.name != name for j in a.rec.jobs.running())
        and not cgroup_of(policy, name).exists()
        and all(h.owner != name for h in a.rec.gpus.ledger.holds())
    )


def test_a_job_whose_process_died_is_reaped_and_its_gpus_return(
    policy: PolicySpec, children: list[subprocess.Popen[bytes]]
) -> None:
    with running(policy) as a:
        child, job = launch(policy, children, "died", ["sleep", "600"], gpus=2)
        runs(child, "sleep")
        cgroup = cgroup_of(policy, "died")
        assert read(cgroup, "cgroup.procs") == str(child.pid)
        assert [h.owner for h in a.rec.gpus.ledger.holds()] == ["died"]
        assert [h.id for h in a.rec.gpus.ledger.holds()] == [job["gpu_hold"]]
        child.kill()
        assert child.wait(timeout=60) == -9
        assert wait_for(lambda: reaped(a, policy, "died"), REAPED_WITHIN_S), (
            f"not reaped within {REAPED_WITHIN_S:.0f} s:"
            f" jobs {[j.name for j in a.rec.jobs.running()]}, cgroup there: {cgroup.exists()},"
            f" holds {[h.owner for h in a.rec.gpus.ledger.holds()]}"
        )
        assert client.get(policy.agent.socket, "/v1/jobs") == {"jobs": []}


def test_a_job_that_ended_while_the_agent_was_down_is_reaped_at_its_first_tick(
    policy: PolicySpec, children: list[subprocess.Popen[bytes]]
) -> None:
    with running(policy):
        child, job = launch(policy, children, "away", ["sleep", "600"], gpus=1)
        runs(child, "sleep")
    saved = json.loads(Path(policy.agent.state_file).read_text())
    assert [j["name"] for j in saved["jobs"]] == ["away"], "the stopped agent kept its record"
    child.kill()
    child.wait(timeout=60)
    cgroup = cgroup_of(policy, "away")
    assert wait_for(lambda: "populated 0" in read(cgroup, "cgroup.events"), 30), "emptied"

    again = agent(policy)  # restored from the state file; not a tick yet
    assert [j.name for j in again.rec.jobs.running()] == ["away"], "restored: its cgroup is there"
    assert [h.id for h in again.rec.gpus.ledger.holds()] == [job["gpu_hold"]], "its hold restored"
    again.tick()
    assert reaped(again, policy, "away"), (
        f"first tick left jobs {[j.name for j in again.rec.jobs.running()]}, cgroup there:"
        f" {cgroup.exists()}, holds {[h.owner for h in again.rec.gpus.ledger.holds()]}"
    )
    again.save_state()
    saved = json.loads(Path(policy.agent.state_file).read_text())
    assert saved["jobs"] == [] and not saved["gpus"], "and the state file forgets both"


def test_a_job_whose_exec_failed_is_reaped_and_holds_nothing(
    policy: PolicySpec, children: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    not_executable = tmp_path / "script"
    not_executable.write_text("#!/bin/sh\nexit 0\n")
    not_executable.chmod(0o644)
    with running(policy) as a:
        missing, _ = launch(policy, children, "missing", ["no-such-command-anywhere"], gpus=1)
        denied, _ = launch(policy, children, "denied", [str(not_executable)])
        assert missing.wait(timeout=120) == 127, "exec failed: not found"
        assert denied.wait(timeout=120) == 126, "exec failed: not executable"
        assert (
            missing.stderr is not None
            and b"no-such-command-anywhere: No such file or directory" in (missing.stderr.read())
        )
        for name in ("missing", "denied"):
            assert wait_for(partial(reaped, a, policy, name), REAPED_WITHIN_S), (
                f"{name} not reaped within {REAPED_WITHIN_S:.0f} s: jobs"
                f" {[j.name for j in a.rec.jobs.running()]}, cgroup there:"
                f" {cgroup_of(policy, name).exists()},"
                f" holds {[h.owner for h in a.rec.gpus.ledger.holds()]}"
            )
        assert not a.rec.gpus.ledger.holds() and not a.rec.gpus.ledger.queue(), "nothing held"
