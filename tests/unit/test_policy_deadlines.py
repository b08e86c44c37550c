"""Deadlines, reservations and the weights they turn into, from hand-built snapshots."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import job, snapshot, spec

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.policy.base import Assignment, Note
from nodeagent.policy.plan import CgroupPlan, make_plan
from nodeagent.snapshot import CgroupSample, WorkloadState
from nodeagent.spec.model import PolicySpec, WorkloadClass

NOW = 1_700_000_000.0


def running(path: str, used: float, rate: float | None = 1.0, threads: int = 1) -> WorkloadState:
    sample = CgroupSample(populated=True, cpu_usage_us=int(used * 1e6), threads=threads)
    return WorkloadState(job(path), sample, rate)


def deadline_job(
    work: float,
    due_in: float,
    cls: WorkloadClass = WorkloadClass.TRAINING,
    cpus: float | None = None,
) -> Assignment:
    return Assignment("exec:test", "a", cls, deadline=NOW + due_in, work=work, cpus=cpus)


def plan(
    states: list[WorkloadState],
    assignments: dict[str, Assignment],
    policy: PolicySpec | None = None,
    cpus: int = 2,
) -> dict[str, CgroupPlan]:
    snap = snapshot(states, wall_time=NOW)
    snap = replace(snap, node=replace(snap.node, cpu_count=cpus))
    p = make_plan(snap, policy or spec({"a": 1, "b": 1}), {}, assignments=assignments)
    return {c.path: c for c in p.cgroups}


def note(cg: CgroupPlan) -> Note:
    (n,) = [n for n in cg.notes if n.kind == "deadline"]
    return n


def weight(cg: CgroupPlan) -> int:
    value = cg.targets[Attribute.CPU_WEIGHT].value
    assert isinstance(value, CpuWeight)
    return value.value


def test_a_deadline_job_gets_its_rate_and_the_rest_is_fair_share() -> None:
    """2 CPUs. The job needs 60 CPU-s in 100 s (0.6 cores, 0.66 with headroom); two fair-share
    workloads split the 1.34 cores left: weights 66 : 67 : 67, in proportion."""
    states = [  # first tick (no rates yet): no usage history to correct the shares
        running("nodeagent.slice/job", used=0, rate=None),
        running("nodeagent.slice/a-1", used=5, rate=None),
        running("nodeagent.slice/b-1", used=5, rate=None),
    ]
    assignments = {
        "nodeagent.slice/job": deadline_job(60, 100),
        "nodeagent.slice/a-1": Assignment("a-jobs", "a", WorkloadClass.BATCH),
        "nodeagent.slice/b-1": Assignment("b-jobs", "b", WorkloadClass.BATCH),
    }
    cgs = plan(states, assignments)
    n = note(cgs["nodeagent.slice/job"])
    assert n.status == "on-track"
    assert n.fields["required_rate"] == pytest.approx(0.6)
    assert n.fields["rate"] == pytest.approx(0.66)
    assert n.fields["remaining"] == pytest.approx(60)
    assert n.fields["slack"] == pytest.approx(40)
    assert n.fields["predicted_finish"] == pytest.approx(NOW + 60 / 0.66)
    w = {p: weight(c) for p, c in cgs.items()}
    assert w["nodeagent.slice/job"] / w["nodeagent.slice/a-1"] == pytest.approx(
        0.66 / 0.67, rel=0.02
    )
    assert w["nodeagent.slice/a-1"] == w["nodeagent.slice/b-1"]
    assert any("admitted by EDF" in line for line in cgs["nodeagent.slice/job"].trace)


def test_jobs_that_cannot_all_fit_earliest_deadline_wins() -> None:
    states = [running("nodeagent.slice/early", 0), running("nodeagent.slice/late", 0)]
    assignments = {
        "nodeagent.slice/early": deadline_job(90, 100),  # needs 0.9 of the one CPU
        "nodeagent.slice/late": deadline_job(50, 120),  # would need 0.42 more: does not fit
    }
    cgs = plan(states, assignments, cpus=1)
    assert note(cgs["nodeagent.slice/early"]).status == "on-track"
    late = note(cgs["nodeagent.slice/late"])
    assert late.status == "predicted-miss"
    # what the early one leaves of the one CPU: 1 - 0.9 x headroom 1.1
    assert late.fields["rate"] == pytest.approx(0.01)


def test_parallelism_comes_from_threads_and_declared_cpus() -> None:
    """150 CPU-s in 100 s needs 1.5 cores: one thread cannot; two threads can."""
    for threads, cpus, status in [(1, None, "predicted-miss"), (2, None, "on-track"),
                                  (4, 1.0, "predicted-miss")]:  # fmt: skip
        cgs = plan(
            [running("nodeagent.slice/j", 0, threads=threads)],
            {"nodeagent.slice/j": deadline_job(150, 100, cpus=cpus)},
        )
        assert note(cgs["nodeagent.slice/j"]).status == status, (threads, cpus)


@pytest.mark.parametrize(
    ("used", "due_in", "populated", "status"),
    [
        (61, 100, True, "overrun"),
        (61, 100, False, "done"),
        (10, -5, True, "missed"),
        (0, 100, False, "waiting"),
    ],
)
def test_jobs_off_their_plan_fall_back_to_fair_share(
    used: float, due_in: float, populated: bool, status: str
) -> None:
    w = running("nodeagent.slice/j", used)
    w = replace(w, sample=replace(w.sample, populated=populated))
    cgs = plan([w], {"nodeagent.slice/j": deadline_job(60, due_in)})
    assert note(cgs["nodeagent.slice/j"]).status == status
    assert not any(
        line.startswith("deadlines: deadline in") for line in cgs["nodeagent.slice/j"].trace
    )


def test_reservations_are_planned_around() -> None:
    """2 CPUs with 1 reserved for inference: a job needing 1.5 cores no longer fits."""
    policy = spec({"a": 1})
    reserved = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"a": {"shares": 1}},
            "classes": {"inference": {"reserved_cpu": "50%"}},
        }
    )
    assignments = {"nodeagent.slice/j": deadline_job(150, 100)}
    states = [running("nodeagent.slice/j", 0, threads=2)]
    assert note(plan(states, assignments, policy)["nodeagent.slice/j"]).status == "on-track"
    assert note(plan(states, assignments, reserved)["nodeagent.slice/j"]).status == "predicted-miss"


def test_a_reserved_class_gets_its_reservation_on_top_of_its_share() -> None:
    """4 CPUs, inference reserves 1; inference (1 cgroup) and batch (3 cgroups) in one tenant:
    the pool of 3 cores is split over 4 workloads (0.75 each), inference gets 1.75."""
    policy = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"a": {"shares": 1}},
            "classes": {"inference": {"reserved_cpu": 1}},
        }
    )
    states = [running(f"nodeagent.slice/w-{i}", 0) for i in range(4)]
    assignments = {
        s.path: Assignment("r", "a", WorkloadClass.INFERENCE if i == 0 else WorkloadClass.BATCH)
        for i, s in enumerate(states)
    }
    cgs = plan(states, assignments, policy, cpus=4)
    w = [weight(cgs[s.path]) for s in states]
    assert w[0] / w[1] == pytest.approx(1.75 / 0.75, rel=0.02)
    assert w[1] == w[2] == w[3]
    assert sum(w) == pytest.approx(400, abs=2)


def test_one_busy_workload_against_a_thousand_keeps_its_half() -> None:
    """Equal shares; per-workload weights would need 50050 for the lone one: clamping it
    alone gave it a sixth. The group is scaled instead, so the ratio holds."""
    states = [running("nodeagent.slice/a-1", 0, rate=None)] + [
        running(f"nodeagent.slice/b-{i}", 0, rate=None) for i in range(1000)
    ]
    assignments = {
        s.path: Assignment("r", s.path.split("/")[1][0], WorkloadClass.BATCH) for s in states
    }
    cgs = plan(states, assignments)
    a = weight(cgs["nodeagent.slice/a-1"])
    b = sum(weight(cgs[f"nodeagent.slice/b-{i}"]) for i in range(1000))
    assert a == 10_000
    assert a / (a + b) == pytest.approx(0.5, rel=0.01)
