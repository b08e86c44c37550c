"""Render the latest tick as Prometheus series.

A custom collector rather than long-lived Gauge children: every scrape is rendered from
the latest TickRecord, so a workload's series are there while it is and go away with it,
and label sets cannot pile up on a node where containers come and go. What must count
across ticks (ticks, writes, the tick-time histogram) is kept here, per tick, by
`observe`; a workload's counters are dropped in the tick it is gone.

`observe` runs on the loop's thread, `collect` on the HTTP server's. The loop counts on its
own and hands each tick over as one frozen `_Seen` (the record, the counters as of it): the
lock is held only to swap that reference, so a scrape never makes a tick wait, whatever it
renders. Each workload, and each group of the node's series, is rendered on its own: one
that fails is left out of that scrape (logged once), never the whole scrape. The workloads'
series (nearly all of a scrape) are rendered once per tick and kept until the next
(`families.Rendered`), each workload's label text while its labels stay the same.
"""

from __future__ import annotations

import math
import platform
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import structlog
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from nodeagent import __version__
from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.errors import one_line
from nodeagent.gpu.backend import GpuBackend
from nodeagent.gpualloc.ledger import EMPTY_VIEW, LedgerView
from nodeagent.identity import WorkloadIdentity
from nodeagent.metrics.families import (
    FAMILIES,
    RUNTIME_NAME_MAX,
    WORKLOAD,
    Labels,
    Rendered,
    Scrape,
    WorkloadPart,
    rendered,
)
from nodeagent.metrics.gpus import GpuMetrics
from nodeagent.policy.base import Assignment, Note
from nodeagent.policy.notes import (
    DeadlineProgress,
    DeadlineStatus,
    GpuViolation,
    ProtectionPhase,
    ProtectionState,
    ViolationKind,
)
from nodeagent.policy.plan import CgroupPlan
from nodeagent.report import TickRecord, describe, status_of
from nodeagent.snapshot import Skipped, WorkloadState
from nodeagent.tables import printable

log = structlog.get_logger("nodeagent")
T = TypeVar("T")

TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, math.inf)
"""Seconds: from a handful of workloads on metal to a thousand under emulation."""
SKIP_STEPS = ("sense", "plan")
MEMORY = (
    (Attribute.MEMORY_MAX, "nodeagent_workload_memory_max_bytes"),
    (Attribute.MEMORY_HIGH, "nodeagent_workload_memory_high_bytes"),
    (Attribute.MEMORY_LOW, "nodeagent_workload_memory_low_bytes"),
    (Attribute.MEMORY_MIN, "nodeagent_workload_memory_min_bytes"),
)
PRESSURE = tuple(
    tuple(f"nodeagent_workload_{r}_pressure_{k}_seconds_total" for k in ("some", "full"))
    for r in ("cpu", "memory")
)
"""The PSI totals' names: (some, full) for cpu.pressure, then memory.pressure."""

Counts = Mapping[tuple[str, str], int]
"""Writes by (attribute, outcome)."""


@dataclass(frozen=True, slots=True, eq=False)
class _Seen:
    """What one scrape renders: the latest record, and the counters as of it. Made by the
    loop and never changed after (nor are the mappings in it)."""

    record: TickRecord | None
    ticks: Mapping[str, int]
    durations: tuple[int, ...]
    duration_sum: float
    writes: Counts
    workload_writes: Mapping[str, Counts]
    overwritten: Mapping[str, int]


@dataclass(frozen=True, slots=True, eq=False)
class _Workloads:
    """The workloads' series of one `_Seen`, kept until the next: the families, the labels
    of each workload shown (by path, for the GPU series) and the parts that failed."""

    seen: _Seen
    families: list[Rendered]
    shown: dict[str, tuple[str, ...]]
    failed: dict[str, str]


Reload = tuple[bool, float]
"""The last reload's outcome: whether it applied the file, and the unix time the policy in
force was loaded."""
BUILD = (__version__, platform.python_version())


