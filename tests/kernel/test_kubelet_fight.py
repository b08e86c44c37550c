"""Beside the kubelet on a real kernel: a pod's cpu.weight that nodeagent wrote and "the
kubelet" (this test, writing the file as the kubelet's cgroupfs driver does) sets back is
counted in nodeagent_cgroup_overwritten_total{attribute="cpu.weight"}, once per overwrite,
and the QoS tiers are never written by default.

The sandbox is the agent's cgroup root, laid out as the kubelet's cgroupfs driver lays out
a burstable pod with one container (a busy process in it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import enable_controllers
from helpers import busy, read, spec, wait_for

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.metrics.collector import TickCollector

UID = "6f1d2c3b-4a5e-4f60-8b7a-9c0d1e2f3a4b"
CID = "a1" * 32
KUBELET_WEIGHT = "39"
"""What the kubelet writes for a pod that requests 0.1 CPU (its MilliCPUToShares, in v2)."""


@pytest.fixture
def pod(cgroup_sandbox: Path) -> Iterator[tuple[Path, Path]]:
    tiers = cgroup_sandbox / "kubepods" / "burstable"
    tiers.mkdir(parents=True)
    enable_controllers(cgroup_sandbox / "kubepods")
    enable_controllers(tiers)
    pod = tiers / f"pod{UID}"
    pod.mkdir()
    enable_controllers(pod)
    (pod / "cpu.weight").write_text(KUBELET_WEIGHT)
    container = pod / CID
    container.mkdir()
    proc = busy(container)  # an idle workload takes no part in the split: its pod no weight
    yield cgroup_sandbox, pod
    proc.kill()
    proc.wait()


def test_the_kubelet_setting_a_pods_weight_back_is_counted(
    pod: tuple[Path, Path], tmp_path: Path
) -> None:
    root, pod_dir = pod
    policy = spec(
        "nodeagent.slice", tmp_path,
        rules=[{"name": "pods", "match": {"kind": "container"}, "tenant": "a",
                "limits": {"cpu_max": 1}}],
        tenants={"a": {"shares": 1}},
    )  # fmt: skip
    agent = open_agent(policy, CgroupTree(str(root)))
    agent.prepare()
    collector = TickCollector()
    tier_weight = read(root / "kubepods" / "burstable", "cpu.weight")
    first = agent.tick()
    collector.observe(first)
    written = read(pod_dir, "cpu.weight")
    assert written != KUBELET_WEIGHT, "the pod is weighted for the tenants' split"
    for n in (1, 2):
        (pod_dir / "cpu.weight").write_text(KUBELET_WEIGHT)  # the kubelet's periodic sync
        record = agent.tick()
        collector.observe(record)
        assert (str(pod_dir.relative_to(root)), "cpu.weight") in {
            (p, str(a)) for p, a in record.snapshot.overwritten
        }
        assert wait_for(lambda: read(pod_dir, "cpu.weight") == written, timeout=5)
        counted = {
            s.labels["attribute"]: s.value
            for m in collector.collect()
            for s in m.samples
            if s.name == "nodeagent_cgroup_overwritten_total"
        }
        assert counted["cpu.weight"] == n
    collector.observe(agent.tick())  # nobody changed it since: not counted again
    counted = {s.labels["attribute"]: s.value for m in collector.collect() for s in m.samples
               if s.name == "nodeagent_cgroup_overwritten_total"}  # fmt: skip
    assert counted["cpu.weight"] == 2
    # the QoS tiers are the kubelet's: never written by default
    assert read(root / "kubepods" / "burstable", "cpu.weight") == tier_weight
