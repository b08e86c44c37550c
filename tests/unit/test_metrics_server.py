"""The metrics endpoint over HTTP on loopback: served from a thread, started by the daemon
only when `agent.metrics.listen` is set, refused in one line when the port is taken."""

from __future__ import annotations

import contextlib
import grp
import os
import re
import socket
import stat
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from selectors import SelectorKey

import pytest
import structlog
from descriptors import accept_tries_while_out_of_fds
from peers import as_user, held_as
from prometheus_client.core import GaugeMetricFamily, Metric
from waits import counted, wait_for

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent, serve_metrics
from nodeagent.errors import NodeagentError
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.server import MetricsServer
from nodeagent.policyfile.load import check_text, load_policy
from nodeagent.report import TickRecord


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
    return open_agent(load_policy(policy), tree, dry_run=True, config_path=str(policy))


@contextlib.contextmanager
def daemon_serving(tmp_path: Path, port: int) -> Iterator[tuple[Agent, MetricsServer]]:
    """A daemon whose policy listens on `port`, and the endpoint it serves, closed after."""
    agent = agent_for(tmp_path, port)
    server = serve_metrics(agent)
    assert server is not None
    try:
        yield agent, server
    finally:
        server.close()


def test_the_daemon_counts_its_ticks_on_the_endpoint(tmp_path: Path) -> None:
    port = free_port()
    with daemon_serving(tmp_path, port) as (agent, _):
        assert agent.run(once=True)
        body = get(f"http://127.0.0.1:{port}/metrics")
        assert 'nodeagent_ticks_total{result="ok"} 1.0' in body
        assert "nodeagent_dry_run 1.0" in body
        assert "nodeagent_deadline_misses_total 0.0" in body


def test_off_unless_listen_is_set(tmp_path: Path) -> None:
    spec = check_text("version: 1\ntenants: {a: {shares: 1}}\n", "p.yaml").spec
    agent = open_agent(spec, CgroupTree(str(tmp_path)), dry_run=True)
    assert serve_metrics(agent) is None
    assert agent.observers == []


def test_moving_the_endpoint_needs_a_restart(tmp_path: Path) -> None:
    agent = agent_for(tmp_path, 9464)
    agent_for(tmp_path, 9465)  # rewrites the policy file
    with structlog.testing.capture_logs() as logs:
        agent.reload()
    assert agent.rec.spec.agent.metrics.listen == "127.0.0.1:9464"
    assert [e["changed"] for e in logs if e["event"] == "policy.needs_restart"] == [
        ["agent.metrics"]
    ]


# --- floods, deadlines, paths, caching, isolation (issues 12.16 and 13.19) -------------------

NOBODY = 65534
NOGROUP = grp.getgrnam("nogroup").gr_gid
needs_root = pytest.mark.usefixtures("needs_root")  # fails, never skips, unless root
Address = str | tuple[str, int]


def address(server: MetricsServer) -> Address:
    listen = server.listen
    return (
        listen.removeprefix("unix:") if listen.startswith("unix:") else ("127.0.0.1", server.port)
    )