class TickCollector(Collector):
    """What the daemon knows beyond the ticks is read at each scrape, through callables:
    `deadline_misses` (the loop counts them, changes.NoteLog), `reload` (the last reload's
    outcome) and `interval` (agent.interval, which a reload may change)."""

    def __init__(
        self,
        deadline_misses: Callable[[], int] = lambda: 0,
        *,
        reload: Callable[[], Reload] | None = None,
        policy: Callable[[], str] | None = None,
        interval: Callable[[], float] | None = None,
    ) -> None:
        self._deadline_misses = deadline_misses
        self._reload = reload
        self._policy = policy
        self._interval = interval
        self._lock = threading.Lock()
        """Held by `observe` to swap `_seen`, by `collect` to read it: nothing more."""
        # the loop's own (only `observe` touches them)
        self._record: TickRecord | None = None
        self._ticks: Counter[str] = Counter({"ok": 0, "failed": 0})
        self._durations = [0] * len(TICK_BUCKETS)
        self._duration_sum = 0.0
        self._writes: Counter[tuple[str, str]] = Counter(
            {(str(a), str(Outcome.FAILED)): 0 for a in Attribute}
        )
        """From 0 for every attribute's failures: increase() misses a counter's first step."""
        self._overwritten: Counter[str] = Counter({str(a): 0 for a in Attribute})
        self._workload_writes: dict[str, Counts] = {}
        """Each workload's counts; a path's mapping is replaced, never changed, when it counts."""
        self._seen = self._snapshot()
        # the scrape's own
        self._gpus: GpuMetrics | None = None
        self._rendered: _Workloads | None = None
        self._labels: dict[str, tuple[WorkloadIdentity, Assignment | None, Labels]] = {}
        """Each workload's label text, by path, with what it was made from."""
        self._report_lock = threading.Lock()
        self._failed: dict[str, str] = {}
        """The parts the last scrape left out, with their errors (logged once each)."""

    def watch_gpus(
        self, backend: GpuBackend, ledger: Callable[[], LedgerView] = lambda: EMPTY_VIEW
    ) -> None:
        """Export `backend`'s GPUs from now on: each GPU's health and telemetry, and each
        workload's GPU memory and processes, read at every scrape, and the queue of
        `ledger` (the view the loop publishes). The daemon calls this once it has a GPU
        backend; until then there are no GPU series."""
        self._gpus = GpuMetrics(backend, ledger)

    def observe(self, record: TickRecord | None) -> None:
        """Count one tick: its record, or None when it failed. Called by one thread at a
        time (the loop's)."""
        if record is None:
            self._ticks["failed"] += 1
        else:
            self._count(record)
        seen = self._snapshot()
        with self._lock:
            self._seen = seen

    def _count(self, record: TickRecord) -> None:
        self._ticks["ok"] += 1
        self._duration_sum += record.duration
        for i, bound in enumerate(TICK_BUCKETS):
            if record.duration <= bound:
                self._durations[i] += 1
        present = _paths(record)
        writes = {p: c for p, c in self._workload_writes.items() if p in present}
        counted: dict[str, dict[tuple[str, str], int]] = {}
        for r in record.results:
            key = (str(r.attribute), str(r.outcome))
            self._writes[key] += 1
            mine = counted.get(r.path)
            if mine is None:
                mine = counted[r.path] = dict(writes.get(r.path, {}))
            mine[key] = mine.get(key, 0) + 1
        writes.update(counted)
        self._workload_writes = writes
        self._overwritten.update(str(a) for _, a in record.snapshot.overwritten)
        self._record = record

    def _snapshot(self) -> _Seen:
        return _Seen(
            self._record,
            dict(self._ticks),
            tuple(self._durations),
            self._duration_sum,
            dict(self._writes),
            dict(self._workload_writes),
            dict(self._overwritten),
        )

    def describe(self) -> Iterator[Metric]:
        return iter([f.empty() for f in FAMILIES])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            seen = self._seen
        out, failed = Scrape(), dict[str, str]()
        _isolated(out, failed, "series:agent", self._agent)
        _isolated(
            out, failed, "series:loop", lambda part: _loop(part, seen, self._deadline_misses())
        )
        workloads: dict[str, tuple[str, ...]] = {}
        record = seen.record
        if record is not None:
            made = self._workloads(seen, record)
            for family in made.families:
                out.put(family)
            failed.update(made.failed)
            workloads = made.shown
            _isolated(out, failed, "series:tenants", lambda part: _tenants(part, record))
            _isolated(out, failed, "series:protection", lambda part: _protection(part, record))
            _isolated(out, failed, "series:violations", lambda part: _violations(part, record))
            _isolated(out, failed, "series:peers", lambda part: _peers(part, record))
        gpus = self._gpus
        if gpus is not None:
            _isolated(out, failed, "series:gpus", lambda part: gpus.render(part, workloads))
        self._report(failed)
        return iter(out)

    def _workloads(self, seen: _Seen, record: TickRecord) -> _Workloads:
        """The workloads' series of `seen`: rendered at its first scrape, kept until the
        next tick's."""
        made = self._rendered
        if made is not None and made.seen is seen:
            return made
        failed: dict[str, str] = {}
        parts, shown = _workloads(failed, record, seen.workload_writes, self._labels_of)
        self._labels = {p: self._labels[p] for p in shown if p in self._labels}
        made = _Workloads(seen, rendered(parts), shown, failed)
        self._rendered = made
        return made

    def _labels_of(self, identity: WorkloadIdentity, assignment: Assignment | None) -> Labels:
        """A workload's labels, made again only when what they are made from changed."""
        kept = self._labels.get(identity.path)
        if kept is not None:
            was, had, labels = kept
            if (was is identity or was == identity) and (had is assignment or had == assignment):
                return labels
        labels = Labels(_labels(identity, assignment))
        self._labels[identity.path] = (identity, assignment, labels)
        return labels

    def _agent(self, out: Scrape) -> None:
        out.add("nodeagent_build_info", BUILD, 1)
        if self._reload is not None:
            applied, loaded_at = self._reload()
            out.add("nodeagent_config_last_reload_successful", (), int(applied))
            out.add("nodeagent_config_last_reload_success_timestamp_seconds", (), loaded_at)
        if self._policy is not None:
            out.add("nodeagent_policy_info", (self._policy(),), 1)
        if self._interval is not None:
            out.add("nodeagent_tick_interval_seconds", (), self._interval())

    def _report(self, failed: Mapping[str, str]) -> None:
        """Log a part that fails when it starts failing or its error changes: once, not
        at every scrape."""
        with self._report_lock:
            new = {k: e for k, e in failed.items() if self._failed.get(k) != e}
            self._failed = dict(failed)
        for key, error in sorted(new.items()):
            kind, _, name = key.partition(":")
            log.error("metrics.render_failed", **{kind: printable(name)}, error=error,
                      action="its series are left out of the scrape")  # fmt: skip


