"""Turn a tick's plan, snapshot and write results into what the API serves and the CLI prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nodeagent.act import WriteResult
from nodeagent.cgroupfs.values import Attribute
from nodeagent.policy.base import describe
from nodeagent.policy.plan import CgroupPlan, Plan
from nodeagent.snapshot import NodeSnapshot, WorkloadState
from nodeagent.tables import SHOWN


@dataclass(frozen=True, slots=True)
class TickRecord:
    snapshot: NodeSnapshot
    plan: Plan
    results: tuple[WriteResult, ...]
    duration: float
    dry_run: bool


def _values(cg: CgroupPlan, w: WorkloadState | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr in SHOWN:
        current = None if w is None else w.sample.settings.get(attr)
        target = cg.targets.get(attr)
        out[attr] = {
            "current": None if current is None else current.render(),
            "target": None if target is None else target.render(),
            "policy": None if target is None else target.policy,
            "reason": None if target is None else target.reason,
        }
    return out


def _results_for(path: str, results: Sequence[WriteResult]) -> list[dict[str, Any]]:
    return [
        {
            "attribute": str(r.attribute),
            "old": r.old,
            "new": r.new,
            "outcome": str(r.outcome),
            "detail": r.detail,
        }
        for r in results
        if r.path == path
    ]


def allocations(record: TickRecord) -> dict[str, Any]:
    states = {w.path: w for w in record.snapshot.workloads}
    rows = []
    for cg in record.plan.cgroups:
        w = states.get(cg.path)
        reasons = sorted({t.reason for t in cg.targets.values()})
        rows.append(
            {
                **describe(cg.identity, cg.assignment),
                "values": _values(cg, w),
                "cpu_rate": None if w is None else w.cpu_rate,
                "memory_current": None if w is None else w.sample.memory_current,
                "reason": "; ".join(reasons)
                if reasons
                else "nothing to set: its tenant is idle and its rule has no limits",
                "writes": _results_for(cg.path, record.results),
            }
        )
    return {
        "tick": record.snapshot.seq,
        "time": record.snapshot.wall_time,
        "dry_run": record.dry_run,
        "tick_seconds": record.duration,
        "tenant_usage": dict(record.plan.tenant_usage),
        "allocations": rows,
    }


def _sensed(w: WorkloadState | None) -> dict[str, Any]:
    """What the sensors read this tick, beyond the settings: usage, throttling, pressure."""
    if w is None:
        return {}
    s = w.sample
    return {
        "populated": s.populated,
        "cpu_rate": w.cpu_rate,
        "throttled_fraction": w.throttled_fraction,
        "cpu_pressure_some_avg10": None if s.cpu_psi is None else s.cpu_psi.some.avg10,
        "memory_current": s.memory_current,
        "memory_anon": s.memory_anon,
        "memory_file": s.memory_file,
        "memory_min": s.memory_min,
        "memory_low": None if (v := s.settings.get(Attribute.MEMORY_LOW)) is None else v.render(),
        "memory_events": dict(s.memory_events),
        "memory_pressure_some_avg10": None if s.memory_psi is None else s.memory_psi.some.avg10,
    }


def explain(record: TickRecord, cg: CgroupPlan) -> dict[str, Any]:
    w = next((w for w in record.snapshot.workloads if w.path == cg.path), None)
    return {
        "sensed": _sensed(w),
        **describe(cg.identity, cg.assignment),
        "tick": record.snapshot.seq,
        "dry_run": record.dry_run,
        "values": _values(cg, w),
        "cpu_rate": None if w is None else w.cpu_rate,
        "trace": list(cg.trace),
        "writes": _results_for(cg.path, record.results),
    }


def find(plan: Plan, query: str, cgroup_root: str) -> list[CgroupPlan]:
    """Cgroups a user's argument names: a path (relative or absolute), a name or an id prefix."""
    q = query.strip()
    if q.startswith(cgroup_root.rstrip("/") + "/"):
        q = q[len(cgroup_root.rstrip("/")) + 1 :]
    q = q.strip("/")
    exact = [cg for cg in plan.cgroups if cg.path == q]
    if exact:
        return exact
    return [
        cg
        for cg in plan.cgroups
        if cg.identity.name == q
        or (cg.identity.container_id or "").startswith(q)
        or cg.path.endswith("/" + q)
    ]
