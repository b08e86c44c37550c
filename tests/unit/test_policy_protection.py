"""Inference first: throttle lower classes in steps while a protected cgroup stalls,
freeze when throttling is not enough, release gradually, from hand-built ticks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest
from builders import job, snapshot

from nodeagent.cgroupfs.values import Attribute, CpuMax, Frozen
from nodeagent.policy.base import Assignment
from nodeagent.policy.plan import Plan, make_plan
from nodeagent.policy.protection import Protection
from nodeagent.policyfile.model import DeadlineGrant, PolicySpec, WorkloadClass
from nodeagent.snapshot import CgroupSample, WorkloadState

INFER, BATCH, TRAIN = "nodeagent.slice/infer", "nodeagent.slice/batch", "nodeagent.slice/train"
POLICY = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"a": {"shares": 1}},
        "classes": {"batch": {"floor_cpu": 0.2}, "training": {"floor_cpu": 0.2}},
        "protection": {"cpu_pressure": 0.1, "step": 0.5, "calm_ticks": 2, "freeze_after": 2},
    }
)
ASSIGNED = {
    INFER: Assignment("i", "a", WorkloadClass.INFERENCE),
    BATCH: Assignment("b", "a", WorkloadClass.BATCH),
    TRAIN: Assignment("t", "a", WorkloadClass.TRAINING),
}


def tick(
    stall: float,
    carried: Mapping[str, Mapping[str, object]],
    kernel: Mapping[str, Mapping[Attribute, object]] | None = None,
    used: float | None = 1.6,
) -> Plan:
    """One tick on 4 CPUs: the inference cgroup stalls `stall` of the time, batch and
    training each use `used` cores (None: not known yet, as on the first tick)."""
    states = []
    for path, rate, s in ((INFER, 0.5, stall), (BATCH, used, 0.0), (TRAIN, used, 0.0)):
        settings = dict((kernel or {}).get(path, {}))
        sample = CgroupSample(populated=True, cpu_usage_us=1, settings=settings)  # type: ignore[arg-type]
        states.append(WorkloadState(job(path), sample, rate, 0.0, s))
    snap = snapshot(states)
    snap = replace(snap, node=replace(snap.node, cpu_count=4))
    return make_plan(snap, POLICY, {}, [Protection()], assignments=ASSIGNED, carried=carried)


def cap(plan: Plan, path: str) -> float | None:
    cg = next(c for c in plan.cgroups if c.path == path)
    t = cg.targets.get(Attribute.CPU_MAX)
    if t is None:
        return None
    assert isinstance(t.value, CpuMax)
    return t.value.cores


def frozen(plan: Plan, path: str) -> bool | None:
    cg = next(c for c in plan.cgroups if c.path == path)
    t = cg.targets.get(Attribute.FREEZE)
    return None if t is None else t.value == Frozen(True)


def test_lower_classes_are_throttled_in_steps_down_to_their_floor() -> None:
    carried: Mapping[str, Mapping[str, object]] = {}
    caps = []
    for _ in range(3):
        plan = tick(0.4, carried)  # far over the 10% threshold: full steps of 50%
        carried = plan.carry
        caps.append(cap(plan, BATCH))
        assert cap(plan, INFER) is None, "the protected class is never throttled"
    assert caps == pytest.approx([0.8, 0.4, 0.2])
    assert cap(plan, TRAIN) == pytest.approx(0.2)
    note = next(n for n in plan.notes if n.kind == "protection")
    assert note.status == "throttling batch,training"


def test_a_small_excess_takes_a_smaller_step() -> None:
    plan = tick(0.11, {})  # 10% over the threshold: a quarter step (the smallest)
    assert cap(plan, BATCH) == pytest.approx(1.6 * (1 - 0.5 * 0.25))


def test_freeze_when_throttling_is_not_enough_then_thaw_and_release() -> None:
    carried: Mapping[str, Mapping[str, object]] = {}
    for _ in range(2):
        carried = tick(0.4, carried).carry
    plan = tick(0.4, carried)  # down to the floors: the 1st tick pinned there
    carried = plan.carry
    assert frozen(plan, BATCH) is None
    plan = tick(0.4, carried)  # 2nd tick: freeze_after reached
    carried = plan.carry
    assert frozen(plan, BATCH) is True, "batch has the lowest priority of the two"
    assert frozen(plan, TRAIN) is None
    assert cap(plan, BATCH) is None, "a frozen cgroup needs no cap"

    kernel = {BATCH: {Attribute.FREEZE: Frozen(True)}}
    plan = tick(0.0, carried, kernel)  # calm 1
    carried = plan.carry
    assert frozen(plan, BATCH) is True
    plan = tick(0.0, carried, kernel)  # calm 2: thaw first
    carried = plan.carry
    assert frozen(plan, BATCH) is False
    assert cap(plan, TRAIN) == pytest.approx(0.2), "caps wait until the thaw"
    plan = tick(0.0, carried)  # still calm: caps rise by 10% of 4 CPUs a tick
    assert cap(plan, TRAIN) == pytest.approx(0.6)
    carried = plan.carry
    for _ in range(10):  # 0.6 + 9 x 0.4 reaches the 4 CPUs: the caps are lifted
        plan = tick(0.0, carried, {TRAIN: {Attribute.CPU_MAX: CpuMax(60_000)}})
        carried = plan.carry
    assert next(n for n in plan.notes if n.kind == "protection").status == "idle"


def test_a_lifted_cap_is_given_back_until_the_kernel_shows_it() -> None:
    carried = tick(0.11, {}).carry  # batch capped at 1.4 cores
    capped = {p: {Attribute.CPU_MAX: CpuMax(140_000)} for p in (BATCH, TRAIN)}
    targets = []
    for _ in range(9):  # calm: 2 ticks to wait, then +0.4 a tick from 1.4 up to 4 CPUs
        plan = tick(0.0, carried, capped)
        carried = plan.carry
        cg = next(c for c in plan.cgroups if c.path == BATCH)
        targets.append(cg.targets[Attribute.CPU_MAX].value)
    cores = [t.cores for t in targets if isinstance(t, CpuMax)]
    assert cores[:7] == pytest.approx([1.4, 1.8, 2.2, 2.6, 3.0, 3.4, 3.8])
    assert targets[7:] == [CpuMax(None)] * 2, "given back (max: no static cap) until it shows"
    plan = tick(0.0, carried, {p: {Attribute.CPU_MAX: CpuMax(None)} for p in (BATCH, TRAIN)})
    assert Attribute.CPU_MAX not in next(c for c in plan.cgroups if c.path == BATCH).targets
    assert plan.carry["protection"]["uncap"] == []


def test_turning_protection_off_gives_everything_back() -> None:
    carried = tick(0.4, {}).carry
    off = POLICY.model_copy(
        update={"protection": POLICY.protection.model_copy(update={"enabled": False})}
    )
    states = []
    for path, rate in ((INFER, 0.5), (BATCH, 1.6), (TRAIN, 1.6)):
        sample = CgroupSample(
            populated=True, cpu_usage_us=1, settings={Attribute.CPU_MAX: CpuMax(80_000)}
        )
        states.append(WorkloadState(job(path), sample, rate, 0.0, 0.4))
    snap = replace(snapshot(states), node=replace(snapshot(states).node, cpu_count=4))
    plan = make_plan(snap, off, {}, [Protection()], assignments=ASSIGNED, carried=carried)
    for path in (BATCH, TRAIN):
        cg = next(c for c in plan.cgroups if c.path == path)
        assert cg.targets[Attribute.CPU_MAX].value == CpuMax(None)
    assert next(n for n in plan.notes if n.kind == "protection").status == "idle"


def reason(plan: Plan, path: str, attribute: Attribute) -> str | None:
    t = next(c for c in plan.cgroups if c.path == path).targets.get(attribute)
    return None if t is None else t.reason


@pytest.mark.parametrize(
    ("kernel", "start"),
    [
        ({}, 4.0),  # no limit: the node's 4 CPUs
        ({Attribute.CPU_MAX: CpuMax(100_000)}, 1.0),  # its current limit, 1 core
    ],
)
def test_the_first_throttle_starts_from_what_the_class_may_use_when_usage_is_unknown(
    kernel: Mapping[Attribute, object], start: float
) -> None:
    """Issue 13.15: on the first tick no usage is known, and the first cap went straight
    to the floor (0.2 here). It shrinks by one step (50% here) from the current limit, or
    from the node's CPUs when there is none, as it does from known usage."""
    plan = tick(0.4, {}, {BATCH: kernel, TRAIN: kernel}, used=None)
    assert cap(plan, BATCH) == pytest.approx(start * 0.5)
    assert cap(plan, TRAIN) == pytest.approx(start * 0.5)
    plan = tick(0.4, plan.carry, used=None)
    assert cap(plan, BATCH) == pytest.approx(max(0.2, start * 0.25)), "then a step a tick"


