"""Leveled updates on a real kernel: a parent is never tighter than its child mid-change.

The cgroup root is injectable, so this test roots the agent at its sandbox and
builds a Kubernetes cgroupfs-driver layout (pod and container, both writable)
inside it.
"""

from __future__ import annotations

from pathlib import Path

from helpers import spec

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent

POD = "kubepods/burstable/pod0b6a1b3e-6f3c-4a57-9b8e-2d6a3f1e9c11"
CONTAINER = POD + "/" + "ab" * 32


def _limits(pod_cores: float, container_cores: float) -> dict[str, object]:
    return {
        "tenants": {"k8s": {"shares": 1}},
        "rules": [
            {
                "name": "pod",
                "match": {"kind": "pod"},
                "tenant": "k8s",
                "limits": {"cpu_max": pod_cores},
            },
            {
                "name": "ctr",
                "match": {"kind": "container"},
                "tenant": "k8s",
                "limits": {"cpu_max": container_cores},
            },
        ],
    }


def test_tightening_goes_bottom_up_and_loosening_top_down(
    cgroup_sandbox: str, tmp_path: Path
) -> None:
    root = Path(cgroup_sandbox)
    path = root
    for part in CONTAINER.split("/"):
        path = path / part
        path.mkdir()
        if path != root / CONTAINER:
            for c in ("cpu", "memory"):
                (path / "cgroup.subtree_control").write_text(f"+{c}")

    agent = open_agent(spec("managed", tmp_path, **_limits(2, 1.5)), CgroupTree(str(root)))
    agent.prepare()
    order: list[tuple[str, str]] = []

    def record(p: str, attribute: str, old: str | None, new: str, reason: str) -> None:
        order.append((str(Path(p).parent.relative_to(root)), new))

    agent.rec.executor.audit = record
    agent.tick()
    assert [o for o in order if o[1] != "100"] == [
        (CONTAINER, "150000 100000"),
        (POD, "200000 100000"),
    ], "tightening from 'max' must write the child before the parent"

    order.clear()
    agent.rec.spec = spec("managed", tmp_path, **_limits(4, 3))
    agent.tick()
    assert order == [(POD, "400000 100000"), (CONTAINER, "300000 100000")], (
        "loosening must write the parent before the child"
    )
    assert (root / POD / "cpu.max").read_text().strip() == "400000 100000"
    assert (root / CONTAINER / "cpu.max").read_text().strip() == "300000 100000"