def http(
    where: Address, path: str = "/metrics", headers: str = "", method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """One request by hand: (status, headers in lower case, body)."""
    family = socket.AF_UNIX if isinstance(where, str) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(where)
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    return int(status.split()[1]), fields, body


@pytest.fixture
def admitted(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many connections the server has taken in so far (kept, or closed at its cap)."""
    return counted(monkeypatch, MetricsServer, "admit")  # called by the server's loop alone


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_connections_cost_the_daemon_a_bounded_number_of_descriptors(
    served: MetricsServer,
) -> None:
    # Issue 12.16: a thread and a descriptor per connection, without end: 487 idle
    # connections took the daemon to its descriptor limit.
    base = open_fds()
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(300)]
    try:
        assert "nodeagent_ticks_total" in get(f"http://127.0.0.1:{served.port}/metrics")
        held = open_fds() - base - len(idle)  # the server's side of them
    finally:
        for sock in idle:
            sock.close()
    assert held <= getattr(MetricsServer, "max_connections", 64) + 4


@needs_root
def test_one_local_users_idle_tcp_connections_delay_nobody_else(
    served: MetricsServer, admitted: Callable[[], int]
) -> None:
    # Over loopback the kernel's socket table says whose each connection is: uid 65534's
    # are capped at 8 (the rest closed), so root's scrape and uid 4000's do not queue.
    where = ("127.0.0.1", served.port)
    base = open_fds()
    with held_as(NOBODY, NOGROUP, where, 300) as held:
        assert held == 300
        wait_for(lambda: admitted() == held, 30, f"the daemon to take in all {held}")
        assert http(where)[0] == 200
        assert open_fds() - base <= getattr(MetricsServer, "per_uid_connections", 8) + 2
        other = as_user(4000, 4000, [], lambda: str(http(where)[0]))
    assert other == "200"


def test_a_silent_or_dripping_client_is_cut_at_the_request_deadline(
    collector: TickCollector, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MetricsServer, "request_timeout", 0.5, raising=False)
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", collector)
    try:
        for drip in (False, True):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                t0 = time.monotonic()
                sock.settimeout(0.1)
                cut = False
                while not cut and time.monotonic() - t0 < 5:
                    with contextlib.suppress(TimeoutError):
                        cut = sock.recv(100) == b""
                    if drip and not cut:
                        with contextlib.suppress(OSError):
                            sock.send(b"G")
                assert cut, f"not cut within 5 s (drip={drip})"
    finally:
        server.close()


def test_health_and_other_paths(tmp_path: Path) -> None:
    port = free_port()
    with daemon_serving(tmp_path, port) as (agent, _):
        assert agent.run(once=True)
        status, fields, body = http(("127.0.0.1", port), "/healthz")
        assert (status, body) == (200, b"ok\n")
        assert fields["content-type"] == "text/plain; charset=utf-8"
        for path in ("/", "/metricsx", "/favicon.ico"):
            status, _, body = http(("127.0.0.1", port), path)
            assert (status, body) == (404, b"not found: try /metrics or /healthz\n"), path
        status, _, body = http(("127.0.0.1", port), "/metrics?x=1")
        assert status == 200 and b"nodeagent_ticks_total" in body


def test_healthz_is_503_once_no_tick_came_within_the_window(tmp_path: Path) -> None:
    agent = agent_for(tmp_path, free_port())
    records: list[TickRecord] = []
    assert agent.run(once=True, on_tick=records.append)
    window = [60.0]
    server = MetricsServer.start(
        f"127.0.0.1:{free_port()}", TickCollector(), stale_after=lambda: window[0]
    )
    where = address(server)
    try:
        assert http(where, "/healthz")[::2] == (200, b"starting: no tick yet\n")
        server.observe(records[0])
        assert http(where, "/healthz")[::2] == (200, b"ok\n")
        server.observe(None)  # a failed tick keeps the last good one's time
        assert http(where, "/healthz")[::2] == (200, b"ok\n")
        window[0] = 0.0
        status, _, body = http(where, "/healthz")
        assert status == 503
        assert re.fullmatch(rb"stale: no tick for \d+\.\ds \(the limit is 0s\)\n", body), body
    finally:
        server.close()


def test_the_daemons_health_window_is_three_ticks_or_30_s(tmp_path: Path) -> None:
    with daemon_serving(tmp_path, free_port()) as (agent, server):
        assert server.stale_after() == 30.0  # interval 1 s
        agent.rec.spec = agent.rec.spec.model_copy(
            update={"agent": agent.rec.spec.agent.model_copy(update={"interval": 20.0})}
        )
        assert server.stale_after() == 60.0


class CountingCollector(TickCollector):
    def __init__(self) -> None:
        super().__init__()
        self.collects = 0

    def collect(self) -> Iterator[Metric]:
        self.collects += 1
        return super().collect()


def test_scrapes_within_the_cache_time_share_one_render(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MetricsServer, "cache_seconds", 60.0, raising=False)
    counting = CountingCollector()
    counting.observe(None)
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", counting)
    try:
        bodies = {get(f"http://127.0.0.1:{server.port}/metrics") for _ in range(5)}
    finally:
        server.close()
    assert counting.collects == 1
    assert len(bodies) == 1


def test_a_render_older_than_the_cache_time_is_made_again() -> None:
    counting = CountingCollector()
    counting.observe(None)
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", counting)
    try:
        get(f"http://127.0.0.1:{server.port}/metrics")
        # no wait on anything: the render's age is what is tested (a second in the cache)
        time.sleep(MetricsServer.cache_seconds + 0.2)
        get(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    assert counting.collects == 2


class WithABadWorkload(TickCollector):
    """Adds one family in which one sample cannot be encoded (a lone surrogate)."""

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        family = GaugeMetricFamily("nodeagent_workload_cpu_weight", "w", labels=["cgroup"])
        family.add_metric(["good"], 1)
        family.add_metric(["bad\udcff"], 2)
        yield family


def test_one_bad_sample_costs_only_itself() -> None:
    collector = WithABadWorkload()
    collector.observe(None)
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", collector)
    try:
        with structlog.testing.capture_logs() as logs:
            body = get(f"http://127.0.0.1:{server.port}/metrics")
    finally:
        server.close()
    assert 'nodeagent_workload_cpu_weight{cgroup="good"} 1.0' in body
    assert "bad" not in body
    assert 'nodeagent_ticks_total{result="failed"} 1.0' in body
    assert "process_resident_memory_bytes" in body
    dropped = [e for e in logs if e["event"] == "metrics.samples_dropped"]
    assert [(e["family"], e["dropped"]) for e in dropped] == [("nodeagent_workload_cpu_weight", 1)]


def test_openmetrics_when_asked_with_one_eof(served: MetricsServer) -> None:
    accept = "Accept: application/openmetrics-text; version=1.0.0\r\n"
    status, fields, body = http(address(served), headers=accept)
    assert status == 200
    assert fields["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"\n# EOF\n") and body.count(b"# EOF") == 1
    status, fields, body = http(address(served))
    assert fields["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# EOF" not in body


def test_head_and_other_methods(served: MetricsServer) -> None:
    status, fields, body = http(address(served), method="HEAD")
    assert (status, body) == (200, b"") and int(fields["content-length"]) > 0
    status, fields, _ = http(address(served), method="POST")
    assert (status, fields["allow"]) == (405, "GET, HEAD")


def test_a_bearer_token_guards_the_metrics_not_the_health(
    tmp_path: Path, collector: TickCollector
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    server = MetricsServer.start(
        f"127.0.0.1:{free_port()}", collector, bearer_token_file=str(token)
    )
    where = address(server)
    try:
        for auth in ("", "Authorization: Bearer wrong\r\n", "Authorization: Basic czNjcmV0\r\n"):
            status, fields, _ = http(where, headers=auth)
            assert (status, fields["www-authenticate"]) == (401, 'Bearer realm="nodeagent"')
        status, _, body = http(where, headers="Authorization: Bearer s3cret\r\n")
        assert status == 200 and b"nodeagent_ticks_total" in body
        assert http(where, "/healthz")[0] == 200
    finally:
        server.close()


@pytest.mark.parametrize(("text", "why"), [(None, "No such file or directory"), ("\n", "empty")])
def test_a_token_file_that_is_missing_or_empty_is_one_line(
    tmp_path: Path, collector: TickCollector, text: str | None, why: str
) -> None:
    token = tmp_path / "token"
    if text is not None:
        token.write_text(text)
    with pytest.raises(NodeagentError) as info:
        MetricsServer.start(f"127.0.0.1:{free_port()}", collector, bearer_token_file=str(token))
    assert str(info.value) == f"agent.metrics.bearer_token_file {token}: {why}"


@needs_root
def test_a_unix_socket_answers_its_group_and_caps_each_uid(
    sockdir: Path, collector: TickCollector, admitted: Callable[[], int]
) -> None:
    path = sockdir / "metrics.sock"
    server = MetricsServer.start(f"unix:{path}", collector, socket_group="nogroup")
    try:
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOGROUP)
        base = open_fds()
        with held_as(NOBODY, NOGROUP, str(path), 100) as held:
            assert held == 100
            wait_for(lambda: admitted() == held, 30, f"the daemon to take in all {held}")
            status, _, body = http(str(path))  # root, while nobody holds its idle ones
            assert status == 200 and b"nodeagent_ticks_total" in body
            assert open_fds() - base <= MetricsServer.per_uid_connections + 2
            # no wait on anything: only a connection idle this long may be pushed out
            time.sleep(MetricsServer.idle_grace)
            member = as_user(NOBODY, NOGROUP, [], lambda: str(http(str(path))[0]))
            assert member == "200"  # its newest connection pushes out its oldest idle one
        os.chmod(path, 0o666)  # an operator's mistake: the peer check still holds
        stranger = as_user(NOBODY, 4321, [], lambda: str(http(str(path))[0]))
        assert stranger == "403"
    finally:
        server.close()
    assert not path.exists()


def test_a_request_the_loop_has_not_read_yet_is_answered_not_cut_for_a_newcomer(
    served: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI's flood under the real systemd: the loop fell idle_grace behind a scrape whose
    request sat whole in the kernel, and cut it to make room as if it were idle."""
    monkeypatch.setattr(served._pool, "size", 2)  # its limits are read at start
    where = ("127.0.0.1", served.port)

    def held() -> int:
        return len(served._conns)

    select = served.selector.select

    def behind(timeout: float | None = None) -> list[tuple[SelectorKey, int]]:
        return [(key, events) for key, events in select(timeout) if key.data is None]

    monkeypatch.setattr(served.selector, "select", behind)  # the loop sees no request come
    scrape = socket.create_connection(where, timeout=10)
    scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    idle = socket.create_connection(where, timeout=10)
    with scrape, idle:
        wait_for(lambda: held() == 2, 10, "the loop to take in the scrape and the idle one")
        time.sleep(served.idle_grace)  # no wait on anything: both old enough to be cut
        newcomer = socket.create_connection(where, timeout=10)
        with newcomer:
            assert scrape.recv(100).startswith(b"HTTP/1.1 200 ")
            assert idle.recv(100) == b""  # the one really idle made the room


def test_emfile_on_accept_backs_off_and_recovers(
    served: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # made while descriptors last
    tries = accept_tries_while_out_of_fds(monkeypatch, sock, ("127.0.0.1", served.port))
    assert 1 <= tries <= 20  # backing off from 50 ms, doubling: about 5 in 1.5 s
    with sock:
        sock.settimeout(10)
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")
