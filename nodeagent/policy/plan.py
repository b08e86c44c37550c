"""Run the policies over one snapshot and merge what they say into a plan.

The plan is the whole of what the agent wants, per cgroup, with the reasons
and the trace that `nodeagent explain` prints. Policies run in order, each seeing
what the earlier ones said. On the same attribute one rule per attribute decides
(`binds`): the lowest cap wins on `cpu.max`, `memory.max` and `memory.high`, a cgroup is
frozen if any policy freezes it, and otherwise the later policy wins; the trace names the
policy that binds.

Only the workloads in the snapshot are planned: a cgroup that vanished or could
not be read since discovery is simply absent. One exception: a thaw of a cgroup outside
them (a policy froze it, and no longer claims or sees it: a reload unclaimed it, it was
renamed or removed) is planned apart (`Plan.thaws`), written as its layout says the agent
may write it, so that no freeze outlives the agent's claim. A cgroup a policy cannot plan is
marked skipped and gets no targets; a policy that fails as a whole is left out
of this tick and named in `Plan.problems`. Either way the rest is planned.

Error isolation is the pipeline's, the same for every policy (`decide_isolated`): when a
policy raises, the cgroups it fails on are found by running it again on parts of its input
(policies are pure functions of it), and it is run once more without them; those cgroups
are skipped with the policy's error, the others get its decisions. Only when it fails with
no cgroups at all, or still fails without the ones found, is it left out as a whole. The
extra runs happen only on failure: about two per failing cgroup per halving of the input.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from nodeagent.cgroupfs.unitprops import systemd_value
from nodeagent.cgroupfs.values import Attribute, Frozen, Value, is_looser
from nodeagent.identity import WorkloadIdentity
from nodeagent.ownership import WriteMode, parent_identity, write_mode
from nodeagent.policy import history
from nodeagent.policy.base import (
    Assignment,
    Carry,
    CpuTarget,
    Decision,
    DeviceDecision,
    Floor,
    Note,
    Output,
    Policy,
    PolicyInput,
    Share,
    Skip,
    binds,
)
from nodeagent.policy.deadlines import Deadlines
from nodeagent.policy.fairshare import FairShare
from nodeagent.policy.gpu_checks import GpuChecks
from nodeagent.policy.gpu_power import GpuPower
from nodeagent.policy.limits import StaticLimits
from nodeagent.policy.protection import Protection
from nodeagent.policy.reservations import Reservations
from nodeagent.policy.weights import CpuWeights
from nodeagent.policyfile.model import PolicySpec
from nodeagent.snapshot import NodeSnapshot

DEFAULT_POLICIES: tuple[Policy, ...] = (
    Deadlines(),
    Reservations(),
    FairShare(),
    CpuWeights(),
    StaticLimits(),
    Protection(),
    GpuChecks(),
    GpuPower(),
)
"""Floors first (deadlines, reservations), then the fair split of what is left, weights
from both, static caps, the controller that throttles and freezes lower classes on top
of everything else, and the GPUs: verification against the holds, and power by class."""


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
    notes: tuple[Note, ...] = ()
    write: WriteMode = WriteMode.DIRECT
    """How the executor may write it (nodeagent.ownership)."""

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
    notes: tuple[Note, ...] = ()
    """Every note of the tick, the node's and the cgroups'."""
    carry: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    """Each policy's state for the next tick."""
    devices: tuple[DeviceDecision, ...] = ()
    """Device settings (GPU power limits)."""
    cpu_targets: Mapping[str, CpuTarget] = field(default_factory=dict)
    """The CPU each workload with a floor or a share is meant to get, which its weight
    follows, as CpuWeights said it: the metrics' target shares."""
    thaws: tuple[CgroupPlan, ...] = ()
    """Cgroups outside this tick's workloads that a policy froze and gives back, each with
    its thaw as its only target (the module's docstring says when)."""

    def assignments(self) -> dict[str, Assignment]:
        return {cg.path: cg.assignment for cg in self.cgroups if cg.assignment is not None}


