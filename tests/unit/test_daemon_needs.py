"""What the daemon's lean read takes for each workload, for the policies in use."""

from __future__ import annotations

from pathlib import Path

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent
from nodeagent.sense.cgroup_files import Needs
from nodeagent.spec.model import PolicySpec


def test_a_deadline_job_a_rule_claims_is_read_for_its_processes_every_tick(
    tmp_path: Path,
) -> None:
    """A rule's deadline job is 'waiting' until it holds a process: cgroup.events must be
    read every tick, or it stays waiting (and its threads uncounted) until its next full
    read, while the earlier deadlines are planned without it (seen in the VM)."""
    root = tmp_path / "cgroup"
    (root / "nodeagent.slice" / "d-a").mkdir(parents=True)
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "tenants": {"t": {"shares": 1}},
            "rules": [
                {
                    "name": "d",
                    "match": {"name": "d-*"},
                    "tenant": "t",
                    "deadline": "2030-01-01T00:00:00Z",
                    "work": 10,
                },
            ],
        }
    )
    agent = Agent(spec, CgroupTree(str(root)))
    agent.registry.resync()
    identities = agent.registry.identities()
    assignments, managed, _, _ = agent._claimed(identities, {})
    needs = agent._needs(assignments, managed)
    assert needs["nodeagent.slice/d-a"] == Needs(events=True, pressure=True, threads=True)
