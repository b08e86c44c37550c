"""Tenant shares across parents on a real kernel: tenant a's one cgroup with 2 busy
processes in the managed root, tenant b's 4 one-process containers in docker/ (the
cgroupfs driver's layout), and a busy sibling no rule claims. Without the agent the
kernel splits per cgroup at each level; with it the parents are weighted by their
tenants' targets and a:b follows the shares (2:1), within 10%. The sibling keeps the weight
its owner gave it.

The processes run on two CPUs whatever the host has (a cpuset on the sandbox, the rest
reserved for the system in the policy), so that they compete on any host."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import enable_controllers
from helpers import busy, spec, usage_us, wait_for

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent

WINDOW = float(os.environ.get("NODEAGENT_SPLIT_WINDOW", "30"))
CIDS = [f"{i:x}" * 64 for i in range(1, 5)]


@pytest.fixture
def node(cgroup_sandbox: Path) -> Iterator[tuple[Path, dict[str, list[Path]], Path]]:
    """The sandbox as the agent's cgroup root, with the three parents and their work."""
    root = cgroup_sandbox
    a = root / "nodeagent.slice" / "a-1"
    b = [root / "docker" / c[:64] for c in CIDS]
    other = root / "other.slice" / "busy"
    for parent in (root / "nodeagent.slice", root / "docker", root / "other.slice"):
        parent.mkdir()
        enable_controllers(parent)
    procs: list[subprocess.Popen[bytes]] = []
    for c in (a, *b, other):
        c.mkdir()
    procs += [busy(a), busy(a), *(busy(c) for c in b), busy(other)]
    yield root, {"a": [a], "b": b}, other
    for p in procs:
        p.kill()
        p.wait()


def split(cgroups: dict[str, list[Path]], seconds: float) -> dict[str, float]:
    before = {t: sum(usage_us(c) for c in cs) for t, cs in cgroups.items()}
    time.sleep(seconds)
    return {t: (sum(usage_us(c) for c in cs) - before[t]) / 1e6 for t, cs in cgroups.items()}


OTHERS_WEIGHT = "77"
"""Set by the sibling's owner, not the kernel's default: a write of any weight would show."""


def test_tenant_split_holds_across_parents(
    two_cpus: float, node: tuple[Path, dict[str, list[Path]], Path], tmp_path: Path
) -> None:
    root, cgroups, other = node
    (root / "other.slice" / "cpu.weight").write_text(OTHERS_WEIGHT)
    time.sleep(1)
    without = split(cgroups, 10)
    ratio_without = without["a"] / without["b"]

    policy = spec(
        "nodeagent.slice",
        tmp_path,
        fair_share={"active_threshold": 0},
        node={"reserved_cpu": two_cpus},
        tenants={"a": {"shares": 2}, "b": {"shares": 1}},
        rules=[
            {"name": "a", "match": {"path": "nodeagent.slice/a-*"}, "tenant": "a"},
            {"name": "b", "match": {"runtime": "docker"}, "tenant": "b"},
        ],
    )
    agent = open_agent(policy, CgroupTree(str(root)))
    agent.prepare()
    loop = threading.Thread(target=agent.run, daemon=True)
    loop.start()
    try:
        assert wait_for(lambda: agent.last is not None and agent.last.snapshot.seq >= 3, 60)
        with_agent = split({**cgroups, "other": [other]}, WINDOW)
        record = agent.last
    finally:
        agent.stop.set()
        loop.join(timeout=10)
    ratio = with_agent["a"] / with_agent["b"]
    weights = {
        p: (root / p / "cpu.weight").read_text().strip()
        for p in ("nodeagent.slice", "docker", "other.slice")
    }
    print(f"a:b without the agent {ratio_without:.2f} {without}")
    print(f"a:b with the agent {ratio:.2f} {with_agent}; parent weights {weights}")
    assert ratio_without < 1.5, f"the kernel splits per parent: {without}"
    assert 1.8 <= ratio <= 2.2, f"a:b should be 2:1 within 10%, got {ratio:.2f} {with_agent}"
    assert weights["other.slice"] == OTHERS_WEIGHT, "a sibling no rule claims is left alone"
    assert record is not None
    (note,) = [n for n in record.plan.notes if n.kind == "hierarchy"]
    assert note.status == "holds"
