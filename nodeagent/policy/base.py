"""The small interface every policy implements, and what it is given and returns.

Policies run in order over one tick's frozen snapshot (oomd's "context, then plugins"):
each is given the snapshot, the policy file, every workload's assignment, and what the
policies before it said this tick (`earlier`), plus what it handed itself last tick
(`carried`). Besides cgroup attribute values (`Decision`), a policy may say:

- `Share`: a workload's part of the fair-share pool, the CPU left after every floor;
- `Floor`: CPU a workload must get when it wants it (a deadline's rate, a reservation);
- `CpuTarget`: the CPU a workload is meant to get, from its floor and share;
- `Skip`: this one cgroup cannot be planned this tick (the pipeline also skips the
  cgroups a policy raises on: nodeagent.policy.plan);
- `Note`: something to report (a deadline's progress, a throttled or frozen cgroup);
- `Carry`: state for its own next tick (a controller's level).

`CpuWeights` turns shares and floors into cpu.weight at the end.

A policy declares what it writes (`writes`, `device_settings`): the plan refuses any
other decision of it; and what it reads (`reads`, nodeagent.policy.reads): the plan cache
keys the last plan by that, so a policy never keeps a key by hand. It also says what the
loop must read for it, so that the loop knows no policy by name: which files of a workload
every tick (`needs`). Policies subclass `Policy` for the defaults (nothing read but the
workloads and their claims, nothing every tick) and declare only what they need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nodeagent.cgroupfs.values import Attribute, Value, is_looser
from nodeagent.policy.notes import NoteKind, NotePayload
from nodeagent.policy.reads import Reads, Window
from nodeagent.policyfile.model import DeadlineGrant, Limits, PolicySpec, WorkloadClass
from nodeagent.snapshot import NO_NEEDS, Needs, NodeSnapshot, WorkloadState


@dataclass(frozen=True, slots=True)
class Assignment:
    """Who a workload belongs to and what it declared: from the rule that claimed it, or
    from `nodeagent exec` for the jobs it started (rule `exec:<name>`, `exec_job`)."""

    rule: str
    tenant: str
    workload_class: WorkloadClass
    limits: Limits = field(default_factory=Limits)
    deadline: float | None = None
    """Unix seconds by which the work must be done."""
    work: float | None = None
    """CPU-seconds the work needs in all, counted from the cgroup's creation."""
    cpus: float | None = None
    """At most this many CPUs at once (its parallelism), when declared."""
    matched: tuple[str, ...] = ()
    """The runtime metadata the rule matched on (`labels.team=a`), and where the tenant,
    class or deadline came from, for `explain`."""
    refused: tuple[str, ...] = ()
    """Values a label or annotation asked for that the rule does not allow (or could not
    read): the rule's own were used instead. Reported by `workloads`, `allocations`, the log."""
    exec_job: bool = False
    """A job `nodeagent exec` started: the agent removes its cgroup once it is empty."""
    cpuset: tuple[int, ...] = ()
    """The CPUs it is pinned to (cpuset.cpus), sorted; none: its parent's. A job's GPUs'
    CPUs, with gpu.pin_cpus where its cgroup has the cpuset controller."""
    node_critical: str | None = None
    """Why it keeps the node running (`kubernetes.node_critical`: a kube-system pod, one of
    a system priority): the plan never lowers, caps or freezes it. None: it may be."""
    declared: str | None = None
    """Who declared its deadline, where that is the workload's side and not the operator:
    "uid 1000 through nodeagent exec", "its annotations". None: the policy file's own
    deadline, or root's, or no deadline."""

    def deadline_grant(self, spec: PolicySpec) -> DeadlineGrant | None:
        """What its deadline gets: None without one; defended where it is the operator's
        word; else what its class's `declared_deadlines` says, now (a reload applies to
        the jobs that run)."""
        if self.deadline is None or self.work is None:
            return None
        if self.declared is None:
            return DeadlineGrant.DEFENDED
        return spec.classes[self.workload_class].declared_deadlines


@dataclass(frozen=True, slots=True)
class Decision:
    """One policy's wish for one attribute of one cgroup, with the reasoning behind it."""

    path: str
    attribute: Attribute
    value: Value
    policy: str
    reason: str
    trace: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Share:
    """A workload's fraction of the fair-share pool (the CPU left after every floor).

    Fractions of the active workloads sum to 1. An idle workload of an active tenant gets
    its tenant's per-workload fraction with `active` False, so that its weight lets it
    compete evenly when it wakes; it takes no part in the sum.
    """

    path: str
    fraction: float
    policy: str
    reason: str
    trace: tuple[str, ...] = ()
    active: bool = True


@dataclass(frozen=True, slots=True)
class Floor:
    """CPU, in cores, that a workload must get when it wants it.

    An `exclusive` floor is all the workload gets planned (a deadline job needs its rate,
    no more: the rest goes to fair share); otherwise the workload also keeps its share.
    """

    path: str
    cores: float
    policy: str
    reason: str
    trace: tuple[str, ...] = ()
    exclusive: bool = False
    defended: bool = True
    """The protection controller defends it (throttles and freezes lower classes while the
    workload stalls short of it, and caps it no lower). False: a deadline the workload
    declared itself, which the policy schedules but does not defend."""


@dataclass(frozen=True, slots=True)
class CpuTarget:
    """The CPU a workload is meant to get, which its weight follows: its floor plus its
    part of the pool (CpuWeights says it; the plan reports it, as the metrics' target)."""

    path: str
    cores: float
    active: bool
    """False for an idle workload: it takes no part in its tenant's target."""
    policy: str
    reason: str


