"""Run the policies over one snapshot and merge their decisions into a plan.

The plan is the whole of what the agent wants, per cgroup, with the reasons
and the trace that `nodeagent explain` prints. Later policies in the list win
over earlier ones on the same attribute, and the trace says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy import history
from nodeagent.policy.base import Assignment, Policy, PolicyInput
from nodeagent.policy.classify import assign
from nodeagent.policy.fairshare import FairShare
from nodeagent.policy.limits import StaticLimits
from nodeagent.snapshot import NodeSnapshot
from nodeagent.spec.model import PolicySpec

DEFAULT_POLICIES: tuple[Policy, ...] = (FairShare(), StaticLimits())


@dataclass(frozen=True, slots=True)
class Target:
    value: Value
    policy: str
    reason: str

    def render(self) -> str:
        return self.value.render()


@dataclass(frozen=True, slots=True)
class CgroupPlan:
    identity: WorkloadIdentity
    assignment: Assignment | None
    targets: Mapping[Attribute, Target]
    trace: tuple[str, ...]

    @property
    def path(self) -> str:
        return self.identity.path


@dataclass(frozen=True, slots=True)
class Plan:
    seq: int
    wall_time: float
    cgroups: tuple[CgroupPlan, ...]
    tenant_usage: Mapping[str, float]


def make_plan(
    snapshot: NodeSnapshot,
    spec: PolicySpec,
    previous_usage: Mapping[str, float],
    policies: Sequence[Policy] = DEFAULT_POLICIES,
    assignments: Mapping[str, Assignment] | None = None,
) -> Plan:
    """`assignments` may be passed in when the caller already classified the workloads."""
    identities = [w.identity for w in snapshot.workloads]
    if assignments is None:
        assignments = assign(identities, spec)
    usage = history.advance(previous_usage, snapshot, assignments, spec.fair_share.half_life)
    given = PolicyInput(snapshot, spec, assignments, usage)
    targets: dict[str, dict[Attribute, Target]] = {i.path: {} for i in identities}
    traces: dict[str, list[str]] = {i.path: [] for i in identities}
    for policy in policies:
        for d in policy.decide(given):
            earlier = targets[d.path].get(d.attribute)
            if earlier is not None:
                traces[d.path].append(f"{d.policy} overrides {earlier.policy} on {d.attribute}")
            targets[d.path][d.attribute] = Target(d.value, d.policy, d.reason)
            traces[d.path].extend(f"{d.policy}: {line}" for line in (*d.trace, d.reason))
    for path, assignment in assignments.items():
        traces[path].insert(
            0,
            f"matched rule {assignment.rule}: tenant {assignment.tenant},"
            f" class {assignment.workload_class}",
        )
    cgroups = tuple(
        CgroupPlan(i, assignments.get(i.path), targets[i.path], tuple(traces[i.path]))
        for i in identities
    )
    return Plan(snapshot.seq, snapshot.wall_time, cgroups, usage)
