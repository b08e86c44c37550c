"""make_plan: policies' decisions merged per cgroup, with reasons and a trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from builders import docker, job, plan_claimed, service, snapshot, spec, workload

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, MemoryLimit, Value
from nodeagent.policy.base import Decision, DeviceDecision, Output, Policy, PolicyInput, Skip
from nodeagent.policy.classify import assign
from nodeagent.policy.newcomer import SiblingWeight
from nodeagent.policy.plan import DEFAULT_POLICIES, CgroupPlan, Plan, make_plan
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.snapshot import CgroupSample, WorkloadState


@dataclass
class Fixed(Policy):
    """A policy that wants one value on one attribute of every assigned workload."""

    name: str
    attribute: Attribute
    value: Value

    def __post_init__(self) -> None:
        self.writes = frozenset({self.attribute})

    def decide(self, given: PolicyInput) -> Sequence[Decision]:
        return [
            Decision(path, self.attribute, self.value, self.name, f"{self.name} says so", ("t1",))
            for path in given.assignments
        ]


def by_path(plan: Plan) -> dict[str, CgroupPlan]:
    return {cg.path: cg for cg in plan.cgroups}


SNAP = snapshot([workload("nodeagent.slice/a-1"), workload(service("cron.service"))])


def test_later_policy_overrides_earlier_on_the_same_attribute_and_says_so() -> None:
    policies = [
        Fixed("first", Attribute.CPU_WEIGHT, CpuWeight(100)),
        Fixed("second", Attribute.CPU_WEIGHT, CpuWeight(500)),
        Fixed("third", Attribute.MEMORY_MAX, MemoryLimit(4096)),
    ]
    cg = by_path(plan_claimed(SNAP, spec({"a": 1}), {}, policies))["nodeagent.slice/a-1"]
    assert cg.targets[Attribute.CPU_WEIGHT].value == CpuWeight(500)
    assert cg.targets[Attribute.CPU_WEIGHT].policy == "second"
    assert cg.targets[Attribute.CPU_WEIGHT].reason == "second says so"
    assert cg.targets[Attribute.MEMORY_MAX].policy == "third"
    assert cg.trace == (
        "matched rule a-jobs: tenant a, class batch",
        "first: t1",
        "first: first says so",
        "second overrides first on cpu.weight",
        "second: t1",
        "second: second says so",
        "third: t1",
        "third: third says so",
    )


def test_no_override_line_between_different_attributes() -> None:
    policies = [
        Fixed("first", Attribute.CPU_WEIGHT, CpuWeight(100)),
        Fixed("second", Attribute.CPU_MAX, CpuMax(50_000)),
    ]
    cg = by_path(plan_claimed(SNAP, spec({"a": 1}), {}, policies))["nodeagent.slice/a-1"]
    assert not any("overrides" in line for line in cg.trace)
    assert set(cg.targets) == {Attribute.CPU_WEIGHT, Attribute.CPU_MAX}


def test_unmatched_workloads_get_no_targets() -> None:
    plan = plan_claimed(SNAP, spec({"a": 1}), {})
    cron = by_path(plan)["system.slice/cron.service"]
    assert cron.assignment is None
    assert cron.targets == {}
    assert cron.trace == ()
    assert cron.identity == SNAP.workloads[1].identity


def test_default_policies_give_weight_and_assignment() -> None:
    plan = plan_claimed(SNAP, spec({"a": 1}), {})
    cg = by_path(plan)["nodeagent.slice/a-1"]
    assert cg.assignment is not None
    assert (cg.assignment.rule, cg.assignment.tenant) == ("a-jobs", "a")
    assert cg.assignment.workload_class is WorkloadClass.BATCH
    assert cg.targets[Attribute.CPU_WEIGHT].value == CpuWeight(100)
    assert cg.targets[Attribute.CPU_WEIGHT].policy == "cpu-weights"
    assert cg.trace[0] == "matched rule a-jobs: tenant a, class batch"
    assert set(cg.targets) == {Attribute.CPU_WEIGHT}, "no limits in the rule: none set"
    assert (plan.seq, plan.wall_time) == (SNAP.seq, SNAP.wall_time)
    assert [c.path for c in plan.cgroups] == [w.path for w in SNAP.workloads]


def test_plan_carries_the_advanced_usage() -> None:
    snap = snapshot([workload("nodeagent.slice/a-1", cpu_rate=2.0)], elapsed=10.0)
    plan = plan_claimed(snap, spec({"a": 1, "b": 1}, half_life="10s"), {"a": 40.0, "b": 8.0})
    assert plan.tenant_usage == {"a": pytest.approx(20.0 + 20.0), "b": pytest.approx(4.0)}


def limits_spec(**limits: object) -> PolicySpec:
    return spec(
        {"a": 1},
        [{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a", "limits": limits}],
    )


@pytest.mark.parametrize(
    ("limits", "page", "expected"),
    [
        (
            {"cpu_max": 1.5, "memory_max": "4Gi", "memory_high": "3Gi"},
            4096,
            {
                Attribute.CPU_MAX: CpuMax(150_000, 100_000),
                Attribute.MEMORY_MAX: MemoryLimit(4 << 30, 4096),
                Attribute.MEMORY_HIGH: MemoryLimit(3 << 30, 4096),
            },
        ),
        (
            {"cpu_max": 0.5, "cpu_period_us": 50_000, "memory_max": 1_000_000},
            4096,
            {
                Attribute.CPU_MAX: CpuMax(25_000, 50_000),
                Attribute.MEMORY_MAX: MemoryLimit(999_424, 4096),  # rounded down to a page
                Attribute.MEMORY_HIGH: MemoryLimit(None, 4096),  # owned with memory.max
            },
        ),
        (
            {"memory_max": "1G", "memory_high": 1_000_000},
            65536,  # arm64 with 64K pages
            {
                Attribute.MEMORY_MAX: MemoryLimit(999_948_288, 65536),
                Attribute.MEMORY_HIGH: MemoryLimit(983_040, 65536),
            },
        ),
        (
            {"cpu_max": "max", "memory_max": "max", "memory_high": "max"},
            4096,
            {
                Attribute.CPU_MAX: CpuMax(None, 100_000),
                Attribute.MEMORY_MAX: MemoryLimit(None, 4096),
                Attribute.MEMORY_HIGH: MemoryLimit(None, 4096),
            },
        ),
    ],
)
def test_static_limits(
    limits: dict[str, object], page: int, expected: dict[Attribute, Value]
) -> None:
    snap = snapshot([workload(docker()), workload(service("cron.service"))], page_size=page)
    plan = plan_claimed(snap, limits_spec(**limits), {})
    cg = by_path(plan)[docker().path]
    got = {a: t.value for a, t in cg.targets.items() if a is not Attribute.CPU_WEIGHT}
    assert got == expected
    for attr in expected:
        assert cg.targets[attr].policy == "static-limits"
        assert cg.targets[attr].reason.startswith("rule docker: ")
    for value in got.values():
        if isinstance(value, MemoryLimit):
            assert value.page_size == page
    assert by_path(plan)["system.slice/cron.service"].targets == {}


def test_static_limit_reasons() -> None:
    snap = snapshot([workload(docker())])
    plan = plan_claimed(snap, limits_spec(cpu_max=1.5, memory_max="4Gi"), {})
    targets = by_path(plan)[docker().path].targets
    assert targets[Attribute.CPU_MAX].reason == "rule docker: cpu_max 1.5 cores"
    assert targets[Attribute.MEMORY_MAX].reason == f"rule docker: memory_max {4 << 30}"
    assert targets[Attribute.CPU_MAX].render() == "150000 100000"


@pytest.mark.parametrize(
    ("limits", "usage", "high"),
    [
        ({"memory_max": "64Mi"}, 100 << 20, 64 << 20),  # above: high lowered to the target
        ({"memory_max": "64Mi"}, 10 << 20, None),  # fits: high back to max
        ({"memory_max": "64Mi", "memory_high": "48Mi"}, 100 << 20, 48 << 20),  # rule's own high
        ({"memory_max": "max"}, 100 << 20, None),
    ],
)
def test_memory_high_is_planned_with_memory_max(
    limits: dict[str, object], usage: int, high: int | None
) -> None:
    """The plan owns memory.high whenever it sets memory.max, so a lowered high is undone."""
    w = workload(docker())
    w = WorkloadState(w.identity, CgroupSample(populated=True, memory_current=usage), 1.0)
    cg = by_path(plan_claimed(snapshot([w]), limits_spec(**limits), {}))[docker().path]
    assert cg.targets[Attribute.MEMORY_HIGH].value == MemoryLimit(high, 4096)


# --- one workload never costs the others ---------------------------------------------------


def test_assignments_of_workloads_missing_from_the_snapshot_are_ignored() -> None:
    """The regression: a cgroup discovered and claimed, then gone before it was sensed,
    made the trace loop raise KeyError and the whole tick fail."""
    snap = snapshot([workload("nodeagent.slice/a-1")])
    claimed = assign([job("nodeagent.slice/a-1"), job("nodeagent.slice/a-gone")], spec({"a": 1}))
    plan = make_plan(snap, spec({"a": 1}), {}, assignments=claimed)
    assert [cg.path for cg in plan.cgroups] == ["nodeagent.slice/a-1"]
    assert plan.problems == ()


@dataclass
class Broken(Policy):
    name: str = "broken"

    def decide(self, given: PolicyInput) -> Sequence[Decision]:
        raise ZeroDivisionError("float division by zero")


@dataclass
class SkipsOne(Policy):
    """Plans every workload, but cannot plan `bad`."""

    bad: str
    name: str = "picky"
    writes = frozenset({Attribute.CPU_WEIGHT})

    def decide(self, given: PolicyInput) -> Sequence[Decision | Skip]:
        return [
            Skip(p, self.name, "value out of range")
            if p == self.bad
            else Decision(p, Attribute.CPU_WEIGHT, CpuWeight(300), self.name, "picky says so")
            for p in given.assignments
        ]


def test_a_policy_that_fails_is_left_out_and_the_others_still_plan() -> None:
    plan = plan_claimed(
        SNAP, spec({"a": 1}), {}, [Broken(), Fixed("ok", Attribute.CPU_MAX, CpuMax(50_000))]
    )
    cg = by_path(plan)["nodeagent.slice/a-1"]
    assert cg.targets[Attribute.CPU_MAX].value == CpuMax(50_000)
    assert plan.problems == (
        "policy broken failed, left out this tick: ZeroDivisionError: float division by zero",
    )


@dataclass
class Overreaches(Policy):
    """Declares cpu.weight and a device setting, but also decides cpu.max and a power
    limit: a bug the plan must catch, whatever the policy's code says."""

    name: str = "overreaches"
    writes = frozenset({Attribute.CPU_WEIGHT})

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        return [
            Decision("nodeagent.slice/a-1", Attribute.CPU_WEIGHT, CpuWeight(300), self.name, "ok"),
            Decision("nodeagent.slice/a-1", Attribute.CPU_MAX, CpuMax(1000), self.name, "sly"),
            DeviceDecision("GPU-0", "power_limit_mw", 100_000, self.name, "sly"),
        ]


