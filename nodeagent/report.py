"""Turn a tick's plan, snapshot and write results into what the API serves and the CLI prints."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.values import Attribute, Frozen
from nodeagent.identity import WorkloadIdentity
from nodeagent.ownership import WriteMode
from nodeagent.policy.base import Assignment, Note
from nodeagent.policy.notes import DeadlineProgress
from nodeagent.policy.plan import CgroupPlan, Plan
from nodeagent.reach import Reach
from nodeagent.snapshot import NodeSnapshot, WorkloadState
from nodeagent.tables import SHOWN, short_ids


def describe(
    identity: WorkloadIdentity, assignment: Assignment | None, write: WriteMode | None = None
) -> dict[str, object]:
    """A workload as every reader shows it, described here alone: the report's rows (and
    so the API's answers, nodeagent.api.answers.Workload and the models built on it, which
    are this object's wire type: tests/unit/test_report.py holds their fields to its keys),
    `nodeagent workloads` and the metrics' labels. `write` says how the agent may write it
    (direct, systemd or read-only)."""
    i, a = identity, assignment
    return {
        "cgroup": i.path,
        "name": i.name,
        "kind": str(i.kind),
        "runtime": str(i.runtime),
        "owner": str(i.owner),
        "write": None if write is None else str(write),
        "writable": None if write is None else write is not WriteMode.READ_ONLY,
        "container_id": i.container_id,
        "pod_uid": i.pod_uid,
        "qos": None if i.qos is None else str(i.qos),
        "job_id": i.job_id,
        "account": i.account,
        "rule": None if a is None else a.rule,
        "tenant": None if a is None else a.tenant,
        "class": None if a is None else str(a.workload_class),
        **_metadata(i),
        "matched": [] if a is None else list(a.matched),
        "refused": [] if a is None else list(a.refused),
        "node_critical": None if a is None else a.node_critical,
    }


def _metadata(i: WorkloadIdentity) -> dict[str, object]:
    """What the runtime said (names, image, labels, pod), or why it said nothing."""
    meta, pod = i.meta, i.meta.pod if i.meta is not None else None
    return {
        "container_name": None if meta is None else meta.name,
        "image": None if meta is None else meta.image,
        "namespace": None if pod is None else pod.namespace,
        "pod": None if pod is None else pod.name,
        "metadata": None if meta is None else meta.to_json(),
        "metadata_problem": i.meta_problem,
    }


@dataclass(frozen=True, slots=True)
class TickRecord:
    snapshot: NodeSnapshot
    plan: Plan
    results: tuple[WriteResult, ...]
    duration: float
    dry_run: bool
    assignments: Mapping[str, Assignment] = field(default_factory=dict)
    """Every claimed workload's rule, including those skipped this tick."""
    modes: Mapping[str, WriteMode] = field(default_factory=dict)
    """How the agent may write each claimed workload, including those skipped this tick."""
    peers: tuple[Reach, ...] = ()
    """The runtimes, Slurm, systemd and the kubelet's and API server's sides, as each last
    answered by the end of this tick."""


@dataclass(frozen=True, slots=True)
class AgentView:
    """What the API's reads answer from: the last tick's record and the agent's figures as
    of it. The loop makes a new one after each tick (a failed one too) and each command it
    runs, and replaces the old one whole (`Reconciler.publish`), so a read on the API's
    thread never sees a tick half done, nor these figures of two moments mixed. (The policy
    in force, its digest and the last reload are read beside it: a status during a reload
    may pair the new policy with the last tick.)"""

    record: TickRecord | None
    """None until the first tick."""
    workloads: int
    """Workloads discovery knows."""
    slurm_problem: str | None
    deadline_misses: int
    runtimes: Mapping[str, Mapping[str, object]]
    """Each runtime's state (socket, answering, problem)."""
    jobs: tuple[Mapping[str, Any], ...]
    """`exec`'s jobs, as the state file records them."""


_VALUE_KEYS = ("current", "target", "policy", "reason")


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