def _isolated(
    out: Scrape, failed: dict[str, str], key: str, render: Callable[[Scrape], T]
) -> T | None:
    """Render one part of the scrape (a workload's series, the tenants') on its own: one
    that fails adds nothing, and the rest of the scrape goes on. `key`: what failed, as
    'cgroup:PATH' or 'series:NAME', for the log."""
    part = Scrape()
    try:
        result = render(part)
    except Exception as e:  # a bug or a reading out of range: only this part is lost
        failed[key] = one_line(e)
        return None
    out.merge(part)
    return result


def _paths(record: TickRecord) -> set[str]:
    return {cg.path for cg in record.plan.cgroups} | {s.path for s in record.snapshot.skipped}


def _loop(out: Scrape, seen: _Seen, misses: int) -> None:
    for result, n in sorted(seen.ticks.items()):
        out.add("nodeagent_ticks_total", (result,), n)
    buckets = list(zip(TICK_BUCKETS, seen.durations, strict=True))
    out.histogram("nodeagent_tick_duration_seconds", buckets, seen.duration_sum)
    for (attribute, outcome), n in sorted(seen.writes.items()):
        out.add("nodeagent_cgroup_writes_total", (attribute, outcome), n)
    for attribute, n in sorted(seen.overwritten.items()):
        out.add("nodeagent_cgroup_overwritten_total", (attribute,), n)
    out.add("nodeagent_deadline_misses_total", (), misses)
    record = seen.record
    if record is None:
        return
    snap, plan = record.snapshot, record.plan
    out.add("nodeagent_last_tick_timestamp_seconds", (), snap.wall_time)
    out.add("nodeagent_dry_run", (), int(record.dry_run))
    out.add("nodeagent_managed_workloads", (), len(_paths(record)))
    steps = Counter(dict.fromkeys(SKIP_STEPS, 0))
    steps.update(s.step for s in snap.skipped)
    steps.update("plan" for cg in plan.cgroups if cg.skipped is not None)
    for step, n in sorted(steps.items()):
        out.add("nodeagent_skipped_cgroups", (step,), n)
    out.add("nodeagent_policy_failures", (), len(plan.problems))
    out.add("nodeagent_node_cpu_cores", (), snap.node.cpu_count)
    out.add("nodeagent_node_cpu_busy_ratio", (), snap.node.cpu_busy)