def test_a_decision_on_what_its_policy_does_not_declare_is_refused() -> None:
    plan = plan_claimed(SNAP, spec({"a": 1}), {}, [Overreaches()])
    cg = by_path(plan)["nodeagent.slice/a-1"]
    assert cg.targets[Attribute.CPU_WEIGHT].value == CpuWeight(300), "the declared one stands"
    assert Attribute.CPU_MAX not in cg.targets
    assert plan.devices == ()
    assert plan.problems == (
        "policy overreaches decided cpu.max of nodeagent.slice/a-1, which it does not declare:"
        " refused",
        "policy overreaches decided power_limit_mw of GPU GPU-0, which it does not declare:"
        " refused",
    )
    assert not any("overreaches" in line for line in cg.trace if "sly" in line)


def test_every_shipped_policy_declares_what_it_writes() -> None:
    """The declarations are the reference docs/architecture.md gives: a policy that
    starts writing something new must say so there too."""
    declared = {p.name: {str(a) for a in p.writes} | set(p.device_settings)
                for p in (*DEFAULT_POLICIES, SiblingWeight(None))}  # fmt: skip
    text = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    for name, writes in declared.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` ")), "")
        assert row, f"docs/architecture.md has no row for policy {name}"
        assert {w.strip(" `") for w in row.split("|")[2].split(",") if w.strip()} == (
            writes or {"nothing"}
        ), row


