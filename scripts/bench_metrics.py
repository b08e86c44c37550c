"""Benchmark of the metrics endpoint, run by `scripts/bench metrics [--json]`.

For 10, 100 and 1000 workloads: the CPU time (of the rendering thread) and wall time to
render one scrape as the server does (collect and encode, the text format and OpenMetrics;
the process collector left out), a second scrape of the same tick, its size; on the loop's
side, the time `observe` takes per tick and how long the collector's lock is held then
(what a scrape could make a tick wait for) and by a scrape. In process, from ticks planned
by the real policies over synthetic snapshots: no cgroup is read, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from types import TracebackType

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit, Value
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.server import MetricsServer
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import make_plan
from nodeagent.policyfile.model import PolicySpec
from nodeagent.report import TickRecord
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState

SIZES = (10, 100, 1000)
REPEAT = 20
POLICY = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {f"t{i}": {"shares": i + 1} for i in range(4)},
        "rules": [
            {"name": f"t{i}", "match": {"path": f"nodeagent.slice/t{i}-*"}, "tenant": f"t{i}"}
            for i in range(4)
        ],
    }
)


def tick(n: int, seq: int) -> TickRecord:
    """`n` busy jobs in 4 tenants, every attribute written, their counters apart by one per
    job; also tests/unit/test_metrics_golden.py's tick, whose fixtures hold its scrape."""
    psi = Psi(PsiLine(3.0, 2.0, 1.0, 10), PsiLine(1.0, 1.0, 1.0, 5))
    settings: dict[Attribute, Value] = {
        Attribute.CPU_WEIGHT: CpuWeight(100),
        Attribute.CPU_MAX: CpuMax(None),
        Attribute.MEMORY_MAX: MemoryLimit(None),
        Attribute.MEMORY_HIGH: MemoryLimit(None),
        Attribute.MEMORY_LOW: MemoryLimit(0),
        Attribute.MEMORY_MIN: MemoryLimit(0),
        Attribute.FREEZE: Frozen(False),
    }
    states = []
    for i in range(n):
        path = f"nodeagent.slice/t{i % 4}-{i}"
        identity = WorkloadIdentity(path, Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, path)
        sample = CgroupSample(
            populated=True,
            cpu_usage_us=10**7 + i,
            cpu_nr_periods=100,
            cpu_nr_throttled=1,
            cpu_throttled_us=1000,
            memory_current=(1 << 28) + i,
            cpu_psi=psi,
            memory_psi=psi,
            settings=settings,
        )
        states.append(WorkloadState(identity, sample, 0.5, 0.01, 0.02))
    node = NodeState(64, 0.5, 1 << 38, 1 << 37, 4096)
    snap = NodeSnapshot(seq, 1.7e9 + seq, 1.0, node, tuple(states))
    claimed = assign([w.identity for w in snap.workloads], POLICY)
    plan = make_plan(snap, POLICY, {}, assignments=claimed)
    results = tuple(
        WriteResult(cg.path, a, "100", t.render(), t.reason, Outcome.WRITTEN)
        for cg in plan.cgroups
        for a, t in cg.targets.items()
    )
    assignments = assign([w.identity for w in states], POLICY)
    return TickRecord(snap, plan, results, 0.01, False, assignments)


class TimedLock:
    """The collector's lock, timing how long each holder keeps it, by `phase`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase = "observe"
        self.held: dict[str, list[float]] = {"observe": [], "scrape": []}
        self._since = 0.0

    def __enter__(self) -> None:
        self._lock.acquire()
        self._since = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.held[self.phase].append(time.perf_counter() - self._since)
        self._lock.release()


def renderer(collector: Collector, accept: str) -> Callable[[], bytes]:
    """The server's own render (MetricsServer._render), without a socket or the process
    collector."""
    server = object.__new__(MetricsServer)
    server._sources = (collector,)
    server._dropped_logged = {}
    encoder, _ = choose_encoder(accept)
    return lambda: server._render(encoder)


def timed(fn: Callable[[], bytes]) -> tuple[float, float, int]:
    """CPU seconds (this thread), wall seconds, bytes."""
    cpu, wall = time.thread_time(), time.perf_counter()
    size = len(fn())
    return time.thread_time() - cpu, time.perf_counter() - wall, size


def measure(n: int) -> dict[str, float]:
    records = [tick(n, seq) for seq in range(2)]
    collector = TickCollector()
    lock = TimedLock()
    collector._lock = lock  # type: ignore[assignment]
    text = renderer(collector, "")
    openmetrics = renderer(collector, "application/openmetrics-text; version=1.0.0")
    observe: list[float] = []
    cpu: list[float] = []
    wall: list[float] = []
    again: list[float] = []
    om: list[float] = []
    size = 0
    for i in range(REPEAT):
        lock.phase = "observe"
        started = time.perf_counter()
        collector.observe(records[i % 2])
        observe.append(time.perf_counter() - started)
        lock.phase = "scrape"
        c, w, size = timed(text)
        cpu.append(c)
        wall.append(w)
        again.append(timed(text)[0])
        om.append(timed(openmetrics)[0])
    ms = 1000
    return {
        "workloads": n,
        "scrape_cpu_ms_p50": statistics.median(cpu) * ms,
        "scrape_cpu_ms_max": max(cpu) * ms,
        "scrape_ms_p50": statistics.median(wall) * ms,
        "scrape_ms_max": max(wall) * ms,
        "rescrape_cpu_ms_p50": statistics.median(again) * ms,
        "openmetrics_cpu_ms_p50": statistics.median(om) * ms,
        "scrape_kib": size / 1024,
        "observe_ms_p50": statistics.median(observe) * ms,
        "observe_lock_ms_max": max(lock.held["observe"]) * ms,
        "scrape_lock_ms_max": max(lock.held["scrape"]) * ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    rows = [measure(n) for n in SIZES]
    if args.json:
        print(json.dumps({"benchmark": "metrics", "repeat": REPEAT, "sizes": rows}))
        return
    print(
        f"{'workloads':>9}  {'scrape cpu':>10}  {'max':>8}  {'wall':>8}  {'again':>8}"
        f"  {'openmetr.':>9}  {'size':>9}  {'observe':>8}  {'lock: tick':>10}  {'scrape':>8}"
    )
    print(f"{'':>9}  {'p50':>10}  {'':>8}  {'p50':>8}  {'cpu p50':>8}  {'cpu p50':>9}"
          f"  {'':>9}  {'p50':>8}  {'max':>10}  {'max':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['workloads']:>9}  {r['scrape_cpu_ms_p50']:>8.1f}ms"
            f"  {r['scrape_cpu_ms_max']:>6.1f}ms"
            f"  {r['scrape_ms_p50']:>6.1f}ms  {r['rescrape_cpu_ms_p50']:>6.1f}ms"
            f"  {r['openmetrics_cpu_ms_p50']:>7.1f}ms  {r['scrape_kib']:>6.0f}KiB"
            f"  {r['observe_ms_p50']:>6.2f}ms  {r['observe_lock_ms_max']:>8.3f}ms"
            f"  {r['scrape_lock_ms_max']:>6.3f}ms"
        )


if __name__ == "__main__":
    main()
