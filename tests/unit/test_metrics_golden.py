"""The scrape at 1000 workloads, byte for byte as the renderer before the text fast path
(issue 18, goal 4) wrote it: the server's render of one planned tick, in the text format and
in OpenMetrics, against fixtures made once from that code (main at b65229b); and against
prometheus_client's own encoder over the same families' Samples, for any tick.

The fixtures hold a tick planned by the real policies: a change to what the policies plan
for it changes them too. Remake them then from the code before the change, and look at the
diff: `PYTHONPATH=OLD_TREE:tests/unit python -c 'import test_metrics_golden as t;
t.write_fixtures()'`.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from test_metrics import full_scrape
from ticks import record, state

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.parse import Psi, PsiLine
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, MemoryLimit
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.server import MetricsServer
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import make_plan
from nodeagent.report import TickRecord
from nodeagent.snapshot import CgroupSample, NodeSnapshot, NodeState, WorkloadState
from nodeagent.spec.model import PolicySpec

DATA = Path(__file__).parent / "data" / "metrics"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
FORMATS = {"text": "", "openmetrics": OPENMETRICS}
BUILD = b"nodeagent_build_info{"
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
    """`n` busy jobs in 4 tenants, every attribute written (scripts/bench_metrics.py's)."""
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
    plan = make_plan(snap, POLICY, {})
    results = tuple(
        WriteResult(cg.path, a, "100", t.render(), t.reason, Outcome.WRITTEN)
        for cg in plan.cgroups
        for a, t in cg.targets.items()
    )
    assignments = assign([w.identity for w in states], POLICY)
    return TickRecord(snap, plan, results, 0.01, False, assignments)


def served(collector: Collector, accept: str) -> bytes:
    """What the server answers /metrics with, less its process's series (and the build's,
    which name the Python that runs the test)."""
    server = object.__new__(MetricsServer)
    server._sources = (collector,)
    server._dropped_logged = {}
    encoder, _ = choose_encoder(accept)
    body = server._render(encoder)
    return b"".join(x for x in body.splitlines(True) if not x.startswith(BUILD))


def thousand() -> TickCollector:
    c = TickCollector()
    c.observe(tick(1000, 0))
    c.observe(tick(1000, 1))
    return c


def write_fixtures() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    c = thousand()
    for name, accept in FORMATS.items():
        (DATA / f"scrape-1000.{name}.gz").write_bytes(gzip.compress(served(c, accept), mtime=0))


@pytest.mark.parametrize("name", FORMATS)
def test_a_scrape_at_1000_workloads_is_the_old_renderers_byte_for_byte(name: str) -> None:
    c = thousand()
    want = gzip.decompress((DATA / f"scrape-1000.{name}.gz").read_bytes())
    got = served(c, FORMATS[name])
    assert got == want
    assert served(c, FORMATS[name]) == want, "the kept render, served again"


def _plain(collector: Collector) -> CollectorRegistry:
    """The collector's families through prometheus_client's encoder, sample by sample."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


@pytest.mark.parametrize(
    "accept",
    [
        "",
        OPENMETRICS,
        "text/plain; version=1.0.0; escaping=allow-utf-8",
        "application/openmetrics-text; version=1.0.0; escaping=dots",
    ],
)
def test_the_servers_render_is_the_encoders_for_every_kind_of_series(accept: str) -> None:
    """A full scrape (deadlines, protection, GPUs) and hostile cgroup names: the server's
    render equals the encoder's over the Samples, in any format it may be asked for (an
    escaping that renames, dots, goes through the encoder)."""
    hostile = TickCollector()
    hostile.observe(
        record(
            [state('nodeagent.slice/a-"x"\\y\nz} 1', 1.0), state("nodeagent.slice/a-\udcff", 1.0)]
        )
    )
    encoder, _ = choose_encoder(accept)
    for registry in (full_scrape(), _plain(hostile), _plain(thousand())):
        tail = encoder(CollectorRegistry())
        want = encoder(registry)
        want = b"".join(x for x in want.splitlines(True) if not x.startswith(BUILD))
        assert served(registry, accept) == want.removesuffix(tail) + tail
