"""A freeze never outlives the agent's claim (issue 33, defect 1): a cgroup that protection or
GPU verification froze, and that is no longer among the tick's workloads, is thawed where it
still exists (a reload unclaimed it, it was renamed away) or forgotten (it was found removed);
one the sensor skipped for a tick stays frozen and remembered. Policies from hand-built ticks;
the executor on a fixture tree, with a labelled fake of systemd's D-Bus side (the real kernel
is in tests/kernel/test_freeze_claim.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from builders import docker, job, snapshot, workload

from nodeagent.act import Executor, Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, Frozen
from nodeagent.errors import NodeagentError
from nodeagent.gpu.model import GpuState, Topology
from nodeagent.policy.base import Assignment, Decision, Output, Policy, PolicyInput
from nodeagent.policy.gpu_checks import GpuChecks
from nodeagent.policy.plan import Plan, make_plan
from nodeagent.policy.protection import Protection
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.snapshot import CgroupSample, NodeSnapshot, Skipped, WorkloadState

INFER, BATCH = "nodeagent.slice/infer", "nodeagent.slice/batch"
RENAMED = "nodeagent.slice/batch-renamed"
POLICY = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"a": {"shares": 1}},
        "classes": {"batch": {"floor_cpu": 0.2}},
        "protection": {"cpu_pressure": 0.1, "calm_ticks": 2, "freeze_after": 2},
        "gpu": {"on_violation": "freeze"},
    }
)
CLAIMS = {
    INFER: Assignment("i", "a", WorkloadClass.INFERENCE),
    BATCH: Assignment("b", "a", WorkloadClass.BATCH),
    RENAMED: Assignment("b", "a", WorkloadClass.BATCH),
}
SCOPE = docker().path
NOBODY_GPUS = GpuState((), Topology(), (), (), (), "fake", True)
"""A GPU node with nothing running: no violation (labelled fake)."""


def state(path: str, frozen: bool, stall: float = 0.0) -> WorkloadState:
    sample = CgroupSample(
        populated=True, cpu_usage_us=1, settings={Attribute.FREEZE: Frozen(frozen)}
    )
    return WorkloadState(job(path), sample, 0.5, 0.0, stall)


def tick(
    policy: Policy,
    workloads: Sequence[WorkloadState],
    carried: Mapping[str, Mapping[str, object]],
    skipped: Sequence[str] = (),
    vanished: Sequence[str] = (),
) -> Plan:
    snap = replace(
        snapshot(workloads),
        skipped=tuple(Skipped(job(p), "sense", "cpu.stat: EIO") for p in skipped),
        vanished=tuple(vanished),
        gpus=NOBODY_GPUS,
    )
    claimed = {p: a for p, a in CLAIMS.items() if p in {w.path for w in workloads}}
    return make_plan(snap, POLICY, {}, [policy], assignments=claimed, carried=carried)


def thaws(plan: Plan) -> dict[str, str]:
    """The cgroups outside the tick's workloads the plan thaws, and the policy that does."""
    out = {}
    for cg in getattr(plan, "thaws", ()):
        t = cg.targets[Attribute.FREEZE]
        assert t.value == Frozen(False)
        out[cg.path] = t.policy
    return out


def remembered(plan: Plan, policy: str) -> list[str]:
    carry = plan.carry[policy]
    return sorted({str(p) for key in ("frozen", "thaw") for p in carry.get(key, [])})  # type: ignore[attr-defined]


PROTECTION_FROZE = {"protection": {"frozen": [BATCH], "pinned": 1}}
GPU_CHECKS_FROZE = {"gpu-checks": {"frozen": [BATCH]}}
CASES = [(Protection(), PROTECTION_FROZE), (GpuChecks(), GPU_CHECKS_FROZE)]
IDS = ["protection", "gpu-checks"]


