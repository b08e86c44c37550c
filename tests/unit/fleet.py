"""Four agents scraped as Prometheus scrapes them, as promtool's input series.

In-process collectors fed hand-built ticks (ticks.py), each scraped every SCRAPE seconds
for STEPS scrapes on promtool's clock (promseries.py: labelled with job and instance, each
target's `up`, staleness markers where a series went).

- node-a ticks throughout, and nothing goes wrong;
- node-b stalls at STALL: its loop completes no more ticks while its endpoint answers with
  the last one (a loop hung in a kernel read). Before that its cpu.weight writes fail
  from FAIL; a deadline is missed at MISS; a reload fails at RELOAD; its GPUs run
  processes no hold covers;
- node-c stops answering at DOWN (up 0, its series stale);
- node-d drops out of the targets at GONE (service discovery no longer lists it: its `up`
  goes stale with the rest of its series, as a removed target's do);
- node-a's containerd stops answering it at PEER, and stays down.

Every agent runs the same workloads (a deadline job, a stalling inference pod that has
batch throttled, a job on a GPU), so every dashboard panel has data from each that is up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from promseries import JOB, SCRAPE, Series, input_series, put, samples
from ticks import A1, B1, DUE, GPU_NODE, K8S, record, state, with_deadline

from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.values import Attribute
from nodeagent.gpu.model import GpuState
from nodeagent.gpu.simulated import load_simulated
from nodeagent.metrics.collector import Reload, TickCollector
from nodeagent.reach import Reach
from nodeagent.report import TickRecord
from nodeagent.sense.gpus import GpuSensor
from nodeagent.snapshot import WorkloadState

A, B, C, D = "node-a:9400", "node-b:9400", "node-c:9400", "node-d:9400"
STEPS = 61
"""Scrapes 0..60: 15 minutes."""
END = (STEPS - 1) * SCRAPE
FAIL, MISS, STALL, GONE, RELOAD, DOWN, PEER = 10, 12, 20, 22, 25, 30, 35
"""The scrapes at which node-b's writes start failing, its deadline is missed, it stalls
(its last tick is at STALL - 1); at which node-d is no longer a target; at which node-b's
reload fails; at which node-c goes down; and at which node-a's containerd stops answering."""
CONTAINERD = "/run/containerd/containerd.sock"


POLICY = with_deadline("1970-01-01T00:30:00+00:00", 3000)
"""The deadline job's due 15 minutes after the last scrape, with more work than it can do."""
POLICY_SHA256 = "5" * 64
"""nodeagent_policy_info's sha256: every agent runs the same policy (node-b's refused
reload keeps it)."""


@dataclass
class _Node:
    instance: str
    collector: TickCollector = field(init=False)
    misses: int = 0
    reload: Reload = (True, 0.0)

    def __post_init__(self) -> None:
        self.collector = TickCollector(
            lambda: self.misses,
            reload=lambda: self.reload,
            policy=lambda: POLICY_SHA256,
            interval=lambda: float(SCRAPE),
        )


def _grown(w: WorkloadState, step: int) -> WorkloadState:
    """`w` after `step` ticks at its rate, stall and throttling: the kernel's totals moved
    (100 ms CFS periods; memory pressure 1% of the time)."""
    s, t = w.sample, step * SCRAPE
    stall, throttled = w.cpu_stall or 0.0, w.throttled_fraction or 0.0

    def psi(p: Psi | None, share: float) -> Psi | None:
        if p is None:
            return None

        def line(x: PsiLine | None, part: float) -> PsiLine | None:
            return None if x is None else replace(x, total_us=x.total_us + int(part * t * 1e6))

        some = line(p.some, share)
        assert some is not None
        return Psi(some, line(p.full, share / 2))

    assert s.cpu_usage_us is not None and s.cpu_nr_periods is not None
    assert s.cpu_nr_throttled is not None and s.cpu_throttled_us is not None
    sample = replace(
        s,
        cpu_usage_us=s.cpu_usage_us + int((w.cpu_rate or 0.0) * t * 1e6),
        cpu_nr_periods=s.cpu_nr_periods + 10 * t,
        cpu_nr_throttled=s.cpu_nr_throttled + int(throttled * 10 * t),
        cpu_throttled_us=s.cpu_throttled_us + int(throttled * t * 1e6),
        cpu_psi=psi(s.cpu_psi, stall),
        memory_psi=psi(s.memory_psi, 0.01),
    )
    return replace(w, sample=sample)


def _tick(
    step: int, gpus: GpuState, failing: Sequence[Attribute] = (), down_from: int | None = None
) -> TickRecord:
    """One tick at `step`; its containerd answering, or down from scrape `down_from` on."""
    workloads = [state(K8S, 0.5, stall=0.4), state(DUE, 1.0, used_s=20.0)]
    workloads += [state(A1, 3.0), state(B1, 3.0)]
    made = record(
        [_grown(w, step) for w in workloads],
        failing=failing,
        policy=POLICY,
        seq=step + 1,
        wall_time=step * SCRAPE,
        gpus=gpus,
    )
    if down_from is None or step < down_from:
        containerd = Reach("containerd", CONTAINERD, True, 0.0, step * SCRAPE, None)
    else:
        last = (down_from - 1) * SCRAPE
        refused = f"containerd does not answer: {CONTAINERD}: connection refused"
        containerd = Reach("containerd", CONTAINERD, False, down_from * SCRAPE, last, refused)
    return replace(made, peers=(containerd,))


def _scraped(node: _Node, step: int, series: Series) -> None:
    registry = CollectorRegistry()
    registry.register(node.collector)
    for name, labels, value in samples(generate_latest(registry).decode()):
        put(series, STEPS, step, name, {**labels, "job": JOB, "instance": node.instance}, value)


def fleet_series(tmp: Path) -> list[dict[str, str]]:
    """The four agents' scrapes, as promtool's input_series (one scrape and tick every
    SCRAPE seconds: agent.interval is SCRAPE too)."""
    (tmp / "gpus.yaml").write_text(GPU_NODE)
    backend = load_simulated(tmp / "gpus.yaml")
    violating = GpuSensor(backend).read(())
    assert violating is not None and violating.processes
    clean = replace(violating, processes=())
    nodes = {i: _Node(i) for i in (A, B, C, D)}
    for node in nodes.values():
        node.collector.watch_gpus(backend)
    series: Series = {}
    for step in range(STEPS):
        b = nodes[B]
        if step < STALL:
            failing = (Attribute.CPU_WEIGHT,) if step >= FAIL else ()
            b.collector.observe(_tick(step, violating, failing))
        b.misses, b.reload = int(step >= MISS), (step < RELOAD, 0.0)
        nodes[A].collector.observe(_tick(step, clean, down_from=PEER))
        nodes[C].collector.observe(_tick(step, clean))
        nodes[D].collector.observe(_tick(step, clean))
        for node in nodes.values():
            if node.instance == D and step >= GONE:
                continue  # not a target: no scrape, no `up`
            up = node.instance != C or step < DOWN
            if up:
                _scraped(node, step, series)
            put(series, STEPS, step, "up", {"job": JOB, "instance": node.instance}, int(up))
    return input_series(series)
