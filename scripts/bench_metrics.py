"""Benchmark of the metrics endpoint, run by `scripts/bench metrics [--json]`.

For 10, 100 and 1000 workloads: the time to render one scrape (collect and encode, on the
HTTP thread), its size, and the time `observe` holds the collector's lock on the loop's
thread per tick. In process, from ticks planned by the real policies over synthetic
snapshots: no cgroup is read, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from prometheus_client import CollectorRegistry, generate_latest

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.metrics.collector import TickCollector
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import make_plan
from nodeagent.report import TickRecord
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState
from nodeagent.spec.model import PolicySpec

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
    psi = Psi(PsiLine(3.0, 2.0, 1.0, 10), PsiLine(1.0, 1.0, 1.0, 5))
    settings = {
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
            cpu_usage_us=10**7,
            cpu_nr_periods=100,
            cpu_nr_throttled=1,
            cpu_throttled_us=1000,
            memory_current=1 << 28,
            cpu_psi=psi,
            memory_psi=psi,
            settings=settings,
        )
        states.append(WorkloadState(identity, sample, 0.5, 0.01, 0.02))
    node = NodeState(64, 0.5, 1 << 38, 1 << 37, 4096)
    snap = NodeSnapshot(seq, 1.7e9 + seq, 1.0, node, tuple(states))
    plan = make_plan(snap, POLICY, {})
    results = tuple(
        WriteResult(cg.path, a, "100", t.render(), t.reason, Outcome.WRITTEN)
        for cg in plan.cgroups
        for a, t in cg.targets.items()
    )
    assignments = assign([w.identity for w in states], POLICY)
    return TickRecord(snap, plan, results, 0.01, False, assignments)


def measure(n: int) -> dict[str, float]:
    records = [tick(n, seq) for seq in range(2)]
    collector = TickCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    observe: list[float] = []
    render: list[float] = []
    size = 0
    for i in range(REPEAT):
        started = time.perf_counter()
        collector.observe(records[i % 2])
        observe.append(time.perf_counter() - started)
        started = time.perf_counter()
        size = len(generate_latest(registry))
        render.append(time.perf_counter() - started)
    return {
        "workloads": n,
        "scrape_ms_p50": statistics.median(render) * 1000,
        "scrape_ms_max": max(render) * 1000,
        "scrape_kib": size / 1024,
        "observe_ms_p50": statistics.median(observe) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    rows = [measure(n) for n in SIZES]
    if args.json:
        print(json.dumps({"benchmark": "metrics", "repeat": REPEAT, "sizes": rows}))
        return
    print(f"{'workloads':>9}  {'scrape p50':>10}  {'scrape max':>10}  {'size':>9}  {'observe':>9}")
    for r in rows:
        print(
            f"{r['workloads']:>9}  {r['scrape_ms_p50']:>8.1f}ms  {r['scrape_ms_max']:>8.1f}ms"
            f"  {r['scrape_kib']:>6.0f}KiB  {r['observe_ms_p50']:>9.3f}ms"
        )


if __name__ == "__main__":
    main()
