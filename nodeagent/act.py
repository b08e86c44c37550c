"""Apply a plan to the kernel: only what differs, in a safe order, every write audited.

Writes that relax a limit go top-down and writes that tighten go bottom-up, so
a parent is never tighter than its child mid-change (koordlet's leveled
update). memory.max is never set below what the cgroup uses: the write is held
back and reported unreachable until usage fits (the plan lowers memory.high
meanwhile, so the kernel reclaims).

A cgroup systemd owns is written as runc does it: before its first file, every
attribute the plan holds for it is set as a runtime property of its unit over D-Bus
(systemd re-applies a unit's whole controller from its properties whenever one changes
and at every daemon-reload, so a file written alone would be undone), then each file is
written with the value systemd writes for it (the plan holds it rounded already); a
freeze goes through systemd's FreezeUnit. The unit is the one systemd says has that very
cgroup as its own, asked once per cgroup (`_VerifiedUnits`), never read off the path: a
cgroup merely named like a unit, or below one, is left read-only, logged once. Without
D-Bus, `agent.systemd.without_bus` says whether such cgroups are left alone (said once) or
their files written directly.

The agent's own cgroup and those above it are never tightened, whatever the plan says
(nodeagent.selfguard), nor are the node-critical pods' (`kubernetes.node_critical`, which
the plan spares already: this holds for a plan made again after their values moved): such
a write is read-only, logged once per cgroup.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import AuditFn, CgroupDir, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.unitprops import unit_properties
from nodeagent.cgroupfs.values import (
    Attribute,
    Frozen,
    MemoryLimit,
    Value,
    is_idle_weight,
    is_looser,
)
from nodeagent.errors import NodeagentError, one_line
from nodeagent.logs import audit_event
from nodeagent.ownership import WriteMode, read_only_reason
from nodeagent.policy.plan import CgroupPlan, Plan, Target, node_critical
from nodeagent.policyfile.model import WithoutBus
from nodeagent.reach import Reachability
from nodeagent.sdbus import NoBus, NotTheUnit
from nodeagent.selfguard import SelfGuard
from nodeagent.snapshot import NodeSnapshot

log = structlog.get_logger("nodeagent")


class Outcome(enum.StrEnum):
    WRITTEN = "written"
    UNCHANGED = "unchanged"
    DRY_RUN = "dry-run"
    READ_ONLY = "read-only"
    VANISHED = "vanished"
    UNREACHABLE = "unreachable"
    FAILED = "failed"


IDLE = "cpu.idle is set (systemd's CPUWeight=idle): the kernel refuses it another weight"


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: str
    attribute: Attribute
    old: str | None
    new: str
    reason: str
    outcome: Outcome
    detail: str = ""
    unit: str | None = None
    """The systemd unit it went through, for a cgroup systemd owns."""


@dataclass(frozen=True, slots=True)
class _Pending:
    path: str
    attribute: Attribute
    target: Target
    current: Value | None

    @property
    def depth(self) -> int:
        return self.path.count("/")


class Units(Protocol):
    """systemd's side of writing the cgroups it owns (nodeagent.sdbus.Systemd)."""

    def unit_for_cgroup(self, cgroup: str) -> str: ...

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None: ...

    def freeze_unit(self, unit: str, frozen: bool) -> None: ...