@pytest.mark.parametrize(("policy", "carried"), CASES, ids=IDS)
@pytest.mark.parametrize("how", ["a reload unclaims it", "renamed away"])
def test_a_frozen_cgroup_no_longer_among_the_workloads_is_thawed_and_forgotten(
    policy: Policy, carried: Mapping[str, Mapping[str, object]], how: str
) -> None:
    """BATCH is frozen, then no longer a workload: a reload's policy does not claim it (it is
    not sensed), or it was renamed (its new name is a workload of its own). A thaw of it is
    planned at once, outside the workloads, by the policy that froze it; its carried state
    lets it go (the executor tries the thaw until it lands: no thaw planned every tick)."""
    workloads = [state(INFER, False, stall=0.5)]
    if how == "renamed away":
        workloads.append(state(RENAMED, True))
    plan = tick(policy, workloads, carried)
    assert thaws(plan) == {BATCH: policy.name}
    assert BATCH not in remembered(plan, policy.name)
    assert not plan.problems, plan.problems
    (cg,) = plan.thaws
    assert (cg.write, cg.assignment) == ("direct", None), "nodeagent's own: written directly"


@pytest.mark.parametrize(("policy", "carried"), CASES, ids=IDS)
def test_a_frozen_cgroup_the_sensor_skipped_for_a_tick_stays_frozen_and_remembered(
    policy: Policy, carried: Mapping[str, Mapping[str, object]]
) -> None:
    """BATCH is still claimed, but one of its files could not be read this tick: nothing is
    known of it, so it is left as it is (no freeze, no thaw planned: it is not sensed) and
    remembered; read again the next tick, the policy plans it as before."""
    plan = tick(policy, [state(INFER, False, stall=0.5)], carried, skipped=[BATCH])
    assert thaws(plan) == {}
    assert remembered(plan, policy.name) == [BATCH]
    assert not plan.problems, plan.problems
    again = tick(policy, [state(INFER, False), state(BATCH, True)], plan.carry)
    assert BATCH in {cg.path for cg in again.cgroups if Attribute.FREEZE in cg.targets}


@pytest.mark.parametrize(("policy", "carried"), CASES, ids=IDS)
def test_a_frozen_cgroup_skipped_then_unclaimed_is_thawed(
    policy: Policy, carried: Mapping[str, Mapping[str, object]]
) -> None:
    skipped = tick(policy, [state(INFER, False, stall=0.5)], carried, skipped=[BATCH])
    unclaimed = tick(policy, [state(INFER, False, stall=0.5)], skipped.carry)
    assert thaws(unclaimed) == {BATCH: policy.name}
    assert remembered(unclaimed, policy.name) == []


@pytest.mark.parametrize(("policy", "carried"), CASES, ids=IDS)
def test_a_frozen_cgroup_found_removed_is_forgotten(
    policy: Policy, carried: Mapping[str, Mapping[str, object]]
) -> None:
    plan = tick(policy, [state(INFER, False, stall=0.5)], carried, vanished=[BATCH])
    assert thaws(plan) == {}
    assert remembered(plan, policy.name) == []


def test_protection_thaws_an_unclaimed_cgroup_it_was_already_thawing() -> None:
    """Calm came, and BATCH was next to thaw (carried `thaw`); a reload unclaimed it before
    the kernel showed it thawed: the thaw is still planned, outside the workloads."""
    carried = {"protection": {"thaw": [BATCH], "calm": 2}}
    plan = tick(Protection(), [state(INFER, False)], carried)
    assert thaws(plan) == {BATCH: "protection"}
    assert remembered(plan, "protection") == []


def test_a_freeze_of_a_cgroup_outside_the_workloads_is_never_planned() -> None:
    """Only thaws are planned outside the workloads: a policy's freeze of a cgroup that is
    not sensed stays a problem of the plan, never a write."""

    class Stray(Protection):
        name = "stray"

        def decide(self, given: PolicyInput) -> Sequence[Output]:
            return [Decision(BATCH, Attribute.FREEZE, Frozen(True), self.name, "stray")]

    plan = tick(Stray(), [state(INFER, False)], {})
    assert thaws(plan) == {}
    assert plan.problems == (f"policy stray planned {BATCH}, which is not sensed",)


# --- the executor -------------------------------------------------------------------------