def make_plan(
    snapshot: NodeSnapshot,
    spec: PolicySpec,
    previous_usage: Mapping[str, float],
    policies: Sequence[Policy] = DEFAULT_POLICIES,
    *,
    assignments: Mapping[str, Assignment],
    carried: Mapping[str, Mapping[str, object]] | None = None,
) -> Plan:
    """`assignments`: the workloads the caller classified (the loop, once per tick; rules
    claim workloads, levels are only weighted); those of workloads missing from the
    snapshot are ignored. `carried` is the previous plan's `carry`."""
    identities = [w.identity for w in (*snapshot.workloads, *snapshot.levels)]
    sensed = {i.path for i in identities}
    assignments = {p: a for p, a in assignments.items() if p in sensed}
    usage = history.advance(previous_usage, snapshot, assignments, spec.fair_share.half_life)
    usage = {t: u for t, u in usage.items() if t in spec.tenants}  # a reload may drop tenants
    idle = {w.path for w in (*snapshot.workloads, *snapshot.levels) if w.sample.cpu_idle}
    merged = _Merge({i.path for i in identities}, idle)
    earlier: list[Output] = []
    for policy in policies:
        given = PolicyInput(snapshot, spec, assignments, usage, tuple(earlier), carried or {})
        outputs, failed = decide_isolated(policy, given)
        if failed is not None:  # a bug in one policy must not stop the others
            merged.problems.append(
                f"policy {policy.name} failed, left out this tick: {_error(failed)}"
            )
            continue
        outputs = [o for o in outputs if _declared(policy, o, merged.problems)]
        for o in outputs:
            merged.add(policy.name, o)
        earlier.extend(outputs)
    for path, assignment in assignments.items():
        merged.traces[path].insert(
            0,
            f"matched rule {assignment.rule}: tenant {assignment.tenant},"
            f" class {assignment.workload_class}",
        )
    modes = {i.path: write_mode(i, spec.agent) for i in identities}
    now = {w.path: w.sample.settings for w in (*snapshot.workloads, *snapshot.levels)}
    for path, why in node_critical(identities, assignments).items():
        merged.spare(path, why, now[path])
    cgroups = tuple(
        CgroupPlan(
            i,
            assignments.get(i.path),
            {} if i.path in merged.skipped else as_written(merged.targets[i.path], modes[i.path]),
            tuple(merged.traces[i.path]),
            merged.skipped.get(i.path),
            tuple(n for n in merged.notes if n.path == i.path),
            modes[i.path],
        )
        for i in identities
    )
    thaws = tuple(_thaw(path, t, spec) for path, t in sorted(merged.thaws.items()))
    return Plan(
        snapshot.seq,
        snapshot.wall_time,
        cgroups,
        usage,
        tuple(merged.problems),
        tuple(merged.notes),
        merged.carry,
        tuple(merged.devices),
        merged.cpu_targets,
        thaws,
    )


