"""The executor and systemd's cgroups, with a labelled fake of the D-Bus side on a fixture
tree (the real bus and systemd are in tests/kernel/test_systemd_*.py): properties first,
all of them, then the files; without D-Bus, read-only or direct as the operator chose."""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from builders import CID, docker, snapshot
from dbus_stub import Manager, serving
from structlog.testing import capture_logs

from nodeagent import act
from nodeagent.act import Executor, Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.discovery.layouts import classify
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import CgroupPlan, Plan, Target, make_plan
from nodeagent.policyfile.model import AgentSettings, Limits, PolicySpec, WithoutBus, WorkloadClass
from nodeagent.sdbus import NoBus, Systemd
from nodeagent.snapshot import CgroupSample, NodeSnapshot, WorkloadState

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


def plan_and_snapshot() -> tuple[Plan, NodeSnapshot]:
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
    cg = plan.cgroups[0]
    assert cg.targets[Attribute.CPU_MAX].value == CpuMax(34_000, 100_000), (
        "0.333 cores rounded up to 0.34, as systemd keeps it"
    )
    fake = FakeSystemd()
    executor = Executor(tree, lambda *a: None, units=fake)
    results = executor.apply(plan, snap)
    ((unit, props),) = fake.calls
    assert [(r.name, r.up) for r in executor.reach.now()] == [("systemd", True)]
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
    executor = Executor(tree, lambda *a: None, units=FakeSystemd(bus=False),
                        without_bus=lambda: fallback)  # fmt: skip
    with capture_logs() as logs:
        first = executor.apply(plan, snap)
        executor.apply(plan, replace(snap))
    assert {r.outcome for r in first} == {outcome}
    assert Path(tree.root, SCOPE.path, "cpu.max").read_text() == file
    assert [e["event"] for e in logs if e["event"].startswith("systemd")] == [
        "systemd.unreachable"
    ], "said once, not once a write"
    (bus,) = executor.reach.now()
    assert (bus.name, bus.up, bus.last_ok) == ("systemd", False, None), bus


# -- the real adapter (nodeagent.sdbus.Systemd) against a recording stub of systemd's manager
# (tests/unit/dbus_stub.py): which unit gets a write is systemd's answer, never a path's name

UID = 1000
USER_MANAGER = f"user.slice/user-{UID}.slice/user@{UID}.service"
ROOTFUL = f"machine.slice/libpod-{CID}.scope"
ROOTLESS = f"{USER_MANAGER}/user.slice/libpod-{CID}.scope"  # the same name, in a user's tree
USER_SSHD = f"{USER_MANAGER}/app.slice/sshd.service"  # a user "service" named as a system one
SYSTEM_UNITS = {
    "-.slice": "/",
    "system.slice": "/system.slice",
    "machine.slice": "/machine.slice",
    "user.slice": "/user.slice",
    f"user-{UID}.slice": f"/user.slice/user-{UID}.slice",
    f"user@{UID}.service": f"/{USER_MANAGER}",
    "sshd.service": "/system.slice/sshd.service",
    f"libpod-{CID}.scope": f"/{ROOTFUL}",
    f"docker-{CID}.scope": f"/other.slice/docker-{CID}.scope",  # a real scope, elsewhere
    "other.slice": "/other.slice",
}
AGENT = AgentSettings.model_validate({"systemd": {"services": "write"}})


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[Manager, Systemd]]:
    stub = Manager(dict(SYSTEM_UNITS))
    with serving(str(tmp_path / "bus"), stub):
        yield stub, Systemd(f"unix:path={tmp_path}/bus", str(tmp_path / "private"), timeout=5)


def make_cgroup(root: Path, path: str) -> None:
    d = root / path
    d.mkdir(parents=True)
    for name, text in {"cgroup.procs": "", "cpu.weight": "100\n", "cgroup.freeze": "0\n",
                       "memory.current": "4096\n"}.items():  # fmt: skip
        (d / name).write_text(text)


def weigh_and_freeze(*paths: str) -> tuple[Plan, NodeSnapshot]:
    """cpu.weight 500 and a freeze for each cgroup, written as its classification says."""
    identities = [classify(p, "nodeagent.slice") or parent_identity(p, "nodeagent.slice")
                  for p in paths]  # fmt: skip
    targets = {
        Attribute.CPU_WEIGHT: Target(CpuWeight(500), "test", "weighed"),
        Attribute.FREEZE: Target(Frozen(True), "test", "frozen"),
    }
    settings: dict[Attribute, Value] = {
        Attribute.CPU_WEIGHT: CpuWeight(100),
        Attribute.FREEZE: Frozen(False),
    }
    plan = Plan(7, 0.0, tuple(CgroupPlan(i, None, targets, (), write=write_mode(i, AGENT))
                              for i in identities), {})  # fmt: skip
    states = [WorkloadState(i, CgroupSample(populated=True, settings=settings), 1.0)
              for i in identities]  # fmt: skip
    return plan, snapshot(states)


@pytest.mark.parametrize(
    "path",
    [ROOTLESS, USER_SSHD, f"{USER_MANAGER}/user.slice"],
    ids=["rootless podman", "a user's sshd.service", "the user manager's user.slice"],
)
def test_nothing_below_a_user_manager_goes_to_the_system_manager(
    tmp_path: Path, manager: tuple[Manager, Systemd], path: str
) -> None:
    stub, systemd = manager
    make_cgroup(tmp_path / "cg", path)
    plan, snap = weigh_and_freeze(path)
    writes: list[tuple[str, ...]] = []
    executor = Executor(CgroupTree(str(tmp_path / "cg")), lambda *a: writes.append(a),
                        units=systemd)  # fmt: skip
    results = executor.apply(plan, snap)
    assert stub.writes() == [], "no SetUnitProperties or FreezeUnit to the system manager"
    assert writes == []
    assert {r.outcome for r in results} == {Outcome.READ_ONLY}
    assert all(f"user@{UID}.service" in r.detail for r in results), results
    assert (tmp_path / "cg" / path / "cpu.weight").read_text() == "100\n"


