"""Inference first: while a protected cgroup stalls for CPU, lower classes are throttled
in steps, then frozen; they are released gradually when the pressure is gone.

Protected cgroups are those of a class with `protect: true` (inference), and those with
a defended floor (a reservation, a deadline's rate where the policy grants it: a rule's own
deadline, root's, or one declared in a class whose `declared_deadlines` is `defended`) that
get less CPU than the floor; a floor on a caller's word alone (`Floor.defended` false)
neither makes the controller act nor spares its cgroup a cap. A protected
cgroup stalls when the share of time some of its tasks waited for a CPU (PSI 'some': the
last tick's delta of its total, or avg10 before there is one) exceeds
`protection.cpu_pressure`. The classes of lower priority than the highest stalling one
are the victims. This follows koordlet's CPU suppress (lower classes get what the
protected ones leave) with senpai's control law (small multiplicative steps scaled by
how far pressure is over the threshold, and a slow additive release):

- under pressure, each victim class's CPU cap (cores, in all) shrinks by up to `step`
  of itself per tick, never below the class's `floor_cpu`; it is split evenly over the
  class's active cgroups as cpu.max (the innermost claims, as in the tenant split), never
  below a cgroup's own floor, and a tighter static cap stays;
- a class's first cap starts from what its cgroups used last tick (on their first tick,
  before a rate is known, from what each may use: its cpu.max, or the node's CPUs);
- when every victim class has sat at its floor for `freeze_after` ticks and the pressure
  persists, the busiest cgroup of the lowest-priority freezable victim class is frozen
  (cgroup.freeze: stopped, never killed), one per `freeze_after` ticks; it keeps the cap
  it had while frozen, so it is thawed under it;
- after `calm_ticks` ticks below half the threshold, frozen cgroups are thawed first,
  last frozen first, one per tick; then caps grow by `release_step` of the usable CPUs
  per tick until they no longer bind, and are lifted (cpu.max back to the static cap or
  max);
- a frozen cgroup that is no longer a workload (a reload unclaimed it, it was renamed or
  removed) is thawed at once where it still exists (`Plan.thaws`), and forgotten; one
  the sensor skipped this tick stays as it is and remembered until it is read again;
- a node-critical cgroup (`kubernetes.node_critical`: what keeps the node running) is never
  a victim; one frozen or capped before it became so (a reload, a pod's new priority) is
  thawed and uncapped at once.

The controller's state (caps, counters, frozen cgroups) is carried from tick to tick and
kept in the state file, so a restart does not release a node under pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nodeagent.cgroupfs.values import Attribute, CpuMax, Frozen
from nodeagent.policy.base import (
    Assignment,
    Carry,
    Decision,
    Floor,
    Note,
    Output,
    Policy,
    PolicyInput,
)
from nodeagent.policy.classify import outer_claims
from nodeagent.policy.cpu import usable
from nodeagent.policy.fairshare import is_active
from nodeagent.policy.notes import ProtectionPhase, ProtectionState
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import MAX, DeadlineGrant, PolicySpec, WorkloadClass
from nodeagent.snapshot import NO_NEEDS, Needs, WorkloadState


def _strings(raw: object) -> list[str]:
    return [str(p) for p in raw] if isinstance(raw, list) else []


@dataclass
class _State:
    caps: dict[str, float] = field(default_factory=dict)
    """Victim class -> cores its cgroups may use in all."""
    calm: int = 0
    pinned: int = 0
    """Ticks under pressure with every victim class at its floor."""
    frozen: list[str] = field(default_factory=list)
    capped: list[str] = field(default_factory=list)
    """Cgroups whose cpu.max this controller set last tick."""
    uncap: list[str] = field(default_factory=list)
    thaw: list[str] = field(default_factory=list)
    """Cgroups to give back (cpu.max, cgroup.freeze) until the kernel shows it done."""

    @classmethod
    def load(cls, raw: Mapping[str, object] | None) -> _State:
        raw = raw or {}
        caps = raw.get("caps")
        calm, pinned = raw.get("calm"), raw.get("pinned")
        return cls(
            {str(k): float(v) for k, v in caps.items()} if isinstance(caps, dict) else {},
            calm if isinstance(calm, int) else 0,
            pinned if isinstance(pinned, int) else 0,
            _strings(raw.get("frozen")),
            _strings(raw.get("capped")),
            _strings(raw.get("uncap")),
            _strings(raw.get("thaw")),
        )

    def dump(self) -> dict[str, object]:
        return {
            "caps": dict(self.caps),
            "calm": self.calm,
            "pinned": self.pinned,
            "frozen": list(self.frozen),
            "capped": list(self.capped),
            "uncap": list(self.uncap),
            "thaw": list(self.thaw),
        }


def frozen_by(carried: Mapping[str, object] | None) -> list[str]:
    """The cgroups the controller froze, or is thawing, by its carried state (`Carry`):
    what `nodeagent release` thaws where no recorded original covers them."""
    state = _State.load(carried)
    return list(dict.fromkeys([*state.frozen, *state.thaw]))


def stall(w: WorkloadState) -> float | None:
    """Share of the last tick some task waited for a CPU; avg10 until a delta exists."""
    if w.cpu_stall is not None:
        return w.cpu_stall
    psi = w.sample.cpu_psi
    return None if psi is None else psi.some.avg10 / 100


def _frozen_now(w: WorkloadState) -> bool:
    return w.sample.settings.get(Attribute.FREEZE) == Frozen(True)


class _Node:
    """What the controller reads of one tick's input."""

    def __init__(self, given: PolicyInput) -> None:
        self.given = given
        self.spec = given.spec
        self.settings = given.spec.protection
        self.floors: dict[str, Floor] = _defended(given)
        """The largest defended floor of each cgroup that has one."""
        self.classes = {p: a.workload_class for p, a in given.assignments.items()}
        self.spared = {p for p, a in given.assignments.items() if a.node_critical is not None}
        """Node-critical: never a victim (the plan would not write its cap or freeze)."""
        self.outer = outer_claims(given.assignments)
        """Claimed cgroups with claims below them: capped and frozen through those."""
        self.states = {w.path: w for w in given.snapshot.workloads}
        self.unread = {s.path for s in given.snapshot.skipped}
        """Claimed, but skipped by the sensor this tick (a file it could not read)."""
        self.gone = set(given.snapshot.vanished)
        """Found removed while sensed: nothing is left to thaw."""
        self.capacity = usable(given)

    def seen(self, path: str) -> bool:
        """Still a workload: sensed this tick, or claimed but unread. An unread one is left
        as it is, frozen or not, and remembered: nothing is known of it this tick (as for
        any skipped cgroup, the plan gives it no targets), and thawing it on one unreadable
        file would undo a freeze the controller still means, to make it again next tick."""
        return path in self.states or path in self.unread

    def priority(self, path: str) -> int:
        return self.spec.classes[self.classes[path]].priority

    def floor(self, cls: WorkloadClass) -> float:
        value = self.spec.classes[cls].floor_cpu
        return self.capacity if value == MAX else min(float(value), self.capacity)

    def watched(self) -> list[WorkloadState]:
        """Protected cgroups: a protected class, or a floor to live up to."""
        return [
            w
            for w in self.given.snapshot.workloads
            if w.path in self.classes
            and not _frozen_now(w)
            and (self.spec.classes[self.classes[w.path]].protect or w.path in self.floors)
        ]

    def stalling(self) -> dict[str, float]:
        out = {}
        for w in self.watched():
            s, f = stall(w), self.floors.get(w.path)
            short = f is None or (w.cpu_rate is not None and w.cpu_rate < 0.95 * f.cores)
            if self.spec.classes[self.classes[w.path]].protect is False and not short:
                continue  # a floor that is met: its own threads competing, not ours to fix
            if s is not None and s > self.settings.cpu_pressure:
                out[w.path] = s
        return out

    def using(self, w: WorkloadState) -> float:
        """The cores a cgroup uses, where a first cap starts: its rate; before one is
        known (its first tick), what it may use: its cpu.max, or the node's CPUs."""
        if w.cpu_rate is not None:
            return w.cpu_rate
        now = w.sample.settings.get(Attribute.CPU_MAX)
        limit = now.cores if isinstance(now, CpuMax) else None
        return self.capacity if limit is None else min(limit, self.capacity)

    def members(self, cls: WorkloadClass, exclude: Sequence[str] = ()) -> list[WorkloadState]:
        return [
            w
            for w in self.given.snapshot.workloads
            if self.classes.get(w.path) is cls
            and w.path not in exclude
            and w.path not in self.outer
            and w.path not in self.spared
            and is_active(w, self.spec.fair_share)
        ]


