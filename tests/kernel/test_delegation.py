"""Under systemd with Delegate=yes the agent starts inside the cgroup above its managed root.

The no-internal-processes rule forbids enabling controllers in a cgroup that holds processes,
so the agent moves itself into a leaf, `<own cgroup>/agent`, before preparing the subtree.
This test puts the test process itself where systemd would start the service. Any other
process above the managed root the agent cannot move: it names that cgroup and its processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, agent, read, rel, sleeper, spec

from nodeagent.errors import NodeagentError


def test_agent_moves_out_of_its_service_cgroup_to_manage_below_it(
    cgroup_sandbox: str, tmp_path: Path
) -> None:
    service = Path(cgroup_sandbox, "nodeagent.service")
    service.mkdir()
    managed = rel(service) + "/workloads"
    Path(service, "cgroup.procs").write_text("0")  # "systemd started us here"
    try:
        agent(spec(managed, tmp_path, tenants={"a": {"shares": 1}}))
        own = Path("/proc/self/cgroup").read_text().strip()
        assert own == f"0::/{rel(service)}/agent"
    finally:
        Path(ROOT, "cgroup.procs").write_text("0")
    assert read(service, "cgroup.procs") == ""
    assert {"cpu", "memory"} <= set(read(service, "cgroup.subtree_control").split())
    assert {"cpu", "memory"} <= set(read(Path(ROOT, managed), "cgroup.subtree_control").split())


def test_a_busy_ancestor_of_the_managed_root_is_named_with_its_processes(
    cgroup_sandbox: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A process in a cgroup above the managed root (not the agent: it cannot move that one)
    makes the kernel refuse the controllers there; the error names the cgroup, the write
    and the processes, and says what to do, before anything below is made."""
    parent = cgroup_sandbox / "busy"
    parent.mkdir()
    procs.append(sleeper(parent))
    managed = rel(parent) + "/workloads"
    with pytest.raises(NodeagentError) as info:
        agent(spec(managed, tmp_path, tenants={"a": {"shares": 1}}))
    # pids too where the parent offers it (nodeagent enables it for jobs' pids.max)
    offered = read(parent, "cgroup.controllers").split()
    wanted = " ".join(f"+{c}" for c in ("cpu", "memory", "pids") if c in offered)
    assert str(info.value) == (
        f"cgroup {rel(parent)}: writing '{wanted}' to cgroup.subtree_control failed:"
        f" Device or resource busy; it holds processes {procs[0].pid}: move them into a leaf"
        " cgroup (no-internal-processes rule)"
    )
    assert not (parent / "workloads").exists()
    assert read(parent, "cgroup.subtree_control") == ""