def _labels(identity: WorkloadIdentity, assignment: Assignment | None) -> tuple[str, ...]:
    d = describe(identity, assignment)
    return tuple(str(d[k] or "")[:RUNTIME_NAME_MAX] for k in WORKLOAD)


def _info(out: WorkloadPart, identity: WorkloadIdentity, labels: Labels, status: str) -> None:
    i = identity
    found = (str(i.kind), str(i.runtime), str(i.owner), str(i.qos or ""), status)
    out.add("nodeagent_workload_info", labels, 1, *found)


LabelsOf = Callable[[WorkloadIdentity, Assignment | None], Labels]


def _workloads(
    failed: dict[str, str], record: TickRecord, writes: Mapping[str, Counts], labels_of: LabelsOf
) -> tuple[list[WorkloadPart], dict[str, tuple[str, ...]]]:
    """Every claimed workload's series, each on its own; returns their parts, and the
    labels of each one shown, by path."""
    states = {w.path: w for w in record.snapshot.workloads}
    results: dict[str, list[WriteResult]] = defaultdict(list)
    for r in record.results:
        results[r.path].append(r)
    parts: list[WorkloadPart] = []
    shown: dict[str, tuple[str, ...]] = {}

    def workload(part: WorkloadPart, cg: CgroupPlan) -> Labels:
        labels = labels_of(cg.identity, cg.assignment)
        w = states.get(cg.path)
        _info(part, cg.identity, labels, status_of(cg, w, results[cg.path])[0])
        if w is not None:
            _settings(part, labels, _applied(cg, w, results[cg.path]))
            _usage(part, labels, w)
        target = record.plan.cpu_targets.get(cg.path)
        cores = None if target is None else target.cores
        part.add("nodeagent_workload_cpu_target_cores", labels, cores)
        _deadline(part, labels, cg.notes)
        _writes(part, labels, writes.get(cg.path, {}))
        return labels

    def skipped(part: WorkloadPart, s: Skipped) -> Labels:
        labels = labels_of(s.identity, record.assignments.get(s.path))
        _info(part, s.identity, labels, "skipped")
        _writes(part, labels, writes.get(s.path, {}))
        return labels

    def one(key: str, path: str, render: Callable[[WorkloadPart], Labels]) -> None:
        part = WorkloadPart()
        try:
            labels = render(part)
        except Exception as e:  # a bug or a reading out of range: only this workload is lost
            failed[key] = one_line(e)
            return
        parts.append(part)
        shown[path] = labels.values

    for cg in record.plan.cgroups:
        one(f"cgroup:{cg.path}", cg.path, partial(workload, cg=cg))
    for s in record.snapshot.skipped:
        one(f"cgroup:{s.path}", s.path, partial(skipped, s=s))
    return parts, shown


