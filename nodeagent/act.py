"""Apply a plan to the kernel: only what differs, in a safe order, every write audited.

Writes that relax a limit go top-down and writes that tighten go bottom-up, so
a parent is never tighter than its child mid-change (koordlet's leveled
update). memory.max is never set below what the cgroup uses: memory.high is
lowered first so the kernel reclaims, and the target is reported unreachable
until usage fits. Cgroups owned by systemd are never written directly.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree, CgroupVanished, CgroupWriteError
from nodeagent.cgroupfs.values import Attribute, MemoryLimit, Value, is_looser
from nodeagent.policy.plan import Plan, Target
from nodeagent.snapshot import NodeSnapshot

AuditFn = Callable[[str, str, str | None, str, str], None]


class Outcome(enum.StrEnum):
    WRITTEN = "written"
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
                if cg.identity.owner.writable:
                    pending.append(change)
                else:
                    why = f"owned by {cg.identity.owner}: not written directly"
                    results.append(_result(change, Outcome.READ_ONLY, why))
        loosen = [
            p for p in pending if p.current is not None and is_looser(p.target.value, p.current)
        ]
        tighten = [p for p in pending if p not in loosen]
        ordered = sorted(loosen, key=lambda p: p.depth) + sorted(tighten, key=lambda p: -p.depth)
        for p in ordered:
            if self.dry_run:
                results.append(_result(p, Outcome.DRY_RUN))
                continue
            results.extend(self._apply_one(p))
        return results

    def _apply_one(self, p: _Pending) -> list[WriteResult]:
        try:
            with self.tree.open(p.path) as d:
                if p.attribute is Attribute.MEMORY_MAX:
                    guarded = self._memory_guard(d, p)
                    if guarded is not None:
                        return guarded
                return [self._write(d, p.attribute, p.target.render(), p.target.reason)]
        except CgroupVanished:
            return [_result(p, Outcome.VANISHED)]
        except CgroupWriteError as e:
            return [_result(p, Outcome.FAILED, str(e))]

    def _write(self, d: CgroupDir, attribute: Attribute, new: str, reason: str) -> WriteResult:
        old = d.read(attribute).strip()
        if old != new:
            d.write(attribute, new)
            self.audit(self.tree.path_of(d.path) + "/" + attribute, attribute, old, new, reason)
        return WriteResult(d.path, attribute, old, new, reason, Outcome.WRITTEN)

    def _memory_guard(self, d: CgroupDir, p: _Pending) -> list[WriteResult] | None:
        """Refuse to set memory.max below usage; lower memory.high to the target instead."""
        target = p.target.value
        assert isinstance(target, MemoryLimit)
        usage = parse.single_int(d.read("memory.current"))
        if target.bytes is None or usage <= target.bytes:
            return None
        out = []
        high = parse.limit(d.read(Attribute.MEMORY_HIGH))
        if high is None or high > target.bytes:
            reason = (
                f"memory.max target {target.bytes} is below usage {usage}: lower memory.high first"
            )
            out.append(self._write(d, Attribute.MEMORY_HIGH, target.render(), reason))
        detail = (
            f"usage {usage} is above the target {target.bytes}; memory.max left as is until reclaim"
        )
        out.append(_result(p, Outcome.UNREACHABLE, detail))
        return out


def _result(p: _Pending, outcome: Outcome, detail: str = "") -> WriteResult:
    old = None if p.current is None else p.current.render()
    return WriteResult(
        p.path, p.attribute, old, p.target.render(), p.target.reason, outcome, detail
    )
