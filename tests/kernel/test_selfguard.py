"""The agent never caps or freezes the cgroup it runs in, on a real kernel: `nodeagent run
--once`, started inside a workload its policy caps, leaves its own cgroup's cpu.max as it
was and caps the one beside it. Twice: as a service runs (its path in /proc/self/cgroup)
and in a cgroup namespace of its own, as in a pod, where /proc/self/cgroup says `/` and
the agent finds its cgroup by its own process in the tree's cgroup.procs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, read, sleeper


# the pod's case in every run (the path /proc gives is the unit tests' too); the service's in
# the nightly tier: each costs an agent's start under TCG, about a minute
@pytest.mark.parametrize("namespace", [pytest.param("none", marks=pytest.mark.nightly), "cgroup"])
def test_the_agent_never_caps_the_cgroup_it_runs_in(
    managed: str, tmp_path: Path, namespace: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    root = Path(ROOT, managed)
    root.mkdir()
    own, other = root / "agent-here", root / "beside"
    own.mkdir()
    other.mkdir()
    procs.append(sleeper(other))
    config = tmp_path / "policy.yaml"
    config.write_text(
        f"version: 1\nagent: {{managed_root: {managed}, state_file: {tmp_path}/state.json}}\n"
        "tenants: {a: {shares: 1}}\n"
        "rules: [{name: all, match: {}, tenant: a, limits: {cpu_max: 0.05}}]\n"
    )
    run = ["nodeagent", "run", "--once", "--config", str(config), "--log-level", "warning"]
    if namespace == "cgroup":
        run = ["unshare", "--cgroup", "--", *run]
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    agent = subprocess.Popen(["sh", "-c", enter, str(own), *run], stderr=subprocess.PIPE, text=True)
    _, err = agent.communicate(timeout=600)
    assert agent.returncode == 0, err
    assert read(other, "cpu.max") == "5000 100000", "the workload beside it is capped"
    assert read(own, "cpu.max") == "max 100000", "its own cgroup is not"
    said = [json.loads(line) for line in err.splitlines() if "own_cgroup_guarded" in line]
    assert [(e["cgroup"], e["attribute"], e["value"]) for e in said] == [
        (f"{managed}/agent-here", "cpu.max", "5000 100000")
    ], err
    if namespace == "cgroup":
        assert "the agent's process" in said[0]["problem"], said
    else:
        assert f"the agent runs in {managed}/agent-here" in said[0]["problem"], said