@dataclass(frozen=True, slots=True)
class Skip:
    """A policy could not plan one cgroup (a value out of range, say): that cgroup gets no
    targets this tick, the others are planned as usual."""

    path: str
    policy: str
    reason: str


@dataclass(frozen=True, slots=True)
class Note:
    """A report for operators: shown by allocations and explain, logged when its status
    changes. `path` is None for the node as a whole; `status` is a short word or two that
    changes only when something an operator cares about does (the log event is
    `<kind>.<first word of status>`); `payload` carries its figures, typed by its kind
    (nodeagent.policy.notes), read by attribute."""

    path: str | None
    policy: str
    status: str
    message: str
    payload: NotePayload
    key: str = ""
    """Tells notes of one kind about one cgroup apart (a process on a GPU)."""

    @property
    def kind(self) -> NoteKind:
        return self.payload.kind

    @property
    def fields(self) -> dict[str, object]:
        """Its payload's figures as JSON values, as the API and the log show them."""
        return self.payload.fields()


POWER_LIMIT_MW = "power_limit_mw"
"""The one device setting there is (`DeviceDecision.setting`): a GPU's power limit."""


@dataclass(frozen=True, slots=True)
class DeviceDecision:
    """A setting of a device rather than a cgroup: a GPU's power limit, in milliwatts."""

    uuid: str
    setting: str
    value: int
    policy: str
    reason: str


@dataclass(frozen=True, slots=True)
class Carry:
    """State a policy hands to its own next tick; JSON values, kept in the state file."""

    policy: str
    state: Mapping[str, object]


Output = Decision | Share | Floor | CpuTarget | Skip | Note | DeviceDecision | Carry


@dataclass(frozen=True, slots=True)
class PolicyInput:
    snapshot: NodeSnapshot
    spec: PolicySpec
    assignments: Mapping[str, Assignment]
    tenant_usage: Mapping[str, float]
    """Decayed CPU usage per tenant, in core-seconds, including this tick."""
    earlier: tuple[Output, ...] = ()
    """What the policies before this one said this tick, in order."""
    carried: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Each policy's Carry from the previous tick, by policy name."""

    def floors(self) -> dict[str, Floor]:
        """The largest floor each workload got from earlier policies."""
        out: dict[str, Floor] = {}
        for o in self.earlier:
            if isinstance(o, Floor) and (o.path not in out or o.cores > out[o.path].cores):
                out[o.path] = o
        return out

    def decided(self, attribute: Attribute) -> dict[str, Decision]:
        """Earlier decisions on one attribute, the binding one per cgroup, as in the plan."""
        out: dict[str, Decision] = {}
        for o in self.earlier:
            if isinstance(o, Decision) and o.attribute == attribute:
                kept = out.get(o.path)
                if kept is None or not binds(attribute, kept.value, o.value):
                    out[o.path] = o
        return out


CAPS = frozenset(
    {Attribute.CPU_MAX, Attribute.MEMORY_MAX, Attribute.MEMORY_HIGH, Attribute.PIDS_MAX}
)
"""Attributes that are limits: of two policies' values the lower one binds."""


def binds(attribute: Attribute, earlier: Value, later: Value) -> bool:
    """Whether an earlier policy's value stands against a later one's on the same attribute:
    a lower cap stands, and so does a freeze (a cgroup is frozen if any policy freezes it);
    on every other attribute the later policy wins."""
    if attribute in CAPS or attribute is Attribute.FREEZE:
        return is_looser(later, earlier)
    return False


class Policy(Protocol):
    """One step of the plan. Subclass it for the defaults of everything but `decide`."""

    name: str
    writes: frozenset[Attribute] = frozenset()
    """The cgroup attributes it decides (`Decision`): the plan refuses a decision on any
    other, as a problem naming the policy, so what a policy may change is read here and
    checked, not found in its code."""
    device_settings: frozenset[str] = frozenset()
    """The device settings it decides (`DeviceDecision.setting`), refused alike."""
    reads: Reads = Reads()
    """What it reads of its input (nodeagent.policy.reads): the plan cache's key is made of
    what the policies in use declare here, and the unit suite refuses any other read."""

    def decide(self, given: PolicyInput) -> Sequence[Output]: ...

    def needs(self, assignment: Assignment, spec: PolicySpec) -> Needs:
        """What this policy reads of a workload with this assignment every tick, beyond
        cpu.stat (a lean read keeps the rest from the workload's last full read). The loop
        reads the union over the policies in use."""
        return NO_NEEDS

    def windows(self, spec: PolicySpec) -> tuple[Window, ...]:
        """The daily windows it reads the local time against (`reads`: local_seconds),
        from the policy file, which its class cannot know: the plan is made anew when the
        local time enters or leaves one."""
        return ()

    def stale_sensed(
        self,
        workloads: Sequence[WorkloadState],
        spec: PolicySpec,
        assignments: Mapping[str, Assignment],
    ) -> bool:
        """Whether a figure it reads of a workload (`reads`: figures are not keyed) crossed
        a threshold that means the plan must be made again next tick: what no declaration
        says (a threshold from its settings, say of it only where it acts). Asked of each
        workload whose state changed (or all, when the policy file changes), one at a
        time: say it of the workload alone. `assignments`: the last plan's, by path (a
        workload not in it is new, and planned anew anyway)."""
        return False
