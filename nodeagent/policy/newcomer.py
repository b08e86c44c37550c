"""A new cgroup's plan, at once: what the fast path writes before the next full tick.

When inotify reports a workload cgroup the rules or a job claim, the daemon applies this
small plan to it alone instead of waiting for (or running) a full tick: its rule's
static caps and memory protection (StaticLimits), and the cpu.weight its tenant's other
workloads under the same parent got in the last full tick (SiblingWeight: they share it,
as fair share splits a tenant's part evenly). A newcomer with no such sibling keeps the
kernel's default weight until the full tick, which stays the source of truth and follows
within an interval: it then has the newcomer's usage, its deadline, and every other policy.
A job `nodeagent exec` starts gets the same plan, written before its process moves in.

The plan is the pipeline's own (`make_plan` with these two policies), so its merge rules,
error isolation and traces are the full tick's: a newcomer a policy cannot plan is skipped
(no targets at all, as a full tick skips it), and the trace reads as a tick's, after a
first line that says it is the fast path's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy.base import Assignment, Decision, Output, Policy, PolicyInput
from nodeagent.policy.limits import StaticLimits
from nodeagent.policy.plan import Plan, make_plan
from nodeagent.policy.weights import parent
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState


@dataclass(frozen=True)
class Siblings:
    """The cpu.weight a full tick's plan gave each tenant's workloads without a deadline,
    by parent (the most common one, should they differ): what a newcomer beside them
    gets. Made once per plan (`of`), so that each newcomer costs a lookup, not a pass
    over every cgroup of the node."""

    seq: int
    """The tick whose plan it is."""
    weights: Mapping[tuple[str, str], int]
    """(parent, tenant) -> weight."""

    @classmethod
    def of(cls, plan: Plan) -> Siblings:
        seen: dict[tuple[str, str], Counter[int]] = {}
        for cg in plan.cgroups:
            a = cg.assignment
            t = cg.targets.get(Attribute.CPU_WEIGHT)
            if (
                a is not None
                and a.deadline is None
                and t is not None
                and isinstance(t.value, CpuWeight)
            ):
                seen.setdefault((parent(cg.path), a.tenant), Counter())[t.value.value] += 1
        weights = {key: counts.most_common(1)[0][0] for key, counts in seen.items()}
        return cls(plan.seq, weights)


class SiblingWeight(Policy):
    """The fast path's weight: a newcomer without a deadline gets the cpu.weight its tenant's
    workloads under the same parent got in the last full tick's plan (`Siblings`)."""

    name = "sibling-weight"
    writes = frozenset({Attribute.CPU_WEIGHT})

    def __init__(self, siblings: Siblings | None) -> None:
        self.siblings = siblings

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        if self.siblings is None:
            return []
        out: list[Output] = []
        for w in given.snapshot.workloads:
            a = given.assignments.get(w.path)
            if a is None or a.deadline is not None:
                continue
            weight = self.siblings.weights.get((parent(w.path), a.tenant))
            if weight is None:
                continue
            reason = (
                f"fast path: the weight of tenant {a.tenant}'s workloads beside it"
                f" in tick {self.siblings.seq}"
            )
            out.append(Decision(w.path, Attribute.CPU_WEIGHT, CpuWeight(weight), self.name, reason))
        return out


FAST_PATH = "fast path: a new cgroup, before the next tick"


def plan_newcomers(
    identities: Sequence[WorkloadIdentity],
    assignments: Mapping[str, Assignment],
    spec: PolicySpec,
    *,
    siblings: Siblings | None,
    node: NodeState,
    wall_time: float,
) -> tuple[Plan, NodeSnapshot]:
    """The plan for the claimed newcomers, and the snapshot it is made from (nothing read:
    the executor re-reads each file it writes). The pipeline's own (`make_plan`) with its
    few policies: StaticLimits, then SiblingWeight. A policy that fails as a whole fails
    the fast path (RuntimeError): the full tick follows."""
    states = tuple(WorkloadState(i, CgroupSample()) for i in identities if i.path in assignments)
    snapshot = NodeSnapshot(0, wall_time, None, node, states)
    claimed = {w.path: assignments[w.path] for w in states}
    policies = (StaticLimits(), SiblingWeight(siblings))
    plan = make_plan(snapshot, spec, {}, policies, assignments=claimed)
    if plan.problems:
        raise RuntimeError("; ".join(plan.problems))
    cgroups = tuple(replace(cg, trace=(FAST_PATH, *cg.trace)) for cg in plan.cgroups)
    return replace(plan, cgroups=cgroups), snapshot
