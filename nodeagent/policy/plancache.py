"""When the loop plans anew and when it makes the last plan again.

Planning is the tick's dearest pure step, and on a steady node its answer does not change:
the cache keeps the last plan's key and makes that plan again, with the usage history
advanced, until the key changes, `agent.replan_interval` passes, or something that moves
every tick asks for a new one (a memory.max the executor holds back, a policy at work).
The key is not kept by hand: it is made of what the policies in use declare they read
(`Policy.reads`), each part as nodeagent.policy.reads says, so a policy that reads
something new declares it and is keyed on it, and the unit suite refuses a read it did not
declare. Pure: the caller passes the clock, the last plan and the feedback.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace

from nodeagent.policy import history
from nodeagent.policy.base import Assignment, Policy
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.plan import Plan, make_plan
from nodeagent.policy.reads import ACTIVITY, MOVING, PIPELINE, WINDOWED, Reads, Window, inside
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import NO_NEEDS, NodeSnapshot, WorkloadState


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
        which workloads there are and which rule claims each, as what (a container renamed
        or relabelled), and what the policies in use declare they read (`Policy.reads`,
        each part keyed as nodeagent.policy.reads says); and what moves every tick: a
        memory.max waiting for usage to fit, a policy at work (its carried `at_work` keys),
        the wall clock while a policy that reads it has a workload it reads every tick,
        or a figure past a policy's threshold (`Policy.stale_sensed`)."""
        snapshot, spec, last = given.snapshot, given.spec, given.last
        version, moving = self._sensed(snapshot.workloads, spec, policies, given.assignments)
        key = self.key(given, version)
        moving = moving or given.held_back or at_work(policies, given.carry)
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

    def key(self, given: PlanInputs, version: int) -> Hashable:
        """What a plan depends on, besides what moves every tick, for the policies
        `_sensed` last saw; `version`: the workloads' and the settings' (`_sensed`)."""
        snapshot, seen = given.snapshot, self._seen
        return (
            version,
            tuple(KEYS[part](snapshot) for part in seen.declared.keyed),
            tuple(inside(w, snapshot.local_seconds) for w in seen.windows),
            usage_shares(given.usage) if seen.declared.reads.usage else None,
        )

    def _sensed(
        self,
        workloads: tuple[WorkloadState, ...],
        spec: PolicySpec,
        policies: tuple[Policy, ...],
        assignments: Mapping[str, Assignment],
    ) -> tuple[int, bool]:
        """What the plan's key and its moving take from the workloads and the policy file:
        a version that moves when a workload comes or goes, is claimed anew, turns active
        or idle (where a policy reads what says so), or a section of the policy file a
        policy reads is reloaded; and whether the plan moves every tick (a workload past a
        policy's `stale_sensed` threshold, or one a policy that reads the wall clock reads
        every tick). Each workload is looked at again only when its state is a new object
        (the sensor keeps an unchanged one), so a steady node costs one identity check per
        workload, not sets of them all."""
        seen = self._seen
        if seen.policies != policies:
            seen = self._seen = _Seen(policies, _Declared.of(policies), seen.version + 1)
        declared = seen.declared
        if spec is not seen.spec:  # a reload (or the first tick): which sections changed
            sections = tuple(getattr(spec, s) for s in declared.settings)
            if len(sections) != len(seen.sections) or any(
                a is not b for a, b in zip(sections, seen.sections, strict=True)
            ):  # every workload is looked at again under the new settings
                seen = self._seen = _Seen(policies, declared, seen.version + 1, sections)
            seen.spec = spec
            seen.windows = tuple(w for p in declared.windowed for w in p.windows(spec))
        # which rule claims each workload, with what tenant, class and limits: a container
        # renamed or relabelled (or a pod's edit through the API watch) is claimed anew at
        # once, not at the next replan_interval; the same mapping (a steady tick) costs one
        # identity check
        changed = assignments is not seen.claims and assignments != seen.claims
        if changed or seen.claims is None:
            seen.clocked = any(
                p.needs(a, spec) != NO_NEEDS for p in declared.clocked for a in assignments.values()
            )
        seen.claims = assignments
        fair_share = spec.fair_share
        for w in workloads:
            path = w.identity.path
            last = seen.states.get(path)
            if last is w:
                continue
            seen.states[path] = w
            changed |= last is None
            if declared.activity and is_active(w, fair_share) != (path in seen.active):
                seen.active ^= {path}
                changed = True
            if any(p.stale_sensed((w,), spec, assignments) for p in declared.sensing):
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
        return seen.version, bool(seen.stale) or seen.clocked