def status_of(
    cg: CgroupPlan, w: WorkloadState | None, results: Sequence[WriteResult]
) -> tuple[str, str | None]:
    """ok, frozen, skipped (no plan this tick) or failed (a write was refused), with why."""
    if cg.skipped is not None:
        return "skipped", f"plan: {cg.skipped}"
    frozen = cg.targets.get(Attribute.FREEZE)
    if frozen is not None and frozen.value == Frozen(True):
        return "frozen", frozen.reason
    if w is not None and w.sample.settings.get(Attribute.FREEZE) == Frozen(True):
        return "frozen", "frozen in the kernel (not by this plan)"
    failed = [f"{r.attribute}: {r.detail}" for r in results if r.outcome is Outcome.FAILED]
    return ("failed", "; ".join(failed)) if failed else ("ok", None)


def _note(n: Note) -> dict[str, Any]:
    return {
        "policy": n.policy,
        "kind": str(n.kind),
        "status": n.status,
        "message": n.message,
        **n.fields,
    }


def _deadline(notes: Sequence[Note]) -> dict[str, Any] | None:
    """A deadline job's figures: status, deadline, remaining work, required rate, slack,
    predicted finish."""
    p = next((n.payload for n in notes if isinstance(n.payload, DeadlineProgress)), None)
    return None if p is None else {"status": str(p.status), **p.fields()}


def _gpus(record: TickRecord) -> dict[str, list[int]]:
    """GPU indices each workload holds, as the tick saw the holds."""
    gpus = record.snapshot.gpus
    holds = gpus.holds if gpus is not None else ()
    return {h.cgroup: list(h.indices) for h in holds if h.cgroup is not None}


def _states(snapshot: NodeSnapshot) -> dict[str, WorkloadState]:
    """What the sensors read, for the workloads and the parent levels alike."""
    return {w.path: w for w in (*snapshot.workloads, *snapshot.levels)}


def _reason(cg: CgroupPlan, level: bool) -> str:
    reasons = sorted({t.reason for t in cg.targets.values()})
    if reasons:
        return "; ".join(reasons)
    if level:
        return "nothing to set: no claimed workload below this parent level is busy"
    return "nothing to set: its tenant is idle and its rule has no limits"


def allocations(record: TickRecord) -> dict[str, Any]:
    states = _states(record.snapshot)
    levels = {w.path for w in record.snapshot.levels}
    held = _gpus(record)
    rows = []
    for cg in record.plan.cgroups:
        w = states.get(cg.path)
        writes = [r for r in record.results if r.path == cg.path]
        status, problem = status_of(cg, w, writes)
        rows.append(
            {
                **describe(cg.identity, cg.assignment, cg.write),
                "level": cg.path in levels,  # a parent weighted for its tenants' shares
                "status": status,
                "problem": problem,
                "values": _values(cg, w),
                "cpu_rate": None if w is None else w.cpu_rate,
                "memory_current": None if w is None else w.sample.memory_current,
                "reason": _reason(cg, cg.path in levels),
                "writes": _results_for(cg.path, writes),
                "deadline": _deadline(cg.notes),
                "notes": [_note(n) for n in cg.notes],
                "gpus": held.get(cg.path, []),
            }
        )
    for s in record.snapshot.skipped:
        rows.append(
            {
                **describe(s.identity, record.assignments.get(s.path), record.modes.get(s.path)),
                "level": False,
                "status": "skipped",
                "problem": f"{s.step}: {s.reason}",
                "values": {a: dict.fromkeys(_VALUE_KEYS) for a in SHOWN},
                "cpu_rate": None,
                "memory_current": None,
                "reason": f"skipped this tick ({s.step}): {s.reason}",
                "writes": [],
                "deadline": None,
                "notes": [],
                "gpus": held.get(s.path, []),
            }
        )
    return {
        "tick": record.snapshot.seq,
        "time": record.snapshot.wall_time,
        "dry_run": record.dry_run,
        "tick_seconds": record.duration,
        "tenant_usage": dict(record.plan.tenant_usage),
        "problems": list(record.plan.problems),
        "node_notes": [_note(n) for n in record.plan.notes if n.path is None],
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
        "memory_low": None if (v := s.settings.get(Attribute.MEMORY_LOW)) is None else v.render(),
        "memory_min": None if (v := s.settings.get(Attribute.MEMORY_MIN)) is None else v.render(),
        "frozen": None if (v := s.settings.get(Attribute.FREEZE)) is None else v.render() == "1",
        "cpu_stall": w.cpu_stall,
        "threads": s.threads,
        "memory_events": dict(s.memory_events),
        "memory_pressure_some_avg10": None if s.memory_psi is None else s.memory_psi.some.avg10,
    }