def _defended(given: PolicyInput) -> dict[str, Floor]:
    """The largest floor each workload got that the policy grants defence to."""
    out: dict[str, Floor] = {}
    for o in given.earlier:
        if (
            isinstance(o, Floor)
            and o.defended
            and (o.path not in out or o.cores > out[o.path].cores)
        ):
            out[o.path] = o
    return out


def _who(stalling: Mapping[str, float]) -> str:
    return ", ".join(f"{p} ({s:.0%})" for p, s in sorted(stalling.items()))


class Protection(Policy):
    name = "protection"
    writes = frozenset({Attribute.CPU_MAX, Attribute.FREEZE})
    reads = Reads(
        settings=frozenset({"protection", "classes", "fair_share", "node"}),
        snapshot=frozenset({"node", "skipped", "vanished"}),
        workload=frozenset({"cpu_stall", "cpu_psi", "settings", "cpu_rate", "populated"}),
        carry=True,
        at_work=frozenset({"caps", "frozen", "uncap", "thaw"}),
    )
    """At work while a class is capped or a cgroup frozen, or one is still to give back."""

    def needs(self, assignment: Assignment, spec: PolicySpec) -> Needs:
        """cpu.pressure, every tick, of the cgroups it watches: a protected class's, and
        those with a defended floor (a class reservation, a deadline the policy defends)."""
        cls = spec.classes[assignment.workload_class]
        defended = assignment.deadline_grant(spec) is DeadlineGrant.DEFENDED
        watched = cls.protect or cls.reserved_cpu is not None or defended
        return Needs(pressure=True) if watched else NO_NEEDS

    def stale_sensed(
        self,
        workloads: Sequence[WorkloadState],
        spec: PolicySpec,
        assignments: Mapping[str, Assignment],
    ) -> bool:
        """A cgroup it watches (`needs`: its pressure read every tick) stalls for CPU above
        half the threshold (where calm ends). The others' stalls are not its to fix: on a
        node whose CPUs are all taken every cgroup stalls, and counting them made a new
        plan every tick."""
        threshold = spec.protection.cpu_pressure / 2
        return any(
            (stall(w) or 0.0) >= threshold
            for w in workloads
            if w.sample.cpu_psi is not None
            and (a := assignments.get(w.identity.path)) is not None
            and self.needs(a, spec).pressure
        )

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        node = _Node(given)
        state = _State.load(given.carried.get(self.name))
        # unclaimed, renamed, removed; or node-critical now (a reload, a pod's new priority)
        left = [p for p in state.frozen if not node.seen(p) or p in node.spared]
        state.frozen = [p for p in state.frozen if p not in left]
        state.thaw += left
        stalling = node.stalling() if node.settings.enabled else {}
        if not node.settings.enabled:  # give everything back at once
            state.thaw += state.frozen
            state.frozen, state.caps = [], {}
        elif stalling:
            self._tighten(node, state, stalling)
        else:
            self._relax(node, state)
        out: list[Output] = []
        out += self._caps(node, state, stalling)
        out += self._freezes(node, state, stalling)
        out.append(self._note(state, stalling))
        out.append(Carry(self.name, state.dump()))
        return out

    def _note(self, state: _State, stalling: Mapping[str, float]) -> Note:
        capped = ",".join(sorted(state.caps)) or "none"
        if state.frozen:
            phase = ProtectionPhase.FREEZING
            status = f"{phase} {len(state.frozen)} cgroup(s); capped {capped}"
        elif stalling:
            phase = ProtectionPhase.THROTTLING
            status = f"{phase} {capped}"
        elif state.caps:
            phase = ProtectionPhase.RELEASING
            status = f"{phase} {capped}"
        else:
            phase = ProtectionPhase.IDLE
            status = str(phase)
        caps = ", ".join(f"{c} {v:.2f} cores" for c, v in sorted(state.caps.items()))
        return Note(
            None,
            self.name,
            status,
            f"stalling: {_who(stalling) or 'none'}; caps: {caps or 'none'};"
            f" frozen: {', '.join(state.frozen) or 'none'}",
            ProtectionState(phase, dict(stalling), dict(state.caps), tuple(state.frozen)),
        )

    def _victims(
        self, node: _Node, state: _State, stalling: Mapping[str, float]
    ) -> dict[WorkloadClass, list[WorkloadState]]:
        top = max(node.priority(p) for p in stalling)
        out: dict[WorkloadClass, list[WorkloadState]] = {}
        for cls, settings in node.spec.classes.items():
            if settings.priority < top:
                members = [w for w in node.members(cls, state.frozen) if w.path not in stalling]
                if members:
                    out[cls] = members
        return out

    def _tighten(self, node: _Node, state: _State, stalling: Mapping[str, float]) -> None:
        s = node.settings
        state.calm = 0
        worst = max(stalling.values())
        severity = min(1.0, max(0.25, worst / s.cpu_pressure - 1))
        victims = self._victims(node, state, stalling)
        for cls, members in victims.items():
            start = min(node.capacity, sum(node.using(w) for w in members))
            cap = state.caps.get(str(cls), max(start, node.floor(cls)))
            state.caps[str(cls)] = max(node.floor(cls), cap * (1 - s.step * severity))
        pinned = bool(victims) and all(state.caps[str(c)] <= node.floor(c) + 1e-9 for c in victims)
        state.pinned = state.pinned + 1 if pinned else 0
        if state.pinned >= s.freeze_after:
            state.pinned = 0
            freezable = [c for c in victims if node.spec.classes[c].freezable]
            if freezable:
                lowest = min(freezable, key=lambda c: node.spec.classes[c].priority)
                busiest = max(victims[lowest], key=lambda w: (w.cpu_rate or 0.0, w.path))
                state.frozen.append(busiest.path)

    def _relax(self, node: _Node, state: _State) -> None:
        s = node.settings
        calm = all((stall(w) or 0.0) < s.cpu_pressure / 2 for w in node.watched())
        state.calm = state.calm + 1 if calm else 0
        state.pinned = 0
        if state.calm < s.calm_ticks:
            return
        if state.frozen:
            state.thaw.append(state.frozen.pop())
            return
        for cls in list(state.caps):
            state.caps[cls] += s.release_step * node.capacity
            if state.caps[cls] >= node.capacity:
                del state.caps[cls]

    def _caps(self, node: _Node, state: _State, stalling: Mapping[str, float]) -> list[Output]:
        static = node.given.decided(Attribute.CPU_MAX)
        period = node.settings.period_us
        out: list[Output] = []
        capped: list[str] = []
        for path in state.frozen:  # it keeps the cap it had: thawed, it starts under it
            if path not in state.capped or path not in node.states:
                continue
            capped.append(path)
            now = node.states[path].sample.settings.get(Attribute.CPU_MAX)
            if isinstance(now, CpuMax) and now.cores is not None:
                why = "cap kept while frozen, so that it is thawed under it"
                out.append(Decision(path, Attribute.CPU_MAX, now, self.name, why))
        for name, cap in sorted(state.caps.items()):
            cls = WorkloadClass(name)
            members = node.members(cls, state.frozen)
            for w in members:
                each = cap / len(members)
                own = node.floors.get(w.path)
                cores = max(each, own.cores if own is not None else 0.0)
                earlier = static.get(w.path)
                if isinstance(earlier, Decision) and isinstance(earlier.value, CpuMax):
                    tighter = earlier.value.cores
                    if tighter is not None and tighter <= cores:
                        continue  # the static cap binds already
                capped.append(w.path)
                why = f"class {cls} may use {cap:.2f} cores in all, over {len(members)} cgroup(s)"
                if own is not None and own.cores > each:
                    why += f"; raised to this cgroup's floor {own.cores:.2f}"
                out.append(
                    Decision(
                        w.path,
                        Attribute.CPU_MAX,
                        CpuMax.from_cores(cores, period),
                        self.name,
                        f"throttled to {cores:.2f} cores: "
                        + (f"{_who(stalling)} stalls" if stalling else "releasing in steps"),
                        (why,),
                    )
                )
        state.uncap = sorted(
            {p for p in (*state.capped, *state.uncap) if p not in capped and p in node.states}
        )
        state.capped = capped
        keep = []
        for path in state.uncap:
            target = static.get(path)
            value = target.value if target is not None else CpuMax(None, period)
            if node.states[path].sample.settings.get(Attribute.CPU_MAX) == value:
                continue  # given back
            keep.append(path)
            if target is None:
                out.append(
                    Decision(
                        path,
                        Attribute.CPU_MAX,
                        value,
                        self.name,
                        "throttle lifted: pressure is gone",
                    )
                )
        state.uncap = keep
        return out

    def _freezes(self, node: _Node, state: _State, stalling: Mapping[str, float]) -> list[Output]:
        out: list[Output] = []
        for path in state.frozen:
            if path in node.unread:
                continue  # left as it is (`_Node.seen`)
            out.append(
                Decision(
                    path,
                    Attribute.FREEZE,
                    Frozen(True),
                    self.name,
                    "frozen, not killed: "
                    + (f"{_who(stalling)} stalls" if stalling else "thawed when calm")
                    + " and every lower class is at its floor",
                )
            )
        keep = []
        for path in state.thaw:
            w = node.states.get(path)
            if path in node.unread:
                keep.append(path)  # thawed once read again, or once no longer claimed
                continue
            if path in node.gone:
                continue
            if w is None:  # no longer a workload: thawed where it still exists, forgotten
                why = "thawed: no longer a workload the agent plans (unclaimed, or gone)"
                out.append(Decision(path, Attribute.FREEZE, Frozen(False), self.name, why))
                continue
            if not _frozen_now(w):
                continue
            keep.append(path)
            out.append(
                Decision(
                    path, Attribute.FREEZE, Frozen(False), self.name, "thawed: pressure is gone"
                )
            )
        state.thaw = keep
        return out