class Executor:
    def __init__(
        self,
        tree: CgroupTree,
        audit: AuditFn,
        dry_run: bool = False,
        units: Units | None = None,
        without_bus: Callable[[], WithoutBus] = lambda: WithoutBus.READ_ONLY,
        *,
        guard: SelfGuard | None = None,
    ) -> None:
        self.tree = tree
        self.guard = SelfGuard(tree) if guard is None else guard
        """Where the agent runs: never tightened (see the module's docstring)."""
        self._guarded: set[str] = set()
        """Cgroups a tightening write was refused for, the agent's: logged once each."""
        self.audit = audit
        self.dry_run = dry_run
        self.units = units
        self.without_bus = without_bus
        self._bus_down: str | None = None
        """Why D-Bus could not be reached, while it cannot; logged once per outage."""
        self.reach = Reachability()
        """How the last call to systemd went (the metrics and /v1/status)."""
        self._verified = _VerifiedUnits(tree)
        self._unthawed: list[CgroupPlan] = []
        """Thaws outside the plan's workloads that did not land (`_thaws`)."""

    def apply(
        self, plan: Plan, snapshot: NodeSnapshot, only: Collection[str] | None = None
    ) -> list[WriteResult]:
        """`only`: the cgroups to compare (those read afresh when the plan has not
        changed); all of them by default."""
        current = {w.path: w.sample.settings for w in (*snapshot.workloads, *snapshot.levels)}
        thaws = self._thaws(plan, current)
        compared = [cg for cg in plan.cgroups if only is None or cg.path in only]
        owned = {
            cg.path: cg.targets for cg in (*plan.cgroups, *thaws) if cg.write is WriteMode.SYSTEMD
        }
        systemd = _UnitWrites(owned, current)
        results: list[WriteResult] = []
        pending: list[_Pending] = []
        for cg in (*compared, *thaws):
            settings = current.get(cg.path, {})
            for attr, target in cg.targets.items():
                now = settings.get(attr)
                if now == target.value:
                    continue
                change = _Pending(cg.path, attr, target, now)
                if _writable(cg.write, attr):
                    pending.append(change)
                else:
                    why = read_only_reason(cg.identity)
                    results.append(_result(change, Outcome.READ_ONLY, why))
        loosen: list[_Pending] = []
        tighten: list[_Pending] = []
        for p in pending:
            looser = p.current is not None and is_looser(p.target.value, p.current)
            (loosen if looser else tighten).append(p)
        tighten, refused = self._unguarded(tighten, plan)
        results.extend(refused)
        # memory.max last within a cgroup: memory.high, lowered first, makes the kernel reclaim
        ordered = sorted(loosen, key=lambda p: p.depth) + sorted(
            tighten, key=lambda p: (-p.depth, p.attribute is Attribute.MEMORY_MAX)
        )
        for p in ordered:
            if self.dry_run:
                results.append(_result(p, Outcome.DRY_RUN))
                continue
            results.append(self._apply_one(p, systemd))
        again = {r.path for r in results if r.outcome in (Outcome.FAILED, Outcome.READ_ONLY)}
        self._unthawed = [
            cg for cg in thaws if cg.path in again and _writable(cg.write, Attribute.FREEZE)
        ]
        return results

    def _unguarded(
        self, tighten: list[_Pending], plan: Plan
    ) -> tuple[list[_Pending], list[WriteResult]]:
        """The tightening writes that may go ahead, and those refused: the agent runs in
        that cgroup or below it, or it keeps the node running (`node_critical`, found
        from the plan's own cgroups and claims: make_plan drops such targets already,
        this holds whatever a plan made again, or any other, says). A thaw is never
        refused (its value is unknown when it is outside the workloads: it only ever
        loosens). Both are looked for only when something tightens, which most ticks
        do not."""
        if not tighten:
            return tighten, []
        critical = node_critical([cg.identity for cg in plan.cgroups], plan.assignments())
        self.guard.begin()
        kept: list[_Pending] = []
        refused: list[WriteResult] = []
        for p in tighten:
            if p.target.value == Frozen(False):
                kept.append(p)
                continue
            event, why = "agent.node_critical_guarded", critical.get(p.path)
            if why is None:
                event, why = "agent.own_cgroup_guarded", self.guard.refuses(p.path)
            else:
                why += ": what keeps the node running is never lowered, capped or frozen"
            if why is None:
                kept.append(p)
                continue
            refused.append(_result(p, Outcome.READ_ONLY, why))
            if p.path not in self._guarded:
                self._guarded.add(p.path)
                log.warning(
                    event,
                    cgroup=p.path,
                    attribute=str(p.attribute),
                    value=p.target.render(),
                    reason=p.target.reason,
                    problem=why,
                    action="left as it is; said once per cgroup",
                )
        return kept, refused

    def _thaws(
        self, plan: Plan, current: Mapping[str, Mapping[Attribute, Value]]
    ) -> list[CgroupPlan]:
        """The plan's thaws of cgroups outside its workloads (`Plan.thaws`: frozen by the
        agent, no longer planned), and those an earlier apply could not write (a refused
        write, D-Bus down): tried at every apply until they land or the cgroup is gone,
        since no policy remembers them. Their value is not known (they are not sensed):
        each is read, and written only if frozen. One back among the workloads is the
        policies' again."""
        thaws = {cg.path: cg for cg in (*self._unthawed, *plan.thaws)}
        return [cg for path, cg in thaws.items() if path not in current]

    def write(
        self, path: str, attribute: Attribute, target: Target, via: WriteMode, now: Value | None
    ) -> WriteResult:
        """One attribute of one cgroup written outside a plan (`nodeagent release` and a
        workload no rule claims any more hand originals back through it), the way every
        write of the plan goes (`via`: through its unit for a cgroup systemd owns, its
        property alone being what changes; never memory.max below usage), audited; `now`:
        the value the caller read. Not guarded: what is written back only loosens."""
        p = _Pending(path, attribute, target, now)
        if not _writable(via, attribute):
            return _result(p, Outcome.READ_ONLY, f"{attribute} of a cgroup written as {via}")
        if self.dry_run:
            return _result(p, Outcome.DRY_RUN)
        owned = {path: {attribute: target}} if via is WriteMode.SYSTEMD else {}
        return self._apply_one(p, _UnitWrites(owned, {}))

    def _apply_one(self, p: _Pending, systemd: _UnitWrites) -> WriteResult:
        try:
            with self.tree.open(p.path) as d:
                if p.attribute is Attribute.MEMORY_MAX:
                    refused = self._memory_guard(d, p)
                    if refused is not None:
                        return refused
                if systemd.owns(p.path):
                    unit = self._unit_ready(d, p.path, systemd)
                    if isinstance(unit, WriteResult):
                        return replace(unit, attribute=p.attribute, new=p.target.render())
                    if unit is not None:
                        return self._through_systemd(d, p, unit)
                    written = self._write(d, p)
                    return replace(written, detail=written.detail or self._direct())
                return self._write(d, p)
        except CgroupVanished:
            return _result(p, Outcome.VANISHED)
        except Exception as e:  # refused, unreadable, unparsable: this write only
            return _result(p, Outcome.FAILED, one_line(e))

    def _unit_ready(
        self, d: CgroupDir, path: str, systemd: _UnitWrites
    ) -> str | WriteResult | None:
        """The unit of a systemd cgroup with its properties set (once per tick), None to
        write its files directly (no D-Bus, by the operator's choice), or the result that
        stands for all its writes (read-only without D-Bus, or the unit refused)."""
        if path in systemd.units:
            return systemd.units[path]
        outcome: str | WriteResult | None
        properties: dict[str, int] = {}
        try:
            if self.units is None:
                raise NoBus("no D-Bus client configured")
            unit = self._verified.unit(d, self.units)
            if isinstance(unit, str):
                properties = systemd.properties(path, self._usage(d), self._idle(d))
                if properties:  # none for a thaw alone: nothing to set
                    self.units.set_unit_properties(unit, properties)
        except NoBus as e:
            outcome = self._no_bus(path, str(e))
        except NodeagentError as e:
            outcome = WriteResult(path, Attribute.CPU_WEIGHT, None, "", "", Outcome.FAILED, str(e))
        else:
            self.reach.ok("systemd", self._bus_address())
            if self._bus_down is not None:
                log.info("systemd.reachable", via=getattr(self.units, "via", None))
                self._bus_down = None
            if isinstance(unit, NotTheUnit):
                why = str(unit)
                outcome = WriteResult(
                    path, Attribute.CPU_WEIGHT, None, "", "", Outcome.READ_ONLY, why
                )
            else:
                if properties:
                    audit_event(
                        "systemd.set_properties",
                        unit=unit,
                        cgroup=path,
                        properties=properties,
                        reason="set on the unit before its files, as runc does",
                    )
                outcome = unit
        systemd.units[path] = outcome
        return outcome

    def _direct(self) -> str:
        """Why a file of a cgroup systemd owns was written directly (the bus is down)."""
        return f"{self._bus_down}: written to the file only, which a daemon-reload undoes"

    def _bus_address(self) -> str:
        return str(getattr(self.units, "via", None) or "the system bus")

    def _no_bus(self, path: str, why: str) -> WriteResult | None:
        if self.units is not None:  # none configured is no peer
            self.reach.failed("systemd", self._bus_address(), why)
        fallback = self.without_bus()
        if self._bus_down is None:
            log.warning(
                "systemd.unreachable",
                error=why,
                action="writing the files of systemd's cgroups directly (lost at daemon-reload)"
                if fallback is WithoutBus.DIRECT
                else "leaving the cgroups systemd owns as they are until D-Bus is back",
            )
            self._bus_down = why
        if fallback is WithoutBus.DIRECT:
            return None
        return WriteResult(path, Attribute.CPU_WEIGHT, None, "", "", Outcome.READ_ONLY, why)

    def _idle(self, d: CgroupDir) -> bool:
        text = d.read_optional(Attribute.CPU_WEIGHT)
        return text is not None and is_idle_weight(text)

    def _usage(self, d: CgroupDir) -> int | None:
        text = d.read_optional("memory.current")
        return None if text is None else parse.single_int(text)

    def _through_systemd(self, d: CgroupDir, p: _Pending, unit: str) -> WriteResult:
        """systemd has the property (a freeze: FreezeUnit or ThawUnit); the file follows
        (systemd may have written it already)."""
        new, reason = p.target.render(), f"{p.target.reason} (through systemd, unit {unit})"
        old = None if p.current is None else p.current.render()
        if p.attribute is Attribute.FREEZE:
            assert isinstance(p.target.value, Frozen)
            if old is None:  # not sensed (a thaw outside the workloads): its file says
                text = d.read_optional(p.attribute)
                old = None if text is None else text.strip()
                if old == new:
                    return WriteResult(
                        d.path, p.attribute, old, new, reason, Outcome.UNCHANGED, unit=unit
                    )
            self.units.freeze_unit(unit, p.target.value.frozen)  # type: ignore[union-attr]
        result = self._write(d, replace(p, target=replace(p.target, reason=reason)))
        if result.outcome is Outcome.UNCHANGED:  # systemd wrote it (or enabled its controller)
            self.audit(self.tree.path_of(d.path) + "/" + p.attribute, p.attribute, old, new, reason)
            result = replace(result, old=old, outcome=Outcome.WRITTEN)
        return replace(result, unit=unit)

    def _write(self, d: CgroupDir, p: _Pending) -> WriteResult:
        """Re-read the old value (recorded in the audit), then write only if it still differs."""
        new, reason = p.target.render(), p.target.reason
        text = d.read_optional(p.attribute)
        if text is None:
            raise NodeagentError(
                f"cgroup {d.path}: no {p.attribute}: its controller is not enabled"
            )
        old = text.strip()
        if old == new:
            return WriteResult(d.path, p.attribute, old, new, reason, Outcome.UNCHANGED)
        if p.attribute is Attribute.CPU_WEIGHT and is_idle_weight(old):
            return WriteResult(d.path, p.attribute, old, new, reason, Outcome.READ_ONLY, IDLE)
        d.write(p.attribute, new)
        self.audit(self.tree.path_of(d.path) + "/" + p.attribute, p.attribute, old, new, reason)
        return WriteResult(d.path, p.attribute, old, new, reason, Outcome.WRITTEN)

    def _memory_guard(self, d: CgroupDir, p: _Pending) -> WriteResult | None:
        """Refuse to set memory.max below usage; the plan lowers memory.high meanwhile."""
        target = p.target.value
        assert isinstance(target, MemoryLimit)
        usage = parse.single_int(d.read("memory.current"))
        if target.bytes is None or usage <= target.bytes:
            return None
        detail = f"usage {usage} is above the target {target.bytes}: memory.max waits for reclaim"
        return _result(p, Outcome.UNREACHABLE, detail)