class _Merge:
    """Accumulates the policies' outputs into per-cgroup targets, traces and notes."""

    def __init__(self, paths: set[str], idle: set[str]) -> None:
        self.idle = idle
        """Cgroups with cpu.idle set: the kernel refuses them a weight."""
        self.targets: dict[str, dict[Attribute, Target]] = {p: {} for p in paths}
        self.traces: dict[str, list[str]] = {p: [] for p in paths}
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []
        self.notes: list[Note] = []
        self.carry: dict[str, Mapping[str, object]] = {}
        self.devices: list[DeviceDecision] = []
        self.cpu_targets: dict[str, CpuTarget] = {}
        self.thaws: dict[str, Target] = {}
        """Thaws of cgroups outside the snapshot (`Plan.thaws`)."""

    def add(self, policy: str, o: Output) -> None:
        if isinstance(o, Carry):
            self.carry[o.policy] = o.state
            return
        if isinstance(o, DeviceDecision):
            self.devices.append(o)
            return
        if isinstance(o, Note) and o.path is None:  # about the node as a whole
            self.notes.append(o)
            return
        if o.path not in self.targets:
            if isinstance(o, Decision) and o.value == Frozen(False):  # a thaw (`Plan.thaws`)
                self.thaws[o.path] = Target(o.value, o.policy, o.reason)
                return
            self.problems.append(f"policy {policy} planned {o.path}, which is not sensed")
            return
        if isinstance(o, Skip):
            self.skipped.setdefault(o.path, f"{o.policy}: {o.reason}")
        elif isinstance(o, Note):
            self.notes.append(o)
            self.traces[o.path].append(f"{o.policy}: {o.message}")
        elif (
            isinstance(o, Decision) and o.attribute is Attribute.CPU_WEIGHT and o.path in self.idle
        ):
            self.traces[o.path].append(
                f"{o.policy}'s cpu.weight {o.value.render()} is not planned: cpu.idle is set"
                " (systemd's CPUWeight=idle), so the kernel gives it the idle weight and"
                " refuses another"
            )
        elif isinstance(o, Decision):
            earlier = self.targets[o.path].get(o.attribute)
            if earlier is not None and binds(o.attribute, earlier.value, o.value):
                self.traces[o.path].append(
                    f"{earlier.policy}'s {o.attribute} binds: {o.policy}'s is looser"
                )
            else:
                if earlier is not None:
                    self.traces[o.path].append(
                        f"{o.policy} overrides {earlier.policy} on {o.attribute}"
                    )
                self.targets[o.path][o.attribute] = Target(o.value, o.policy, o.reason)
            self.traces[o.path].extend(f"{o.policy}: {line}" for line in (*o.trace, o.reason))
        elif isinstance(o, CpuTarget):
            self.cpu_targets[o.path] = o
        elif isinstance(o, Share | Floor):
            self.traces[o.path].extend(f"{o.policy}: {line}" for line in (*o.trace, o.reason))

    def spare(self, path: str, why: str, now: Mapping[Attribute, Value]) -> None:
        """Drop what would tighten a node-critical cgroup: a value is kept only where it
        is the one the cgroup has or looser (a cap lifted, a freeze thawed); one whose
        current value was not read is dropped too (it could only set what nobody set). A
        freeze planned for one frozen now (made before it was node-critical) becomes its
        thaw: kept, it would hold it frozen."""
        targets = self.targets[path]
        for attr, t in list(targets.items()):
            current = now.get(attr)
            if t.value == Frozen(True) and current == Frozen(True):
                thaw = f"{why}: thawed, {t.policy}'s freeze is not kept"
                targets[attr] = Target(Frozen(False), t.policy, thaw)
                continue
            if current is not None and (t.value == current or is_looser(t.value, current)):
                continue
            del targets[attr]
            self.traces[path].append(
                f"{why}: {t.policy}'s {attr} {t.render()} is not planned: what keeps the node"
                " running is never lowered, capped or frozen (kubernetes.node_critical)"
            )


def node_critical(
    identities: Sequence[WorkloadIdentity], assignments: Mapping[str, Assignment]
) -> dict[str, str]:
    """The cgroups that keep the node running, each with why: the claimed ones
    classification found node-critical (`Assignment.node_critical`), and every other
    cgroup of their pods (the pod's own, its other containers)."""
    out = {p: a.node_critical for p, a in assignments.items() if a.node_critical is not None}
    pods = {i.pod_uid: out[i.path] for i in identities if i.path in out and i.pod_uid}
    for i in identities:
        if i.path not in out and i.pod_uid in pods:
            out[i.path] = pods[i.pod_uid]
    return out


