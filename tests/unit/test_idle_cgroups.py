"""A cgroup with cpu.idle set (systemd's CPUWeight=idle) on fixture trees: the kernel shows
its cpu.weight as 0 and refuses any other (EINVAL; tests/kernel/test_idle_cgroups.py has the
real kernel). It is sensed, not skipped; its weight is neither planned nor written nor set
on its unit; its other files are managed as any cgroup's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from builders import docker, snapshot
from test_act_systemd import SCOPE, FakeSystemd

from nodeagent.act import IDLE, Executor, Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuWeight, MemoryLimit
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import Plan, Target, make_plan
from nodeagent.policyfile.model import Limits, PolicySpec, WorkloadClass
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor
from nodeagent.snapshot import CgroupSample, WorkloadState

POLICY = PolicySpec.model_validate({"version": 1, "tenants": {"a": {"shares": 1}}})
LIMITS = Limits.model_validate({"memory_max": "1Gi"})
FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.stat": "usage_usec 100\n",
    "cpu.weight": "0\n",
    "cpu.max": "max 100000\n",
    "memory.max": "max\n",
    "memory.high": "max\n",
    "memory.current": str(64 << 20) + "\n",
}
JOB = WorkloadIdentity("s/idle", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, "idle")


def fixture(root: Path, path: str) -> CgroupTree:
    d = root / path
    d.mkdir(parents=True)
    for name, text in FILES.items():
        (d / name).write_text(text)
    return CgroupTree(str(root))


def with_weight(plan: Plan, weight: int) -> Plan:
    """The plan with a weight for each cgroup, as the fast path gives a newcomer: from its
    siblings, with nothing of its own read."""
    target = Target(CpuWeight(weight), "sibling-weight", "fast path")
    cgroups = tuple(
        replace(cg, targets={**cg.targets, Attribute.CPU_WEIGHT: target}) for cg in plan.cgroups
    )
    return replace(plan, cgroups=cgroups)


def test_an_idle_cgroup_is_sensed_as_idle_not_skipped(tmp_path: Path) -> None:
    tree = fixture(tmp_path, JOB.path)
    snap = Sensor(tree, NodeSensor()).snapshot([JOB], 1.0, 1.0)
    assert snap.skipped == ()
    (w,) = snap.workloads
    assert w.sample.cpu_idle
    assert Attribute.CPU_WEIGHT not in w.sample.settings
    assert w.sample.settings[Attribute.MEMORY_MAX] == MemoryLimit(None)


def test_an_idle_level_is_weighted_by_no_one(tmp_path: Path) -> None:
    tree = fixture(tmp_path, "s/child")
    (tmp_path / "s" / "cpu.weight").write_text("0\n")
    parent = WorkloadIdentity("s", Kind.GROUP, Runtime.SYSTEMD, Owner.SYSTEMD, "s")
    child = WorkloadIdentity("s/child", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, "child")
    snap = Sensor(tree, NodeSensor()).snapshot([child], 1.0, 1.0, levels=[parent])
    assert snap.skipped == ()
    (level,) = snap.levels
    assert level.sample.cpu_idle and level.sample.settings == {}


def test_its_weight_is_not_planned_and_its_memory_limit_is() -> None:
    idle = WorkloadState(JOB, CgroupSample(populated=True, cpu_idle=True), 1.0)
    busy = WorkloadState(
        WorkloadIdentity("s/busy", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, "busy"),
        CgroupSample(populated=True, settings={Attribute.CPU_WEIGHT: CpuWeight(100)}),
        1.0,
    )
    assignments = {w.path: Assignment("r", "a", WorkloadClass.BATCH, LIMITS) for w in (idle, busy)}
    plan = make_plan(snapshot([idle, busy]), POLICY, {}, assignments=assignments)
    cgroups = {cg.path: cg for cg in plan.cgroups}
    assert Attribute.CPU_WEIGHT not in cgroups[JOB.path].targets
    assert cgroups[JOB.path].targets[Attribute.MEMORY_MAX].value == MemoryLimit(1 << 30, 4096)
    assert any("cpu.idle is set" in line for line in cgroups[JOB.path].trace)
    assert Attribute.CPU_WEIGHT in cgroups["s/busy"].targets


def test_the_executor_leaves_an_idle_weight_alone(tmp_path: Path) -> None:
    """A newcomer's fast path plans from nothing read: the executor's own read sees idle."""
    tree = fixture(tmp_path, JOB.path)
    state = WorkloadState(JOB, CgroupSample())
    snap = snapshot([state])
    assignments = {JOB.path: Assignment("r", "a", WorkloadClass.BATCH, LIMITS)}
    plan = with_weight(make_plan(snap, POLICY, {}, assignments=assignments), 250)
    audit: list[tuple[object, ...]] = []
    results = Executor(tree, lambda *a: audit.append(a)).apply(plan, snap)
    by = {r.attribute: r for r in results}
    assert by[Attribute.CPU_WEIGHT].outcome is Outcome.READ_ONLY
    assert by[Attribute.CPU_WEIGHT].detail == IDLE
    assert by[Attribute.MEMORY_MAX].outcome is Outcome.WRITTEN
    assert (tmp_path / JOB.path / "cpu.weight").read_text() == "0\n"
    assert [a[1] for a in audit] == [Attribute.MEMORY_MAX]


def test_an_idle_unit_is_not_given_a_weight_property(tmp_path: Path) -> None:
    """CPUWeight set on a unit made idle would end its idleness (systemd writes cpu.idle 0)."""
    tree = fixture(tmp_path, SCOPE.path)
    snap = snapshot([WorkloadState(docker(), CgroupSample())])
    assignments = {SCOPE.path: Assignment("r", "a", WorkloadClass.BATCH, LIMITS)}
    plan = with_weight(make_plan(snap, POLICY, {}, assignments=assignments), 250)
    fake = FakeSystemd()
    results = Executor(tree, lambda *a: None, units=fake).apply(plan, snap)
    ((_, props),) = fake.calls
    assert props == {"MemoryMax": 1 << 30, "MemoryHigh": 2**64 - 1}
    assert {r.attribute: r.outcome for r in results}[Attribute.CPU_WEIGHT] is Outcome.READ_ONLY
    assert (tmp_path / SCOPE.path / "cpu.weight").read_text() == "0\n"
