"""Apply a plan to the kernel: only what differs, in a safe order, every write audited.

Writes that relax a limit go top-down and writes that tighten go bottom-up, so
a parent is never tighter than its child mid-change (koordlet's leveled
update). memory.max is never set below what the cgroup uses: the write is held
back and reported unreachable until usage fits (the plan lowers memory.high
meanwhile, so the kernel reclaims). Cgroups owned by systemd are never written directly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import AuditFn, CgroupDir, CgroupTree, CgroupVanished
from nodeagent.cgroupfs.values import Attribute, MemoryLimit, Value, is_looser
from nodeagent.errors import NodeagentError, one_line
from nodeagent.ownership import WriteMode
from nodeagent.policy.plan import Plan, Target
from nodeagent.snapshot import NodeSnapshot


class Outcome(enum.StrEnum):
    WRITTEN = "written"
    UNCHANGED = "unchanged"
    DRY_RUN = "dry-run"
    READ_ONLY = "read-only"
    VANISHED = "vanished"
    UNREACHABLE = "unreachable"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: str
    attribute: Attribute
    old: str | None
    new: str
    reason: str
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True, slots=True)
class _Pending:
    path: str
    attribute: Attribute
    target: Target
    current: Value | None

    @property
    def depth(self) -> int:
        return self.path.count("/")


class Executor:
    def __init__(self, tree: CgroupTree, audit: AuditFn, dry_run: bool = False) -> None:
        self.tree = tree
        self.audit = audit
        self.dry_run = dry_run

    def apply(self, plan: Plan, snapshot: NodeSnapshot) -> list[WriteResult]:
        current = {w.path: w.sample.settings for w in snapshot.workloads}
        results: list[WriteResult] = []
        pending: list[_Pending] = []
        for cg in plan.cgroups:
            settings = current.get(cg.path, {})
            for attr, target in cg.targets.items():
                now = settings.get(attr)
                if now == target.value:
                    continue
                change = _Pending(cg.path, attr, target, now)
                if cg.write is not WriteMode.READ_ONLY:
                    pending.append(change)
                else:
                    why = f"owned by {cg.identity.owner}: not written directly"
                    results.append(_result(change, Outcome.READ_ONLY, why))
        loosen: list[_Pending] = []
        tighten: list[_Pending] = []
        for p in pending:
            looser = p.current is not None and is_looser(p.target.value, p.current)
            (loosen if looser else tighten).append(p)
        # memory.max last within a cgroup: memory.high, lowered first, makes the kernel reclaim
        ordered = sorted(loosen, key=lambda p: p.depth) + sorted(
            tighten, key=lambda p: (-p.depth, p.attribute is Attribute.MEMORY_MAX)
        )
        for p in ordered:
            if self.dry_run:
                results.append(_result(p, Outcome.DRY_RUN))
                continue
            results.append(self._apply_one(p))
        return results

    def _apply_one(self, p: _Pending) -> WriteResult:
        try:
            with self.tree.open(p.path) as d:
                if p.attribute is Attribute.MEMORY_MAX:
                    refused = self._memory_guard(d, p)
                    if refused is not None:
                        return refused
                return self._write(d, p)
        except CgroupVanished:
            return _result(p, Outcome.VANISHED)
        except Exception as e:  # refused, unreadable, unparsable: this write only
            return _result(p, Outcome.FAILED, one_line(e))

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


def _result(p: _Pending, outcome: Outcome, detail: str = "") -> WriteResult:
    old = None if p.current is None else p.current.render()
    return WriteResult(
        p.path, p.attribute, old, p.target.render(), p.target.reason, outcome, detail
    )