class FakeSystemd:
    """Stands in for nodeagent.sdbus.Systemd (labelled fake): records calls; the first
    `fail` calls of freeze_unit raise, as a refused D-Bus call does."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail = fail

    def unit_for_cgroup(self, cgroup: str) -> str:
        return cgroup.rsplit("/", 1)[-1]

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None:
        self.calls.append((unit, dict(properties)))

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        if self.fail:
            self.fail -= 1
            raise NodeagentError(f"ThawUnit {unit}: refused")
        self.calls.append((unit, frozen))


def cgroup(root: Path, path: str, freeze: str) -> Path:
    d = root / path
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("")
    (d / "cgroup.freeze").write_text(freeze + "\n")
    return d


def unclaimed(path: str) -> tuple[Plan, NodeSnapshot]:
    """A tick after a reload that unclaimed `path`, which GPU verification had frozen."""
    snap = replace(snapshot([workload(INFER)]), gpus=NOBODY_GPUS)
    carried = {"gpu-checks": {"frozen": [path]}}
    plan = make_plan(snap, POLICY, {}, [GpuChecks()], assignments={}, carried=carried)
    return plan, snap


Audit = list[tuple[object, ...]]


def test_the_executor_thaws_a_cgroup_outside_the_workloads_directly_and_audits_it(
    tmp_path: Path,
) -> None:
    d = cgroup(tmp_path, BATCH, "1")
    plan, snap = unclaimed(BATCH)
    audit: Audit = []
    executor = Executor(CgroupTree(str(tmp_path)), lambda *a: audit.append(a))
    (r,) = executor.apply(plan, snap)
    assert (r.path, r.outcome, r.old, r.new) == (BATCH, Outcome.WRITTEN, "1", "0")
    assert (d / "cgroup.freeze").read_text().strip() == "0"
    ((file, attribute, old, new, reason),) = audit
    assert (file, attribute, old, new) == (f"{tmp_path}/{BATCH}/cgroup.freeze", Attribute.FREEZE,
                                           "1", "0")  # fmt: skip
    assert reason == "thawed: no longer a workload the agent plans (unclaimed, or gone)"
    assert executor.apply(plan, snap)[0].outcome is Outcome.UNCHANGED, "read, not written again"


def test_the_executor_thaws_a_systemd_scope_outside_the_workloads_through_thaw_unit(
    tmp_path: Path,
) -> None:
    cgroup(tmp_path, SCOPE, "1")
    plan, snap = unclaimed(SCOPE)
    assert plan.thaws[0].write == "systemd"
    fake = FakeSystemd()
    audit: Audit = []
    (r,) = Executor(CgroupTree(str(tmp_path)), lambda *a: audit.append(a), units=fake).apply(
        plan, snap
    )
    assert r.outcome is Outcome.WRITTEN
    assert fake.calls == [(SCOPE.rsplit("/", 1)[-1], False)], "ThawUnit, and no properties"
    assert [(a[2], a[3]) for a in audit] == [("1", "0")]


def test_a_thaw_outside_the_workloads_that_fails_is_tried_again_until_it_lands(
    tmp_path: Path,
) -> None:
    """The policy planned it once and let it go; the executor keeps trying it, even with a
    plan that no longer holds it, until it is written."""
    cgroup(tmp_path, SCOPE, "1")
    plan, snap = unclaimed(SCOPE)
    fake = FakeSystemd(fail=1)
    executor = Executor(CgroupTree(str(tmp_path)), lambda *a: None, units=fake)
    assert [r.outcome for r in executor.apply(plan, snap)] == [Outcome.FAILED]
    later = replace(plan, thaws=())
    assert [r.outcome for r in executor.apply(later, snap)] == [Outcome.WRITTEN]
    assert executor.apply(later, snap) == [], "landed: not tried again"


def test_a_thaw_outside_the_workloads_of_a_cgroup_that_is_gone_is_forgotten(
    tmp_path: Path,
) -> None:
    plan, snap = unclaimed(BATCH)
    executor = Executor(CgroupTree(str(tmp_path)), lambda *a: None)
    assert [r.outcome for r in executor.apply(plan, snap)] == [Outcome.VANISHED]
    assert executor.apply(replace(plan, thaws=()), snap) == []


def test_a_read_only_cgroup_outside_the_workloads_is_never_written(tmp_path: Path) -> None:
    user = "user.slice/user-1000.slice/user@1000.service/app.slice/x.scope"
    d = cgroup(tmp_path, user, "1")
    plan, snap = unclaimed(user)
    executor = Executor(CgroupTree(str(tmp_path)), lambda *a: None, units=FakeSystemd())
    assert [r.outcome for r in executor.apply(plan, snap)] == [Outcome.READ_ONLY]
    assert (d / "cgroup.freeze").read_text() == "1\n"
    assert executor.apply(replace(plan, thaws=()), snap) == [], "not tried again"
