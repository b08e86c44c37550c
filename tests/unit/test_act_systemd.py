"""The executor and systemd's cgroups, with a labelled fake of the D-Bus side on a fixture
tree (the real bus and systemd are in tests/kernel/test_systemd_*.py): properties first,
all of them, then the files; without D-Bus, read-only or direct as the operator chose."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from builders import docker, snapshot
from structlog.testing import capture_logs

from nodeagent.act import Executor, Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, MemoryLimit
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import make_plan
from nodeagent.sdbus import NoBus
from nodeagent.snapshot import CgroupSample, WorkloadState
from nodeagent.spec.model import Limits, PolicySpec, WithoutBus, WorkloadClass

SCOPE = docker()
POLICY = PolicySpec.model_validate({"version": 1, "tenants": {"a": {"shares": 1}}})


class FakeSystemd:
    """Stands in for nodeagent.sdbus.Systemd: records calls, or has no bus at all."""

    def __init__(self, bus: bool = True) -> None:
        self.bus = bus
        self.calls: list[tuple[str, object]] = []

    def unit_for_cgroup(self, cgroup: str) -> str:
        if not self.bus:
            raise NoBus("no D-Bus: the system bus and /run/systemd/private are down")
        return cgroup.rsplit("/", 1)[-1]

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None:
        self.calls.append((unit, dict(properties)))

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        self.calls.append((unit, frozen))


@pytest.fixture
def tree(tmp_path: Path) -> CgroupTree:
    d = tmp_path / SCOPE.path
    d.mkdir(parents=True)
    for name, text in {"cgroup.procs": "", "cpu.weight": "100\n", "cpu.max": "max 100000\n",
                       "memory.max": "max\n", "memory.high": "max\n",
                       "memory.current": str(64 << 20) + "\n"}.items():  # fmt: skip
        (d / name).write_text(text)
    return CgroupTree(str(tmp_path))


def plan_and_snapshot() -> tuple[object, object]:
    limits = Limits.model_validate({"cpu_max": 0.333, "memory_max": "1Gi"})
    state = WorkloadState(
        SCOPE,
        CgroupSample(
            populated=True,
            memory_current=64 << 20,
            settings={
                Attribute.CPU_WEIGHT: CpuWeight(100),
                Attribute.CPU_MAX: CpuMax(None),
                Attribute.MEMORY_MAX: MemoryLimit(None),
                Attribute.MEMORY_HIGH: MemoryLimit(None),
            },
        ),
        None,
    )
    snap = snapshot([state])
    assignments = {SCOPE.path: Assignment("r", "a", WorkloadClass.BATCH, limits)}
    return make_plan(snap, POLICY, {}, assignments=assignments), snap


def test_properties_first_all_of_them_then_the_files(tree: CgroupTree) -> None:
    plan, snap = plan_and_snapshot()
    cg = plan.cgroups[0]  # type: ignore[attr-defined]
    assert cg.targets[Attribute.CPU_MAX].value == CpuMax(34_000, 100_000), (
        "0.333 cores rounded up to 0.34, as systemd keeps it"
    )
    fake = FakeSystemd()
    results = Executor(tree, lambda *a: None, units=fake).apply(plan, snap)  # type: ignore[arg-type]
    ((unit, props),) = fake.calls
    assert unit == SCOPE.path.rsplit("/", 1)[-1]
    assert props == {
        "CPUWeight": 100,
        "CPUQuotaPerSecUSec": 340_000,
        "CPUQuotaPeriodUSec": 100_000,
        "MemoryMax": 1 << 30,
        "MemoryHigh": 2**64 - 1,
    }
    assert {r.attribute: r.outcome for r in results} == {
        Attribute.CPU_MAX: Outcome.WRITTEN,
        Attribute.MEMORY_MAX: Outcome.WRITTEN,
    }
    assert Path(tree.root, SCOPE.path, "cpu.max").read_text() == "34000 100000"


@pytest.mark.parametrize(
    ("fallback", "outcome", "file"),
    [(WithoutBus.READ_ONLY, Outcome.READ_ONLY, "max 100000\n"),
     (WithoutBus.DIRECT, Outcome.WRITTEN, "34000 100000")],
)  # fmt: skip
def test_without_d_bus_the_operator_chooses(
    tree: CgroupTree, fallback: WithoutBus, outcome: Outcome, file: str
) -> None:
    plan, snap = plan_and_snapshot()
    executor = Executor(tree, lambda *a: None, units=FakeSystemd(bus=False),  # type: ignore[arg-type]
                        without_bus=lambda: fallback)  # fmt: skip
    with capture_logs() as logs:
        first = executor.apply(plan, snap)  # type: ignore[arg-type]
        executor.apply(plan, replace(snap))  # type: ignore[arg-type]
    assert {r.outcome for r in first} == {outcome}
    assert Path(tree.root, SCOPE.path, "cpu.max").read_text() == file
    assert [e["event"] for e in logs if e["event"].startswith("systemd")] == [
        "systemd.unreachable"
    ], "said once, not once a write"