@dataclass(frozen=True, slots=True)
class _Declared:
    """What a set of policies declares it reads, as the key takes it (nodeagent.policy.reads):
    worked out once for the policies in use, not at every tick."""

    reads: Reads = PIPELINE
    """All of it, with the plan's own."""
    settings: tuple[str, ...] = tuple(sorted(PIPELINE.settings))
    keyed: tuple[str, ...] = ()
    """The parts of the snapshot keyed by value (`KEYS`)."""
    activity: bool = False
    windowed: tuple[Policy, ...] = ()
    """Those that read the local time against daily windows."""
    clocked: tuple[Policy, ...] = ()
    """Those that read the wall clock (`reads.MOVING`)."""
    sensing: tuple[Policy, ...] = ()
    """Those with a threshold of their own (`Policy.stale_sensed`)."""

    @staticmethod
    def of(policies: tuple[Policy, ...]) -> _Declared:
        reads = Reads.union((PIPELINE, *(p.reads for p in policies)))
        return _Declared(
            reads,
            tuple(sorted(reads.settings)),
            tuple(sorted(KEYS.keys() & reads.snapshot)),
            bool(ACTIVITY & reads.workload),
            tuple(p for p in policies if WINDOWED & p.reads.snapshot),
            tuple(p for p in policies if MOVING & p.reads.snapshot),
            tuple(p for p in policies if type(p).stale_sensed is not Policy.stale_sensed),
        )


@dataclass
class _Seen:
    """The workloads and the settings as `PlanCache._sensed` last saw them, under one set
    of policies."""

    policies: tuple[Policy, ...] = ()
    declared: _Declared = field(default_factory=_Declared)
    version: int = 0
    sections: tuple[object, ...] = ()
    """The sections of the policy file they read, by identity."""
    spec: PolicySpec | None = None
    """The policy file those sections were taken from: another object is a reload."""
    windows: tuple[Window, ...] = ()
    """The daily windows the policies that read the local time read, in that file."""
    states: dict[str, WorkloadState] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)
    claims: Mapping[str, Assignment] | None = None
    """None before the first tick under these policies and settings."""
    clocked: bool = False
    """A policy that reads the wall clock reads some workload every tick."""


def _gpus(snapshot: NodeSnapshot) -> Hashable:
    gpus = snapshot.gpus
    if gpus is None:
        return None
    return gpus.holds, tuple((p.pid, p.device_uuid) for p in gpus.processes)


KEYS: Mapping[str, Callable[[NodeSnapshot], Hashable]] = {
    "gpus": _gpus,
    "skipped": lambda s: frozenset(x.path for x in s.skipped),
    "levels": lambda s: frozenset(w.path for w in s.levels),
}
"""How the key holds each part of the snapshot it keys by value (`reads.KEYED`): which
GPUs are held and which processes run on which; which cgroups were skipped; which levels
there are."""


def at_work(policies: tuple[Policy, ...], carry: Mapping[str, Mapping[str, object]]) -> bool:
    """A policy's carried state says it is at work (`Reads.at_work`: the protection
    controller capping or freezing, or giving back): a new plan every tick."""
    return any(carry.get(p.name, {}).get(k) for p in policies for k in p.reads.at_work)


def usage_shares(usage: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """Each tenant's part of the decayed usage, to the percent: fair share re-plans when
    it moves, and not for every last core-second."""
    total = sum(usage.values())
    return tuple(sorted((t, round(u / total, 2) if total else 0.0) for t, u in usage.items()))
