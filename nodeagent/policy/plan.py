"""Run the policies over one snapshot and merge their decisions into a plan.

The plan is the whole of what the agent wants, per cgroup, with the reasons
and the trace that `nodeagent explain` prints. Later policies in the list win
over earlier ones on the same attribute, and the trace says so.

Only the workloads in the snapshot are planned: a cgroup that vanished or could
not be read since discovery is simply absent. A cgroup a policy cannot plan is
marked skipped and gets no targets; a policy that fails as a whole is left out
of this tick and named in `Plan.problems`. Either way the rest is planned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeagent.cgroupfs.values import Attribute, Value
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy import history
from nodeagent.policy.base import Assignment, Policy, PolicyInput, Skip
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
    skipped: str | None = None
    """Why no plan could be made for this cgroup this tick; it then has no targets."""

    @property
    def path(self) -> str:
        return self.identity.path


@dataclass(frozen=True, slots=True)
class Plan:
    seq: int
    wall_time: float
    cgroups: tuple[CgroupPlan, ...]
    tenant_usage: Mapping[str, float]
    problems: tuple[str, ...] = ()
    """Policies that failed as a whole this tick (a bug): their targets are left out."""


def make_plan(
    snapshot: NodeSnapshot,
    spec: PolicySpec,
    previous_usage: Mapping[str, float],
    policies: Sequence[Policy] = DEFAULT_POLICIES,
    assignments: Mapping[str, Assignment] | None = None,
) -> Plan:
    """`assignments` may be passed in when the caller already classified the workloads;
    those of workloads missing from the snapshot are ignored."""
    identities = [w.identity for w in snapshot.workloads]
    if assignments is None:
        assignments = assign(identities, spec)
    else:
        sensed = {i.path for i in identities}
        assignments = {p: a for p, a in assignments.items() if p in sensed}
    usage = history.advance(previous_usage, snapshot, assignments, spec.fair_share.half_life)
    given = PolicyInput(snapshot, spec, assignments, usage)
    targets: dict[str, dict[Attribute, Target]] = {i.path: {} for i in identities}
    traces: dict[str, list[str]] = {i.path: [] for i in identities}
    skipped: dict[str, str] = {}
    problems: list[str] = []
    for policy in policies:
        try:
            outputs = policy.decide(given)
        except Exception as e:  # a bug in one policy must not stop the others
            problems.append(f"policy {policy.name} failed, left out this tick: {_error(e)}")
            continue
        for d in outputs:
            if d.path not in targets:
                problems.append(f"policy {policy.name} planned {d.path}, which is not sensed")
            elif isinstance(d, Skip):
                skipped.setdefault(d.path, f"{d.policy}: {d.reason}")
            else:
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
        CgroupPlan(
            i,
            assignments.get(i.path),
            {} if i.path in skipped else targets[i.path],
            tuple(traces[i.path]),
            skipped.get(i.path),
        )
        for i in identities
    )
    return Plan(snapshot.seq, snapshot.wall_time, cgroups, usage, tuple(problems))


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