def explain(record: TickRecord, identity: WorkloadIdentity) -> dict[str, Any]:
    cg = next((c for c in record.plan.cgroups if c.path == identity.path), None)
    if cg is None:  # skipped before planning: say why, there is no trace
        s = next(s for s in record.snapshot.skipped if s.path == identity.path)
        return {
            "sensed": {},
            **describe(
                identity, record.assignments.get(identity.path), record.modes.get(identity.path)
            ),
            "level": False,
            "below": None,
            "status": "skipped",
            "problem": f"{s.step}: {s.reason}",
            "reason": f"skipped this tick ({s.step}): {s.reason}",
            "tick": record.snapshot.seq,
            "dry_run": record.dry_run,
            "values": {a: dict.fromkeys(_VALUE_KEYS) for a in SHOWN},
            "cpu_rate": None,
            "trace": [f"skipped this tick ({s.step}): {s.reason}"],
            "writes": [],
            "deadline": None,
            "notes": [],
        }
    w = _states(record.snapshot).get(cg.path)
    level = any(w.path == cg.path for w in record.snapshot.levels)
    writes = [r for r in record.results if r.path == cg.path]
    status, problem = status_of(cg, w, writes)
    # a trace says how each value came about; a policy that gave none still said why
    trace = list(cg.trace) or [
        f"{t.policy}: {attr} {t.value.render()}: {t.reason}" for attr, t in cg.targets.items()
    ]
    return {
        "sensed": _sensed(w),
        **describe(cg.identity, cg.assignment, cg.write),
        "level": level,
        "below": _below(record.plan, cg.path) if level else None,
        "status": status,
        "problem": problem,
        "reason": _reason(cg, level),
        "tick": record.snapshot.seq,
        "dry_run": record.dry_run,
        "values": _values(cg, w),
        "cpu_rate": None if w is None else w.cpu_rate,
        "trace": trace,
        "writes": _results_for(cg.path, writes),
        "deadline": _deadline(cg.notes),
        "notes": [_note(n) for n in cg.notes],
    }


def _below(plan: Plan, level: str) -> dict[str, Any]:
    """The claimed workloads a parent level holds: how many, and of which tenants."""
    inside = [c.assignment for c in plan.cgroups if c.assignment and c.path.startswith(level + "/")]
    return {"workloads": len(inside), "tenants": sorted({a.tenant for a in inside})}


def identities(record: TickRecord) -> list[WorkloadIdentity]:
    """Every claimed workload of the tick: planned, or skipped before planning."""
    return [cg.identity for cg in record.plan.cgroups] + [
        s.identity for s in record.snapshot.skipped
    ]


def find(
    candidates: Sequence[WorkloadIdentity], query: str, cgroup_root: str
) -> list[WorkloadIdentity]:
    """Workloads a user's argument names: a path (relative or absolute, also with the short
    ids the tables show), a name (the runtime's too: a container's, `namespace/pod`,
    `namespace/pod/container`) or an id prefix."""
    q = query.strip()
    if q.startswith(cgroup_root.rstrip("/") + "/"):
        q = q[len(cgroup_root.rstrip("/")) + 1 :]
    q = q.strip("/")
    exact = [i for i in candidates if i.path == q] or [
        i for i in candidates if short_ids(i.path) == q
    ]
    if exact:
        return exact
    return [
        i
        for i in candidates
        if i.name == q
        or q in _runtime_names(i)
        or (i.container_id or "").startswith(q)
        or i.path.endswith("/" + q)
        or short_ids(i.path).endswith("/" + q)
    ]


def _runtime_names(i: WorkloadIdentity) -> tuple[str, ...]:
    meta = i.meta
    if meta is None:
        return ()
    if meta.pod is None:
        return () if meta.name is None else (meta.name,)
    pod = f"{meta.pod.namespace}/{meta.pod.name}"
    return (pod,) if meta.name is None else (f"{pod}/{meta.name}",)
