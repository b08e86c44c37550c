"""Under systemd with Delegate=yes the agent starts inside the cgroup above its managed root.

The no-internal-processes rule forbids enabling controllers in a cgroup that holds processes,
so the agent moves itself into a leaf, `<own cgroup>/agent`, before preparing the subtree.
This test puts the test process itself where systemd would start the service.
"""

from __future__ import annotations

from pathlib import Path

from helpers import ROOT, agent, read, rel, spec


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