def test_a_cgroup_named_after_a_unit_elsewhere_is_refused_once_and_remembered(
    tmp_path: Path, manager: tuple[Manager, Systemd]
) -> None:
    """system.slice/docker-<id>.scope made by hand, while the real scope of that name lives in
    other.slice: systemd says the cgroup is system.slice's, so nothing is written to either."""
    stub, systemd = manager
    root = tmp_path / "cg"
    hand_made = f"system.slice/docker-{CID}.scope"
    make_cgroup(root, hand_made)
    plan, snap = weigh_and_freeze(hand_made)
    assert plan.cgroups[0].write is WriteMode.SYSTEMD
    executor = Executor(CgroupTree(str(root)), lambda *a: None, units=systemd)
    with capture_logs() as logs:
        first = executor.apply(plan, snap)
        second = executor.apply(plan, replace(snap))
    assert stub.writes() == [], "no write to docker-<id>.scope in other.slice, nor system.slice"
    assert {r.outcome for r in first + second} == {Outcome.READ_ONLY}
    detail = first[0].detail
    assert f"/{hand_made}" in detail and "system.slice" in detail, detail
    refused = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert len(refused) == 1, "one line, not one per write or per tick"
    assert refused[0]["cgroup"] == f"/{hand_made}" and refused[0]["unit"] == "system.slice"
    assert stub.members().count("GetUnitByControlGroup") == 1, "the answer is kept"

    # the cgroup goes and a real scope of that name takes its place: systemd is asked again
    # (made beside it first, so that it has another inode, as every new cgroup has)
    make_cgroup(root, hand_made + ".new")
    shutil.rmtree(root / hand_made)
    (root / (hand_made + ".new")).rename(root / hand_made)
    stub.units[f"docker-{CID}.scope"] = f"/{hand_made}"
    third = executor.apply(plan, replace(snap))
    assert stub.members().count("GetUnitByControlGroup") == 2
    assert [c.member for c in stub.writes()] == ["SetUnitProperties", "FreezeUnit"]
    assert {c.body[0] for c in stub.writes()} == {f"docker-{CID}.scope"}
    assert {r.outcome for r in third} == {Outcome.WRITTEN}


def test_a_cgroup_below_its_unit_is_not_that_unit(
    tmp_path: Path, manager: tuple[Manager, Systemd]
) -> None:
    stub, systemd = manager
    root = tmp_path / "cg"
    inner = f"{ROOTFUL}/container"  # a workload's own child, never the scope itself
    make_cgroup(root, inner)
    identity = WorkloadIdentity(inner, Kind.CONTAINER, Runtime.PODMAN, Owner.SYSTEMD, "x")
    plan, snap = weigh_and_freeze(ROOTFUL)
    plan = replace(plan, cgroups=(replace(plan.cgroups[0], identity=identity),))
    snap = replace(snap, workloads=(replace(snap.workloads[0], identity=identity),))
    results = Executor(CgroupTree(str(root)), lambda *a: None, units=systemd).apply(plan, snap)
    assert stub.writes() == []
    assert {r.outcome for r in results} == {Outcome.READ_ONLY}
    assert f"libpod-{CID}.scope" in results[0].detail


def test_the_user_manager_itself_is_the_system_managers_unit_and_written_through_it(
    tmp_path: Path, manager: tuple[Manager, Systemd]
) -> None:
    stub, systemd = manager
    make_cgroup(tmp_path / "cg", USER_MANAGER)
    plan, snap = weigh_and_freeze(USER_MANAGER)
    results = Executor(CgroupTree(str(tmp_path / "cg")), lambda *a: None,
                       units=systemd).apply(plan, snap)  # fmt: skip
    assert {(c.member, c.body[0]) for c in stub.writes()} == {
        ("SetUnitProperties", f"user@{UID}.service"),
        ("FreezeUnit", f"user@{UID}.service"),
    }
    assert {r.outcome for r in results} == {Outcome.WRITTEN}


def test_the_units_of_cgroups_that_are_gone_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(act, "_SWEEP_MIN", 4)
    root = tmp_path / "cg"
    paths = [f"system.slice/docker-{n:064x}.scope" for n in range(8)]
    for p in paths:
        make_cgroup(root, p)
    asked: list[str] = []

    class Units(FakeSystemd):
        def unit_for_cgroup(self, cgroup: str) -> str:
            asked.append(cgroup)
            return cgroup.rsplit("/", 1)[-1]

    tree = CgroupTree(str(root))
    verified = act._VerifiedUnits(tree)
    for p in paths[:3]:
        with tree.open(p) as d:
            assert verified.unit(d, Units()) == p.rsplit("/", 1)[-1]
    for p in paths[:3]:
        shutil.rmtree(root / p)
    for p in paths[3:]:  # the fourth entry sweeps the three that are gone
        with tree.open(p) as d:
            verified.unit(d, Units())
    assert set(verified._known) == set(paths[3:]), "the gone ones dropped, the live ones kept"
    assert asked == paths, "each asked once"
