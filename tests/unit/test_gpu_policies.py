"""GPU verification and power by class, from hand-built GPU states (labelled fakes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from builders import job, plan_claimed, snapshot, spec, workload

from nodeagent.cgroupfs.values import Attribute, Frozen
from nodeagent.gpu.model import Device, GpuProcess, GpuState, Hold, HoldKind, Telemetry, Topology
from nodeagent.policy.base import Assignment, DeviceDecision
from nodeagent.policy.gpu_checks import GpuChecks, violations
from nodeagent.policy.gpu_power import GpuPower, in_force
from nodeagent.policy.plan import make_plan
from nodeagent.policy.protection import Protection
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.snapshot import CgroupSample

G0, G1 = "GPU-aaaa", "GPU-bbbb"
DEVICES = tuple(
    Device(i, u, "fake GPU", f"0000:0{i}:00.0", i, 80 << 30, 0, (), None, simulated=True)
    for i, u in enumerate((G0, G1))
)
JOB = "nodeagent.slice/job-a"


def state(processes: tuple[GpuProcess, ...], holds: tuple[Hold, ...]) -> GpuState:
    telemetry = tuple(
        Telemetry(d.uuid, d.index, 0, 0, 80 << 30, 100_000, 700_000, 200_000, 700_000, 700_000, 40)
        for d in DEVICES
    )
    return GpuState(DEVICES, Topology(), telemetry, processes, holds, "fake", True)


HOLD = Hold("job-a", HoldKind.JOB, (G0,), (0,), cgroup=JOB, workload_class="training")


def test_a_process_on_a_gpu_its_cgroup_does_not_hold_is_a_violation() -> None:
    procs = (
        GpuProcess(10, G0, 1 << 30, JOB + "/worker"),  # its own GPU: fine
        GpuProcess(11, G1, 1 << 30, JOB),  # the other GPU: wrong-gpu
        GpuProcess(12, G1, 1 << 30, "system.slice/stray.service"),  # holds nothing
        GpuProcess(13, G1, 1 << 30, None),  # exited since NVML listed it
    )
    found = [(p.pid, kind) for p, kind, _ in violations(state(procs, (HOLD,)))]
    assert found == [(11, "wrong-gpu"), (12, "unassigned")]


@pytest.mark.parametrize("action", ["report", "freeze"])
def test_violations_are_noted_and_optionally_frozen(action: str) -> None:
    policy = PolicySpec.model_validate(
        {"version": 1, "tenants": {"a": {"shares": 1}}, "gpu": {"on_violation": action}}
    )
    snap = replace(snapshot([workload(JOB)]), gpus=state((GpuProcess(11, G1, None, JOB),), (HOLD,)))
    assignments = {JOB: Assignment("exec:job-a", "a", WorkloadClass.TRAINING)}
    plan = make_plan(snap, policy, {}, [GpuChecks()], assignments=assignments)
    (note,) = [n for n in plan.notes if n.kind == "gpu-violation"]
    assert (note.path, note.status, note.fields["pid"]) == (JOB, "wrong-gpu", 11)
    frozen = plan.cgroups[0].targets.get(Attribute.FREEZE)
    assert (frozen is not None and frozen.value == Frozen(True)) is (action == "freeze")


def test_caps_in_a_window_that_wraps_midnight() -> None:
    policy = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"a": {"shares": 1}},
            "gpu": {"power": [{"class": "training", "watts": 300, "from": "22:00", "to": "06:00"}]},
        }
    )
    (cap,) = policy.gpu.power
    assert in_force(cap, 23 * 3600) and in_force(cap, 3 * 3600)
    assert not in_force(cap, 12 * 3600)

    def devices(at: float) -> list[DeviceDecision]:
        snap = replace(snapshot([]), gpus=state((), (HOLD,)), local_seconds=at)
        return list(plan_claimed(snap, policy, {}, [GpuPower()]).devices)

    night = devices(23 * 3600)
    assert [(d.uuid, d.value) for d in night] == [(G0, 300_000)], "G1: at its default already"
    day = devices(12 * 3600)
    assert day == [], "by day the limits are the defaults already"


def test_a_cap_below_the_card_is_clamped() -> None:
    policy = PolicySpec.model_validate(
        {"version": 1, "tenants": {"a": {"shares": 1}},
         "gpu": {"power": [{"class": "training", "watts": 50}]}}
    )  # fmt: skip
    snap = replace(snapshot([]), gpus=state((), (HOLD,)))
    (d,) = plan_claimed(snap, policy, {}, [GpuPower()]).devices
    assert d.value == 200_000
    assert "clamped" in d.reason


def test_builders_still_build_snapshots_without_gpus() -> None:
    assert snapshot([workload(job("nodeagent.slice/x"))]).gpus is None
    assert spec({"a": 1}).gpu.power == ()


def test_a_violation_is_one_warning_in_the_audit_stream_not_one_per_tick() -> None:
    from structlog.testing import capture_logs

    from nodeagent.changes import NoteLog

    policy = PolicySpec.model_validate({"version": 1, "tenants": {"a": {"shares": 1}}})
    snap = replace(snapshot([workload(JOB)]), gpus=state((GpuProcess(11, G1, None, JOB),), (HOLD,)))
    notes = NoteLog()
    with capture_logs() as logs:
        for _ in range(3):  # three ticks see the same process on the same GPU
            notes.update(plan_claimed(snap, policy, {}, [GpuChecks()]).notes)
    found = [e for e in logs if e["event"].startswith("gpu-violation")]
    assert [(e["event"], e["log_level"], e["pid"]) for e in found] == [
        ("gpu-violation.wrong-gpu", "warning", 11)
    ]


@pytest.mark.parametrize("order", ["protection-first", "gpu-checks-first"])
def test_a_cgroup_protection_holds_frozen_is_not_thawed_by_gpu_checks(order: str) -> None:
    """GPU verification froze JOB for a violation that has ended, and wants it thawed;
    protection froze it too and still holds it. A freeze binds: the cgroup stays frozen, by
    protection, in either order (before the merge rule, the later policy won and the cgroup
    flapped thawed for a tick while protection's carry still held it frozen)."""
    policy = PolicySpec.model_validate(
        {"version": 1, "tenants": {"a": {"shares": 1}}, "gpu": {"on_violation": "freeze"}}
    )
    frozen = workload(JOB)
    frozen = replace(
        frozen, sample=CgroupSample(populated=True, settings={Attribute.FREEZE: Frozen(True)})
    )
    snap = replace(snapshot([frozen]), gpus=state((), (HOLD,)))
    assignments = {JOB: Assignment("exec:job-a", "a", WorkloadClass.TRAINING)}
    policies = [Protection(), GpuChecks()]
    if order == "gpu-checks-first":
        policies.reverse()
    carried = {"protection": {"frozen": [JOB]}, "gpu-checks": {"frozen": [JOB]}}
    plan = make_plan(snap, policy, {}, policies, assignments=assignments, carried=carried)
    target = plan.cgroups[0].targets[Attribute.FREEZE]
    assert (target.value, target.policy) == (Frozen(True), "protection")