class _UnitWrites:
    """One tick's systemd cgroups: their properties, and each unit once set."""

    def __init__(
        self,
        owned: Mapping[str, Mapping[Attribute, Target]],
        current: Mapping[str, Mapping[Attribute, Value]],
    ) -> None:
        self.plans = owned
        """The targets of each cgroup systemd owns."""
        self.current = current
        self.units: dict[str, str | WriteResult | None] = {}

    def owns(self, path: str) -> bool:
        return path in self.plans

    def properties(self, path: str, usage: int | None, idle: bool) -> dict[str, int]:
        """Every attribute the plan holds for the cgroup, as unit properties: systemd resets
        any it is not given to the unit's own value. A memory.max that must wait for
        reclaim keeps the kernel's value meanwhile. A unit made idle (`idle`: CPUWeight=idle)
        keeps it: a weight set on it would end its idleness."""
        out: dict[str, int] = {}
        for attr, target in self.plans[path].items():
            if attr is Attribute.FREEZE or (attr is Attribute.CPU_WEIGHT and idle):
                continue
            value = target.value
            if (
                attr is Attribute.MEMORY_MAX
                and isinstance(value, MemoryLimit)
                and value.bytes is not None
                and usage is not None
                and usage > value.bytes
            ):
                kept = self.current.get(path, {}).get(attr)
                if kept is None:
                    continue
                value = kept
            out.update(unit_properties(attr, value))
        return out