def _writes(out: WorkloadPart, labels: Labels, counts: Counts) -> None:
    for (attribute, outcome), n in sorted(counts.items()):
        out.add("nodeagent_workload_writes_total", labels, n, attribute, outcome)


def _applied(
    cg: CgroupPlan, w: WorkloadState, results: Sequence[WriteResult]
) -> dict[Attribute, Value]:
    """The values in the kernel after this tick: what was read, updated by what was written
    (or found already equal when re-read before the write)."""
    values = dict(w.sample.settings)
    for r in results:
        target = cg.targets.get(r.attribute)
        if target is not None and r.outcome in (Outcome.WRITTEN, Outcome.UNCHANGED):
            values[r.attribute] = target.value
    return values


def _settings(out: WorkloadPart, labels: Labels, values: Mapping[Attribute, Value]) -> None:
    weight = values.get(Attribute.CPU_WEIGHT)
    if isinstance(weight, CpuWeight):
        out.add("nodeagent_workload_cpu_weight", labels, weight.value)
    cpu_max = values.get(Attribute.CPU_MAX)
    if isinstance(cpu_max, CpuMax):
        cores = cpu_max.cores
        out.add("nodeagent_workload_cpu_max_cores", labels, math.inf if cores is None else cores)
        out.add("nodeagent_workload_cpu_max_unlimited", labels, int(cores is None))
    for attribute, name in MEMORY:
        limit = values.get(attribute)
        if isinstance(limit, MemoryLimit):
            out.add(name, labels, math.inf if limit.bytes is None else limit.bytes)
    frozen = values.get(Attribute.FREEZE)
    if isinstance(frozen, Frozen):
        out.add("nodeagent_workload_frozen", labels, int(frozen.frozen))


def _usage(out: WorkloadPart, labels: Labels, w: WorkloadState) -> None:
    s = w.sample
    out.add("nodeagent_workload_memory_usage_bytes", labels, s.memory_current)
    out.add("nodeagent_workload_cpu_usage_cores", labels, w.cpu_rate)
    out.add("nodeagent_workload_cpu_usage_seconds_total", labels, _seconds(s.cpu_usage_us))
    out.add("nodeagent_workload_cpu_throttled_ratio", labels, w.throttled_fraction)
    out.add("nodeagent_workload_cpu_throttled_seconds_total", labels, _seconds(s.cpu_throttled_us))
    out.add("nodeagent_workload_cpu_periods_total", labels, s.cpu_nr_periods)
    out.add("nodeagent_workload_cpu_throttled_periods_total", labels, s.cpu_nr_throttled)
    for (some, full), pressure in zip(PRESSURE, (s.cpu_psi, s.memory_psi), strict=True):
        if pressure is not None:
            for name, line in ((some, pressure.some), (full, pressure.full)):
                out.add(name, labels, None if line is None else _seconds(line.total_us))
    for psi, name in (
        (s.cpu_psi, "nodeagent_workload_cpu_psi_some_avg10_ratio"),
        (s.memory_psi, "nodeagent_workload_memory_psi_some_avg10_ratio"),
    ):
        out.add(name, labels, None if psi is None else psi.some.avg10 / 100)
    out.add("nodeagent_workload_cpu_stall_ratio", labels, w.cpu_stall)


def _seconds(us: int | None) -> float | None:
    return None if us is None else us / 1e6


