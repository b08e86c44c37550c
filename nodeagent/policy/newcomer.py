"""A new cgroup's plan, at once: what the fast path writes before the next full tick.

When inotify reports a workload cgroup the rules or a job claim, the daemon applies this
small plan to it alone instead of waiting for (or running) a full tick: its rule's
static caps and memory protection (StaticLimits, on its own), and the cpu.weight its
tenant's other workloads under the same parent got in the last full tick (they share
it, as fair share splits a tenant's part evenly). A newcomer with no such sibling keeps
the kernel's default weight until the full tick, which stays the source of truth and
follows within an interval: it then has the newcomer's usage, its deadline, and every
other policy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.identity import WorkloadIdentity
from nodeagent.ownership import write_mode
from nodeagent.policy.base import Assignment, Decision, PolicyInput, Skip
from nodeagent.policy.limits import StaticLimits
from nodeagent.policy.plan import CgroupPlan, Plan, Target, as_written, decide_isolated
from nodeagent.policy.weights import parent
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState


def sibling_weight(path: str, tenant: str, previous: Plan) -> tuple[int, int] | None:
    """(weight, tick) its tenant's workloads under the same parent had in the last plan."""
    seen: Counter[int] = Counter()
    for cg in previous.cgroups:
        a = cg.assignment
        t = cg.targets.get(Attribute.CPU_WEIGHT)
        if (
            a is not None
            and a.tenant == tenant
            and a.deadline is None
            and parent(cg.path) == parent(path)
            and t is not None
            and isinstance(t.value, CpuWeight)
        ):
            seen[t.value.value] += 1
    if not seen:
        return None
    return seen.most_common(1)[0][0], previous.seq


def plan_newcomers(
    identities: Sequence[WorkloadIdentity],
    assignments: Mapping[str, Assignment],
    spec: PolicySpec,
    *,
    previous: Plan | None,
    node: NodeState,
    wall_time: float,
) -> tuple[Plan, NodeSnapshot]:
    """The plan for the claimed newcomers, and the snapshot it is made from (nothing read:
    the executor re-reads each file it writes)."""
    states = tuple(WorkloadState(i, CgroupSample()) for i in identities if i.path in assignments)
    snapshot = NodeSnapshot(0, wall_time, None, node, states)
    claimed = {w.path: assignments[w.path] for w in states}
    given = PolicyInput(snapshot, spec, claimed, {})
    targets: dict[str, dict[Attribute, Target]] = {w.path: {} for w in states}
    traces: dict[str, list[str]] = {
        w.path: ["fast path: a new cgroup, before the next tick"] for w in states
    }
    outputs, failed = decide_isolated(StaticLimits(), given)
    if failed is not None:
        raise failed
    for d in outputs:
        if isinstance(d, Decision):
            targets[d.path][d.attribute] = Target(d.value, d.policy, d.reason)
            traces[d.path].append(f"{d.policy}: {d.reason}")
        elif isinstance(d, Skip):  # no caps it cannot plan; the next tick skips it too
            traces[d.path].append(f"{d.policy}: skipped: {d.reason}")
    for w in states:
        a = claimed[w.path]
        found = (
            None
            if previous is None or a.deadline is not None
            else sibling_weight(w.path, a.tenant, previous)
        )
        if found is not None:
            weight, tick = found
            reason = (
                f"fast path: the weight of tenant {a.tenant}'s workloads beside it in tick {tick}"
            )
            targets[w.path][Attribute.CPU_WEIGHT] = Target(CpuWeight(weight), "fast-path", reason)
            traces[w.path].append(reason)
    cgroups = []
    for w in states:
        mode = write_mode(w.identity, spec.agent)
        t = as_written(targets[w.path], mode)
        cgroups.append(
            CgroupPlan(w.identity, claimed[w.path], t, tuple(traces[w.path]), write=mode)
        )
    return Plan(0, wall_time, tuple(cgroups), {}), snapshot
