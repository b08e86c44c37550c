"""nodeagent_cgroup_overwritten_total: a value the agent wrote that a later read from the
kernel finds changed (the kubelet rewriting a pod's cpu.weight, an operator's echo) is
counted by attribute, once per overwrite, so that a fight over a cgroup shows.

The agent runs its real tick over a fixture tree laid out as the kubelet's cgroupfs driver
lays out a pod (written directly, so no D-Bus is involved); the "other writer" is this
test writing the file.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from builders import CID, CID2, POD_UID, pod_tree

from nodeagent import state
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.daemon import Agent, open_agent
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.metrics.collector import TickCollector
from nodeagent.policyfile.model import PolicySpec
from nodeagent.report import TickRecord
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor

FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cgroup.freeze": "0\n",
    "cpu.stat": "usage_usec 100\nuser_usec 60\nsystem_usec 40\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "memory.current": "4096\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
    "memory.low": "0\n",
    "memory.min": "0\n",
}
POD = f"kubepods/burstable/pod{POD_UID}"
CONTAINERS = [f"{POD}/{CID}", f"{POD}/{CID2}"]
KUBELET_WEIGHT = "39\n"


@pytest.fixture
def tree(tmp_path: Path) -> CgroupTree:
    tree = pod_tree(tmp_path / "cgroup", POD, *CONTAINERS, files=FILES)
    # the kubelet's weight for the pod, from its CPU requests (kubelet's MilliCPUToShares)
    (tmp_path / "cgroup" / POD / "cpu.weight").write_text(KUBELET_WEIGHT)
    return tree


def agent(tree: CgroupTree, tmp_path: Path) -> Agent:
    spec = PolicySpec.model_validate(
        {
            "version": 1,
            "agent": {"state_file": str(tmp_path / "state.json")},
            "tenants": {"a": {"shares": 1}},
            "rules": [
                {"name": "pods", "match": {"runtime": "containerd"}, "tenant": "a",
                 "limits": {"cpu_max": 1}},
            ],
        }
    )  # fmt: skip
    a = open_agent(spec, tree)
    a.rec.registry.resync()
    return a


def tick(a: Agent) -> TickRecord:
    """A tick with the pod's containers busy: their usage moves (an idle workload takes no
    part in the split, and its pod then has no weight to keep)."""
    for path in CONTAINERS:
        stat = Path(a.rec.tree.root, path, "cpu.stat")
        usage = int(stat.read_text().split()[1]) + 10_000_000
        stat.write_text(f"usage_usec {usage}\nuser_usec {usage}\nsystem_usec 0\n")
    return a.tick()


def weight(tree: CgroupTree, path: str) -> str:
    return Path(tree.root, path, "cpu.weight").read_text().strip()


def test_a_weight_the_kubelet_writes_back_is_counted_each_time(
    tree: CgroupTree, tmp_path: Path
) -> None:
    a = agent(tree, tmp_path)
    collector = TickCollector()
    first = tick(a)
    collector.observe(first)
    written = weight(tree, POD)
    assert written != KUBELET_WEIGHT.strip(), "the pod is weighted for the tenants' split"
    assert first.snapshot.overwritten == ()
    # the kubelet puts its own value back (it does so about every minute) ...
    Path(tree.root, POD, "cpu.weight").write_text(KUBELET_WEIGHT)
    second = tick(a)  # levels are read every tick
    collector.observe(second)
    assert second.snapshot.overwritten == ((POD, Attribute.CPU_WEIGHT),)
    assert weight(tree, POD) == written, "and the agent puts its value back"
    # ... and again: each overwrite counts once
    Path(tree.root, POD, "cpu.weight").write_text(KUBELET_WEIGHT)
    collector.observe(tick(a))
    collector.observe(tick(a))  # nothing changed since the agent's own write
    text = "".join(f"{s.name}{s.labels} {s.value}\n" for m in collector.collect() for s in
                   m.samples if s.name == "nodeagent_cgroup_overwritten_total")  # fmt: skip
    assert "nodeagent_cgroup_overwritten_total{'attribute': 'cpu.weight'} 2.0" in text
    assert "nodeagent_cgroup_overwritten_total{'attribute': 'cpu.max'} 0.0" in text


def test_a_workloads_value_changed_is_seen_at_its_next_full_read(
    tree: CgroupTree, tmp_path: Path
) -> None:
    a = agent(tree, tmp_path)
    a.tick()
    container = CONTAINERS[0]
    assert Path(tree.root, container, "cpu.max").read_text().split()[0] == "100000"
    Path(tree.root, container, "cpu.max").write_text("max 100000\n")
    lean = a.tick()  # a lean read takes the settings it learnt: not seen yet
    assert lean.snapshot.overwritten == ()
    a.rec.feedback = replace(
        a.rec.feedback, read_all=True
    )  # its turn for a full read (at most agent.resync_interval away)
    full = a.tick()
    assert full.snapshot.overwritten == ((container, Attribute.CPU_MAX),)


def test_a_value_nobody_changed_and_a_cgroup_never_written_count_nothing(
    tree: CgroupTree,
) -> None:
    identity = WorkloadIdentity(CONTAINERS[0], Kind.CONTAINER, Runtime.CONTAINERD,
                                Owner.CGROUPFS, CID[:12], container_id=CID)  # fmt: skip
    sensor = Sensor(tree, NodeSensor())
    assert sensor.snapshot([identity], 1.0, 1.0, full=True).overwritten == ()
    Path(tree.root, CONTAINERS[0], "cpu.weight").write_text("300\n")
    sensor.learn(CONTAINERS[0], Attribute.CPU_WEIGHT, CpuWeight(300))
    assert sensor.snapshot([identity], 2.0, 2.0, full=True).overwritten == ()
    Path(tree.root, CONTAINERS[0], "cpu.weight").write_text("50\n")
    assert sensor.snapshot([identity], 3.0, 3.0, full=True).overwritten == (
        (CONTAINERS[0], Attribute.CPU_WEIGHT),
    )
    assert sensor.snapshot([identity], 4.0, 4.0, full=True).overwritten == ()


def test_the_originals_are_recorded_even_when_the_gpu_step_after_the_writes_fails(
    tree: CgroupTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a cgroup held before the agent first changed it is saved right after the writes,
    before the GPU step and the observers: a tick that fails after its writes (here NVML's
    power limits) still leaves the original for `nodeagent release` (before: recorded only
    once the whole tick had returned, so never while that step kept failing)."""
    a = agent(tree, tmp_path)

    def broken(*_: object) -> None:
        raise RuntimeError("NVML: the driver stopped answering")

    monkeypatch.setattr(a.rec.gpus.executor, "apply", broken)
    with pytest.raises(RuntimeError, match="NVML"):
        tick(a)
    assert Path(a.rec.tree.root, CONTAINERS[0], "cpu.max").read_text().strip() == "100000 100000"
    recorded = {(p, str(at)): o.was for p, at, o in a.rec.originals.items()}
    assert recorded[(CONTAINERS[0], "cpu.max")] == "max 100000"
    saved = state.load(str(tmp_path / "state.json"))
    assert saved is not None and CONTAINERS[0] in saved.originals