def _number(value: object) -> float | None:
    """A note's field as a sample value: JSON numbers only."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _deadline(out: WorkloadPart, labels: Labels, notes: Sequence[Note]) -> None:
    p = next((n.payload for n in notes if isinstance(n.payload, DeadlineProgress)), None)
    if p is None:
        return
    for name, value in (
        ("nodeagent_deadline_timestamp_seconds", p.deadline),
        ("nodeagent_deadline_work_cpu_seconds", p.work),
        ("nodeagent_deadline_remaining_cpu_seconds", p.remaining),
        ("nodeagent_deadline_required_rate_cores", p.required_rate),
        ("nodeagent_deadline_given_rate_cores", p.rate),
        ("nodeagent_deadline_parallelism_cores", p.parallelism),
        ("nodeagent_deadline_slack_seconds", p.slack),
        ("nodeagent_deadline_predicted_finish_timestamp_seconds", p.predicted_finish),
    ):
        out.add(name, labels, value)
    for status in DeadlineStatus:
        out.add("nodeagent_deadline_status", labels, int(status is p.status), str(status))


def _tenants(out: Scrape, record: TickRecord) -> None:
    """Target against achieved: each tenant's part of the CPU the plan hands to the active
    managed workloads, and of the CPU all managed workloads used over the last tick."""
    tenant = {cg.path: cg.assignment.tenant for cg in record.plan.cgroups if cg.assignment}
    for s in record.snapshot.skipped:
        if (a := record.assignments.get(s.path)) is not None:
            tenant[s.path] = a.tenant
    used: dict[str, float] = defaultdict(float)
    for w in record.snapshot.workloads:
        if w.path in tenant and w.cpu_rate is not None:
            used[tenant[w.path]] += w.cpu_rate
    meant: dict[str, float] = defaultdict(float)
    for path, target in record.plan.cpu_targets.items():
        if target.active and path in tenant:
            meant[tenant[path]] += target.cores
    count = Counter(tenant.values())
    all_used, all_meant = sum(used.values()), sum(meant.values())
    for t in sorted(count):
        out.add("nodeagent_tenant_workloads", (t,), count[t])
        out.add("nodeagent_tenant_cpu_usage_cores", (t,), used[t])
        out.add("nodeagent_tenant_cpu_target_cores", (t,), meant[t])
        out.add("nodeagent_tenant_target_share_ratio", (t,), _part(meant[t], all_meant))
        out.add("nodeagent_tenant_achieved_share_ratio", (t,), _part(used[t], all_used))
    for t, usage in sorted(record.plan.tenant_usage.items()):
        out.add("nodeagent_tenant_decayed_usage_cpu_seconds", (t,), usage)


def _part(mine: float, total: float) -> float | None:
    """None while nothing is measured or planned: a share of nothing is undefined."""
    return mine / total if total > 0 else None


def _protection(out: Scrape, record: TickRecord) -> None:
    p = next((n.payload for n in record.plan.notes if isinstance(n.payload, ProtectionState)), None)
    if p is None:
        return
    for phase in ProtectionPhase:
        out.add("nodeagent_protection_state", (str(phase),), int(phase is p.phase))
    for cls, cores in sorted(p.caps.items()):
        out.add("nodeagent_protection_cap_cores", (cls,), cores)
    out.add("nodeagent_protection_stalling_cgroups", (), len(p.stalling))
    out.add("nodeagent_protection_frozen_cgroups", (), len(p.frozen))


def _peers(out: Scrape, record: TickRecord) -> None:
    """Each service the agent asks, as it answered by the end of the tick."""
    for peer in record.peers:
        name, address = printable(peer.name), printable(peer.address)
        out.add("nodeagent_peer_up", (name, address), int(peer.up))
        if peer.last_ok is not None:
            out.add("nodeagent_peer_last_success_timestamp_seconds", (name,), peer.last_ok)


def _violations(out: Scrape, record: TickRecord) -> None:
    """On a node with GPUs: the gpu-checks policy's notes, one per process, by kind."""
    if record.snapshot.gpus is None:
        return
    found = Counter(dict.fromkeys(map(str, ViolationKind), 0))
    found.update(
        str(n.payload.violation) for n in record.plan.notes if isinstance(n.payload, GpuViolation)
    )
    for kind, n in sorted(found.items()):
        out.add("nodeagent_gpu_violating_processes", (kind,), n)