_SWEEP_MIN = 256


class _VerifiedUnits:
    """Which unit systemd says has each cgroup as its own, or that none has, kept for the
    cgroup's life: asked once per cgroup, not once per write or per tick.

    Keyed by path and checked against the directory's inode (on cgroup2, the cgroup's
    64-bit id, not reused while the kernel runs): one removed and made again under the same
    path, by a runtime or by anyone else, is asked about again. Entries whose cgroup is
    gone are dropped whenever the cache has doubled since the last sweep, so it holds about
    the live cgroups, not every one ever seen.
    """

    def __init__(self, tree: CgroupTree) -> None:
        self._tree = tree
        self._known: dict[str, tuple[int, str | NotTheUnit]] = {}
        self._sweep_at = _SWEEP_MIN

    def unit(self, d: CgroupDir, units: Units) -> str | NotTheUnit:
        """The unit of the open cgroup `d`, or why none is (returned, not raised: kept)."""
        inode = os.fstat(d.fd).st_ino
        known = self._known.get(d.path)
        if known is not None and known[0] == inode:
            return known[1]
        answer: str | NotTheUnit
        try:
            answer = units.unit_for_cgroup(d.path)
        except NotTheUnit as e:
            log.warning(
                "systemd.not_the_unit",
                cgroup=e.cgroup,
                unit=e.unit,
                unit_cgroup=e.unit_cgroup or None,
                action="left read-only: writing through that unit would change its cgroup",
            )
            answer = e.with_traceback(None)  # kept as a value: its frames need not be
        self._known[d.path] = (inode, answer)
        if len(self._known) >= self._sweep_at:
            self._sweep()
        return answer

    def _sweep(self) -> None:
        for path, (inode, _) in list(self._known.items()):
            try:
                with self._tree.open(path) as d:
                    alive = os.fstat(d.fd).st_ino == inode
            except (CgroupVanished, NodeagentError):
                alive = False
            if not alive:
                del self._known[path]
        self._sweep_at = max(_SWEEP_MIN, 2 * len(self._known))


def not_in_place(plan: Plan, results: Sequence[WriteResult]) -> list[str]:
    """What of `plan` the kernel does not hold after `results` (all of its writes): each
    cgroup it skipped, and each write that neither landed nor found the value there, one
    line each."""
    out = [f"{cg.path}: not planned: {cg.skipped}" for cg in plan.cgroups if cg.skipped]
    for r in results:
        if r.outcome not in (Outcome.WRITTEN, Outcome.UNCHANGED):
            detail = f": {r.detail}" if r.detail else ""
            out.append(f"{r.attribute} {r.new}: {r.outcome}{detail}")
    return out


def _writable(mode: WriteMode, attribute: Attribute) -> bool:
    """Whether the agent may write `attribute` of a cgroup it may write as `mode`."""
    if mode is WriteMode.WEIGHT_ONLY:
        return attribute is Attribute.CPU_WEIGHT
    return mode is not WriteMode.READ_ONLY


def _result(p: _Pending, outcome: Outcome, detail: str = "") -> WriteResult:
    old = None if p.current is None else p.current.render()
    return WriteResult(
        p.path, p.attribute, old, p.target.render(), p.target.reason, outcome, detail
    )