def test_a_frozen_cgroup_keeps_its_cap_and_no_reason_says_the_pressure_is_gone() -> None:
    """Issue 13.16: the tick that froze batch also lifted its cap "because pressure is
    gone". A frozen cgroup keeps the cap it had, so it is thawed under it."""
    carried: Mapping[str, Mapping[str, object]] = {}
    at_floor = {BATCH: {Attribute.CPU_MAX: CpuMax(20_000)}}
    for _ in range(3):
        carried = tick(0.4, carried, at_floor).carry
    plan = tick(0.4, carried, at_floor)  # freeze_after reached
    assert frozen(plan, BATCH) is True
    assert cap(plan, BATCH) == pytest.approx(0.2), "kept while frozen"
    why = reason(plan, BATCH, Attribute.CPU_MAX) or ""
    assert "pressure is gone" not in why and "frozen" in why, why
    kernel = {BATCH: {Attribute.CPU_MAX: CpuMax(20_000), Attribute.FREEZE: Frozen(True)}}
    plan = tick(0.4, plan.carry, kernel)
    assert cap(plan, BATCH) == pytest.approx(0.2), "and on every tick it stays frozen"


def test_a_pod_claimed_with_its_containers_is_capped_through_them() -> None:
    """Issue 13.12's nesting, in the protection controller: a class cap split over a pod
    and its two containers capped the pod at a third of it, and counted its usage twice."""
    from builders import CID, CID2, POD_UID, k8s_container

    from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity

    pod = WorkloadIdentity(
        f"kubepods/burstable/pod{POD_UID}",
        Kind.POD,
        Runtime.KUBELET,
        Owner.CGROUPFS,
        "pod",
        None,
        POD_UID,
        QosTier.BURSTABLE,
    )
    ctrs = [k8s_container(CID), k8s_container(CID2)]
    assigned = {INFER: ASSIGNED[INFER]} | {
        w.path: Assignment("be", "a", WorkloadClass.BATCH) for w in (pod, *ctrs)
    }
    sample = CgroupSample(populated=True, cpu_usage_us=1)
    states = [WorkloadState(job(INFER), sample, 0.5, 0.0, 0.4)]
    states += [
        WorkloadState(w, sample, r, 0.0, 0.0) for w, r in ((pod, 2.0), *((c, 1.0) for c in ctrs))
    ]
    snap = snapshot(states)
    snap = replace(snap, node=replace(snap.node, cpu_count=4))
    plan = make_plan(snap, POLICY, {}, [Protection()], assignments=assigned, carried={})
    assert cap(plan, pod.path) is None
    assert [cap(plan, c.path) for c in ctrs] == pytest.approx([0.5, 0.5]), "2 cores, a step down"