def test_a_cgroup_a_policy_cannot_plan_is_skipped_alone() -> None:
    snap = snapshot([workload("nodeagent.slice/a-1"), workload("nodeagent.slice/a-2")])
    policies = [SkipsOne("nodeagent.slice/a-2"), Fixed("cap", Attribute.CPU_MAX, CpuMax(50_000))]
    plan = by_path(plan_claimed(snap, spec({"a": 1}), {}, policies))
    assert plan["nodeagent.slice/a-2"].skipped == "picky: value out of range"
    assert plan["nodeagent.slice/a-2"].targets == {}, "no partial plan for a skipped cgroup"
    assert plan["nodeagent.slice/a-1"].skipped is None
    assert set(plan["nodeagent.slice/a-1"].targets) == {Attribute.CPU_WEIGHT, Attribute.CPU_MAX}


# --- memory by class -------------------------------------------------------------------


def test_memory_request_sets_protection_by_class_and_kubelet_memory_high() -> None:
    """Inference protects its request with memory.min; memory.high is request + 0.9 x
    (limit - request), rounded down to a page."""
    rules = [
        {
            "name": "infer",
            "match": {},
            "tenant": "a",
            "class": "inference",
            "limits": {"memory_max": "1Gi", "memory_request": "256Mi"},
        }
    ]
    cg = by_path(plan_claimed(SNAP, spec({"a": 1}, rules), {}))["nodeagent.slice/a-1"]
    mib = 1 << 20
    high = (256 * mib + int(0.9 * (768 * mib))) // 4096 * 4096
    assert cg.targets[Attribute.MEMORY_HIGH].value == MemoryLimit(high)
    assert cg.targets[Attribute.MEMORY_MIN].value == MemoryLimit(256 * mib)
    assert cg.targets[Attribute.MEMORY_LOW].value == MemoryLimit(0)
    assert cg.targets[Attribute.MEMORY_MAX].value == MemoryLimit(1024 * mib)


