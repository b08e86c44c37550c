"""When the loop plans anew and when it makes the last plan again.

Planning is the tick's dearest pure step, and on a steady node its answer does not change:
the cache keeps the last plan's key (what a plan depends on) and makes that plan again,
with the usage history advanced, until the key changes, `agent.replan_interval` passes, or
something that moves every tick asks for a new one (a policy's own staleness, a memory.max
the executor holds back). Pure: the caller passes the clock, the last plan and the feedback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from nodeagent.policy import history
from nodeagent.policy.base import Assignment, Policy
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.plan import Plan, make_plan
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import NodeSnapshot, WorkloadState


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What one tick hands the cache: the tick's snapshot and claims, the state the last
    tick left (usage history, the policies' carried state, the plan it applied), and
    whether the executor holds a write back until usage fits (a new plan every tick)."""

    snapshot: NodeSnapshot
    spec: PolicySpec
    usage: Mapping[str, float]
    carry: Mapping[str, Mapping[str, object]]
    assignments: Mapping[str, Assignment]
    last: Plan | None
    held_back: bool = False


class PlanCache:
    """The key of the last plan made, and when it must be made anew regardless."""

    def __init__(self) -> None:
        self._key: object = None
        self._replan_at = 0.0
        self._seen = _Seen()
        self._assigned: tuple[object, dict[str, Assignment], frozenset[str]] = (
            None,
            {},
            frozenset(),
        )
        """The last plan's assignments and their outer claims, for as long as it is made
        again (same cgroups)."""

    def expire(self) -> None:
        """Plan anew at the next tick (a reload)."""
        self._replan_at = 0.0

    def plan(
        self, given: PlanInputs, policies: tuple[Policy, ...], now: float
    ) -> tuple[Plan, bool]:
        """A new plan when something it depends on changed, or `agent.replan_interval`
        has passed (`now` on the monotonic clock); otherwise the last one again, with the
        usage history advanced; and whether it is the last one. What a plan depends on:
        which workloads there are and which are busy, what could not be read, the GPUs'
        holders, each tenant's part of the usage history (to the percent), and anything
        that moves every tick: a memory.max waiting for usage to fit, or what a policy says
        makes its plan stale (`Policy.stale`, `Policy.stale_sensed`: deadline jobs, a
        protected cgroup under pressure, the protection controller at work); and which rule
        claims each workload, as what (a container renamed or relabelled)."""
        snapshot, spec, last = given.snapshot, given.spec, given.last
        version, stalled = self._sensed(snapshot.workloads, spec, policies, given.assignments)
        key = self.key(given, version)
        moving = given.held_back or stalled
        moving = moving or stale(policies, given.carry, given.assignments)
        if last is not None and key == self._key and now < self._replan_at and not moving:
            if self._assigned[0] is not last.cgroups:  # kept by every plan made again
                assigned = last.assignments()
                self._assigned = (last.cgroups, assigned, frozenset(outer_claims(assigned)))
            _, assigned, outer = self._assigned
            usage = history.advance(
                given.usage, snapshot, assigned, spec.fair_share.half_life, outer
            )
            again = replace(
                last, seq=snapshot.seq, wall_time=snapshot.wall_time, tenant_usage=usage
            )
            return again, True
        self._key, self._replan_at = key, now + spec.agent.replan_interval
        plan = make_plan(
            snapshot,
            spec,
            given.usage,
            policies,
            assignments=given.assignments,
            carried=given.carry,
        )
        return plan, False

    def key(self, given: PlanInputs, version: int) -> object:
        """What a plan depends on, besides what moves every tick; `version`: the
        workloads' (`_sensed`)."""
        snapshot, gpus = given.snapshot, given.snapshot.gpus
        return (
            version,
            frozenset(s.path for s in snapshot.skipped),
            frozenset(w.path for w in snapshot.levels),
            None
            if gpus is None
            else (gpus.holds, tuple((p.pid, p.device_uuid) for p in gpus.processes)),
            usage_shares(given.usage),
        )

    def _sensed(
        self,
        workloads: tuple[WorkloadState, ...],
        spec: PolicySpec,
        policies: tuple[Policy, ...],
        assignments: Mapping[str, Assignment],
    ) -> tuple[int, bool]:
        """What the plan's key and its staleness take from the workloads: a version that
        moves when a workload comes or goes or turns active or idle, and whether a policy
        finds one stale (`Policy.stale_sensed`: one stalls). Each workload is looked at
        again only when its state is a new object (the sensor keeps an unchanged one), so
        a steady node costs one identity check per workload, not sets of them all."""
        seen = self._seen
        if seen.spec is not spec or seen.policies != policies:
            seen = self._seen = _Seen(spec, policies, seen.version + 1)
        # which rule claims each workload, with what tenant, class and limits: a container
        # renamed or relabelled (or a pod's edit through the API watch) is claimed anew at
        # once, not at the next replan_interval; the same mapping (a steady tick) costs one
        # identity check
        changed = assignments is not seen.claims and assignments != seen.claims
        seen.claims = assignments
        for w in workloads:
            path = w.identity.path
            last = seen.states.get(path)
            if last is w:
                continue
            seen.states[path] = w
            changed |= last is None
            if is_active(w, spec.fair_share) != (path in seen.active):
                seen.active ^= {path}
                changed = True
            if any(p.stale_sensed((w,), spec, assignments) for p in policies):
                seen.stale.add(path)
            else:
                seen.stale.discard(path)
        if len(seen.states) != len(workloads):  # some went
            for path in seen.states.keys() - {w.identity.path for w in workloads}:
                del seen.states[path]
                seen.active.discard(path)
                seen.stale.discard(path)
            changed = True
        if changed:
            seen.version += 1
        return seen.version, bool(seen.stale)


@dataclass
class _Seen:
    """The workloads as `PlanCache._sensed` last saw them, under one policy."""

    spec: PolicySpec | None = None
    policies: tuple[Policy, ...] = ()
    version: int = 0
    states: dict[str, WorkloadState] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)
    claims: Mapping[str, Assignment] = field(default_factory=dict)


def stale(
    policies: tuple[Policy, ...],
    carry: Mapping[str, Mapping[str, object]],
    assignments: Mapping[str, Assignment],
) -> bool:
    """A policy says its carried state or the workloads it plans need a new plan next
    tick (the protection controller at work, deadline jobs)."""
    return any(p.stale(carry.get(p.name, {}), assignments) for p in policies)


def usage_shares(usage: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """Each tenant's part of the decayed usage, to the percent: fair share re-plans when
    it moves, and not for every last core-second."""
    total = sum(usage.values())
    return tuple(sorted((t, round(u / total, 2) if total else 0.0) for t, u in usage.items()))