DUE, BESTEFFORT, NOW = "nodeagent.slice/due", "nodeagent.slice/be", 1_700_000_000.0


def declared(uid: int, spec: PolicySpec = POLICY, ticks: int = 12) -> list[Plan]:
    """`nodeagent exec --class batch --deadline +60s --work 1000` by `uid`, beside a busy
    besteffort workload, on 4 CPUs, for `ticks` ticks of the default policies: the job runs
    one thread at 0.3 cores and stalls 40% of the time, far short of any floor."""
    from nodeagent.jobs import Job

    exec_job = Job("due", DUE, "a", WorkloadClass.BATCH, uid, 4001, NOW - 10, NOW + 60, 1000.0)
    assigned = {
        DUE: exec_job.assignment(),
        BESTEFFORT: Assignment("be", "a", WorkloadClass.BESTEFFORT),
    }
    plans: list[Plan] = []
    carried: Mapping[str, Mapping[str, object]] = {}
    for n in range(ticks):
        states = []
        for path, rate, s, used in ((DUE, 0.3, 0.4, 3.0 + 0.3 * n), (BESTEFFORT, 3.0, 0.0, 1.0)):
            sample = CgroupSample(populated=True, cpu_usage_us=int(used * 1e6), threads=1)
            states.append(WorkloadState(job(path), sample, rate, 0.0, s))
        snap = snapshot(states, wall_time=NOW + n)
        snap = replace(snap, node=replace(snap.node, cpu_count=4))
        plan = make_plan(snap, spec, {}, assignments=assigned, carried=carried)
        carried = plan.carry
        plans.append(plan)
    return plans