def test_training_protects_its_request_with_memory_low() -> None:
    rules = [{"name": "t", "match": {}, "tenant": "a", "class": "training",
              "limits": {"memory_request": "1Gi"}}]  # fmt: skip
    cg = by_path(plan_claimed(SNAP, spec({"a": 1}, rules), {}))["nodeagent.slice/a-1"]
    assert cg.targets[Attribute.MEMORY_LOW].value == MemoryLimit(1 << 30)
    assert cg.targets[Attribute.MEMORY_MIN].value == MemoryLimit(0)
    assert Attribute.MEMORY_HIGH not in cg.targets, "no limit: memory.high is not planned"


def test_cpu_targets_are_computed_once_and_reported_as_cpu_weights_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's cpu_targets are CpuWeights' own (issue 14.4): not computed a second time
    after the policies, under a bare except."""
    from nodeagent.policy import plan as plan_module
    from nodeagent.policy import weights

    real, calls = weights.cpu_targets, []

    def counted(given: PolicyInput) -> dict[str, tuple[float, bool, str]]:
        calls.append(given)
        return real(given)

    monkeypatch.setattr(weights, "cpu_targets", counted)
    monkeypatch.setattr(plan_module, "cpu_targets", counted, raising=False)  # where it was
    snap = snapshot([workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1")])
    plan = plan_claimed(snap, spec({"a": 1, "b": 3}), {})
    assert len(calls) == 1
    (given,) = calls
    assert {p: (t.cores, t.active) for p, t in plan.cpu_targets.items()} == {
        p: (c, a) for p, (c, a, _) in real(given).items()
    }
    assert set(plan.cpu_targets) == {"nodeagent.slice/a-1", "nodeagent.slice/b-1"}
    assert {t.policy for t in plan.cpu_targets.values()} == {"cpu-weights"}
