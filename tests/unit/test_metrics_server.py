"""The metrics endpoint over HTTP on loopback: served from a thread, started by the daemon
only when `agent.metrics.listen` is set, refused in one line when the port is taken."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, serve_metrics
from nodeagent.errors import NodeagentError
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.server import MetricsServer
from nodeagent.spec.load import load_policy, parse_policy


def free_port(family: socket.AddressFamily = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
        assert response.status == 200
        return str(response.read().decode())


@pytest.fixture
def collector() -> TickCollector:
    c = TickCollector()
    c.observe(None)
    return c


@pytest.fixture
def served(collector: TickCollector) -> Iterator[MetricsServer]:
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", collector)
    yield server
    server.close()


def test_serves_the_collector_and_the_agents_own_process(served: MetricsServer) -> None:
    body = get(f"http://127.0.0.1:{served.port}/metrics")
    assert 'nodeagent_ticks_total{result="failed"} 1.0' in body
    assert "process_resident_memory_bytes" in body


def test_a_port_in_use_is_one_line(served: MetricsServer, collector: TickCollector) -> None:
    listen = f"127.0.0.1:{served.port}"
    with pytest.raises(NodeagentError) as info:
        MetricsServer.start(listen, collector)
    in_use = f"agent.metrics.listen {listen}: cannot listen: Address already in use"
    assert str(info.value) == in_use


def test_closing_frees_the_port(collector: TickCollector) -> None:
    listen = f"127.0.0.1:{free_port()}"
    MetricsServer.start(listen, collector).close()
    MetricsServer.start(listen, collector).close()


def test_an_address_this_host_lacks_is_one_line(collector: TickCollector) -> None:
    with pytest.raises(NodeagentError, match=r"^agent.metrics.listen 192\.0\.2\.1:9464: cannot"):
        MetricsServer.start("192.0.2.1:9464", collector)  # TEST-NET-1: on no interface here


def test_ipv6_loopback(collector: TickCollector) -> None:
    port = free_port(socket.AF_INET6, "::1")
    server = MetricsServer.start(f"[::1]:{port}", collector)
    try:
        assert "nodeagent_ticks_total" in get(f"http://[::1]:{port}/metrics")
    finally:
        server.close()


POLICY = """\
version: 1
agent:
  state_file: {state}
  metrics: {{listen: "127.0.0.1:{port}"}}
tenants:
  research: {{shares: 2}}
"""


def agent_for(tmp_path: Path, port: int) -> Agent:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(state=tmp_path / "state.json", port=port))
    (tmp_path / "cgroup").mkdir(exist_ok=True)
    tree = CgroupTree(str(tmp_path / "cgroup"))
    return Agent(load_policy(policy), tree, dry_run=True, config_path=str(policy))


def test_the_daemon_counts_its_ticks_on_the_endpoint(tmp_path: Path) -> None:
    port = free_port()
    agent = agent_for(tmp_path, port)
    server = serve_metrics(agent)
    assert server is not None
    try:
        assert agent.run(once=True)
        body = get(f"http://127.0.0.1:{port}/metrics")
        assert 'nodeagent_ticks_total{result="ok"} 1.0' in body
        assert "nodeagent_dry_run 1.0" in body
        assert "nodeagent_deadline_misses_total 0.0" in body
    finally:
        server.close()


def test_off_unless_listen_is_set(tmp_path: Path) -> None:
    spec = parse_policy("version: 1\ntenants: {a: {shares: 1}}\n", "p.yaml")
    agent = Agent(spec, CgroupTree(str(tmp_path)), dry_run=True)
    assert serve_metrics(agent) is None
    assert agent.observers == []


def test_moving_the_endpoint_needs_a_restart(tmp_path: Path) -> None:
    agent = agent_for(tmp_path, 9464)
    agent_for(tmp_path, 9465)  # rewrites the policy file
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert agent.spec.agent.metrics.listen == "127.0.0.1:9464"
    assert [e["changed"] for e in logs if e["event"] == "policy.needs_restart"] == [["metrics"]]
