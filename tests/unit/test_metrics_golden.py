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
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from test_metrics import full_scrape
from ticks import REPO, record, state

from nodeagent.metrics.collector import TickCollector

DATA = Path(__file__).parent / "data" / "metrics"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
FORMATS = {"text": "", "openmetrics": OPENMETRICS}
BUILD = b"nodeagent_build_info{"
BENCH = REPO / "scripts" / "bench_metrics.py"


def _bench() -> ModuleType:
    """scripts/bench_metrics.py: its ticks (`n` busy jobs in 4 tenants, every attribute
    written) and the server's own render are what this test checks."""
    spec = importlib.util.spec_from_file_location("bench_metrics", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


def served(collector: Collector, accept: str) -> bytes:
    """What the server answers /metrics with, less its process's series (and the build's,
    which name the Python that runs the test)."""
    body: bytes = bench.renderer(collector, accept)()
    return b"".join(x for x in body.splitlines(True) if not x.startswith(BUILD))


def thousand() -> TickCollector:
    c = TickCollector()
    c.observe(bench.tick(1000, 0))
    c.observe(bench.tick(1000, 1))
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