def test_a_deadline_a_member_declares_throttles_and_freezes_nobody() -> None:
    """Issue 34 item 9: any member of the socket's group could `exec --deadline +1m --work
    <large>`; the job, short of the floor its own declaration gave it, had the protection
    controller throttle every lower class to its floor and then freeze it. A deadline is
    defended only where the policy grants it; by default a caller's is not planned at all."""
    for plan in declared(1000):
        assert cap(plan, BESTEFFORT) is None, "throttled on a caller's word"
        assert frozen(plan, BESTEFFORT) is None, "frozen on a caller's word"


def granting(grant: str) -> PolicySpec:
    batch = POLICY.classes[WorkloadClass.BATCH]
    batch = batch.model_copy(update={"declared_deadlines": DeadlineGrant(grant)})
    return POLICY.model_copy(update={"classes": {**POLICY.classes, WorkloadClass.BATCH: batch}})


@pytest.mark.parametrize(
    ("uid", "grant", "floor", "defended"),
    [
        (1000, "refused", False, False),
        (1000, "scheduled", True, False),
        (1000, "defended", True, True),
        (0, "refused", True, True),  # root's word is the operator's
    ],
)
def test_the_class_says_what_a_declared_deadline_gets(
    uid: int, grant: str, floor: bool, defended: bool
) -> None:
    """`classes.<c>.declared_deadlines`: refused (the default), not planned at all;
    scheduled, an EDF floor that protection does not defend; defended, as a rule's own
    deadline. The note says why a declared deadline is not defended."""
    plans = declared(uid, granting(grant))
    first = plans[0]
    cg = next(c for c in first.cgroups if c.path == DUE)
    target = first.cpu_targets.get(DUE)
    assert (target is not None and target.reason == "floor from deadlines") is floor
    grants = [n for n in cg.notes if n.kind == "deadline-grant"]
    if defended:
        assert grants == []
        assert any(cap(p, BESTEFFORT) is not None for p in plans)
        assert frozen(plans[-1], BESTEFFORT) is True
        return
    (note,) = grants
    assert note.status == grant
    assert note.fields["declared_by"] == "uid 1000 through nodeagent exec"
    assert f"classes.batch.declared_deadlines is {grant}" in note.message
    assert f"deadlines: {note.message}" in cg.trace, "explain says why"
    for plan in plans:
        assert cap(plan, BESTEFFORT) is None and frozen(plan, BESTEFFORT) is None


def test_a_floor_protection_does_not_defend_does_not_spare_its_job_a_cap() -> None:
    """While inference stalls, a batch deadline job is capped with its class, but never below
    its floor where the floor is defended; a floor on a caller's word alone spares nothing
    (else declaring a deadline would shield a job from inference-first)."""
    from nodeagent.jobs import Job

    caps = {}
    for grant in ("scheduled", "defended"):
        exec_job = Job("due", DUE, "a", WorkloadClass.BATCH, 1000, 4001, NOW - 10, NOW + 60, 50.0)
        assigned = {INFER: ASSIGNED[INFER], DUE: exec_job.assignment()}
        states = []
        for path, rate, s in ((INFER, 0.5, 0.4), (DUE, 1.0, 0.0)):
            sample = CgroupSample(populated=True, cpu_usage_us=3_000_000, threads=1)
            states.append(WorkloadState(job(path), sample, rate, 0.0, s))
        snap = snapshot(states, wall_time=NOW)
        snap = replace(snap, node=replace(snap.node, cpu_count=4))
        plan = make_plan(snap, granting(grant), {}, assignments=assigned, carried={})
        caps[grant] = cap(plan, DUE)
        floor = plan.cpu_targets[DUE].cores
    assert caps["defended"] == pytest.approx(floor), "raised to its defended floor"
    assert caps["scheduled"] is not None and caps["scheduled"] < floor - 0.1


def test_only_a_defended_deadline_has_its_pressure_read() -> None:
    """The controller watches (reads cpu.pressure every tick of) a deadline job only where it
    defends the deadline: a member's in a class that defends declared ones, or root's."""
    from nodeagent.jobs import Job

    def assignment(uid: int) -> Assignment:
        return Job(
            "due", DUE, "a", WorkloadClass.BATCH, uid, 4001, NOW, NOW + 60, 1000.0
        ).assignment()

    for grant, watched in (("refused", False), ("scheduled", False), ("defended", True)):
        assert Protection().needs(assignment(1000), granting(grant)).pressure is watched, grant
    assert Protection().needs(assignment(0), POLICY).pressure