def _thaw(path: str, target: Target, spec: PolicySpec) -> CgroupPlan:
    """A thaw of a cgroup outside the snapshot, to be written as its layout says the agent
    may write it (through systemd's ThawUnit for a unit's cgroup, never a read-only one)."""
    identity = parent_identity(path, spec.agent.managed_root)
    trace = (f"{target.policy}: {target.reason}",)
    return CgroupPlan(
        identity, None, {Attribute.FREEZE: target}, trace, write=write_mode(identity, spec.agent)
    )


def as_written(targets: Mapping[Attribute, Target], mode: WriteMode) -> dict[Attribute, Target]:
    """For a cgroup systemd owns, each value as systemd will write it (cpu.max rounded to
    its property's precision), so that the file, the property and the plan agree."""
    if mode is not WriteMode.SYSTEMD:
        return dict(targets)
    out = {}
    for attr, t in targets.items():
        value = t.value if attr is Attribute.FREEZE else systemd_value(attr, t.value)
        reason = t.reason if value == t.value else f"{t.reason} (as systemd writes it)"
        out[attr] = Target(value, t.policy, reason)
    return out


def decide_isolated(policy: Policy, given: PolicyInput) -> tuple[list[Output], Exception | None]:
    """The policy's outputs, with a `Skip` naming its error for each cgroup it fails on
    (the module's docstring says how they are found); or no outputs and the exception,
    when it fails as a whole."""
    try:
        return list(policy.decide(given)), None
    except Exception as e:  # any error: isolated below, or reported whole
        first = e
    paths = [w.path for w in (*given.snapshot.workloads, *given.snapshot.levels)]
    if not paths or _fails(policy, _without(given, set(paths))) is not None:
        return [], first  # it fails with no cgroups: nothing to isolate
    bad: dict[str, Exception] = {}

    def search(part: list[str], error: Exception) -> None:  # `part` alone fails with `error`
        if len(part) == 1:
            bad[part[0]] = error
            return
        half = len(part) // 2
        for piece in (part[:half], part[half:]):
            found = _fails(policy, _without(given, set(paths) - set(piece)))
            if found is not None:
                search(piece, found)

    search(paths, first)
    if not bad:
        return [], first  # it fails only on some cgroups together
    try:
        outputs = list(policy.decide(_without(given, bad.keys())))
    except Exception:  # still failing without them: left out whole
        return [], first
    rules = {p: a.rule for p, a in given.assignments.items()}
    skips = [
        Skip(p, policy.name, f"rule {rules[p]}: {_error(e)}" if p in rules else _error(e))
        for p, e in bad.items()
    ]
    return [*outputs, *skips], None


def _fails(policy: Policy, given: PolicyInput) -> Exception | None:
    try:
        policy.decide(given)
    except Exception as e:  # what the search looks for
        return e
    return None


def _without(given: PolicyInput, paths: Collection[str]) -> PolicyInput:
    """The same input as if the cgroups at `paths` were not there: not sensed, not
    assigned, and nothing said about them by earlier policies."""
    snapshot = replace(
        given.snapshot,
        workloads=tuple(w for w in given.snapshot.workloads if w.path not in paths),
        levels=tuple(w for w in given.snapshot.levels if w.path not in paths),
    )
    return replace(
        given,
        snapshot=snapshot,
        assignments={p: a for p, a in given.assignments.items() if p not in paths},
        earlier=tuple(o for o in given.earlier if getattr(o, "path", None) not in paths),
    )


def _declared(policy: Policy, o: Output, problems: list[str]) -> bool:
    """Whether `o` is within what the policy declares it writes; if not, the refusal is
    added to `problems` (a bug in the policy: the rest of its outputs stand)."""
    if isinstance(o, Decision) and o.attribute not in policy.writes:
        what = f"{o.attribute} of {o.path}"
    elif isinstance(o, DeviceDecision) and o.setting not in policy.device_settings:
        what = f"{o.setting} of GPU {o.uuid}"
    else:
        return True
    problems.append(f"policy {policy.name} decided {what}, which it does not declare: refused")
    return False


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
