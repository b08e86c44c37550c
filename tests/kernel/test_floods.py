"""Floods against a real daemon under the shipped unit's descriptor limit (issue 12.16, 12.18).

`nodeagent run` starts with RLIMIT_NOFILE set to the shipped unit's `LimitNOFILE=`, read from
systemd/nodeagent.service (a stand-in for systemd applying it: the rest of the unit's sandbox
does not bear on descriptors or connections). Then, at once:

- uid 65534 (nobody), outside the socket group, keeps 800 idle connections open to the
  metrics endpoint on loopback, opening a new one for every one the daemon closes;
- the same uid with the socket's group keeps 200 idle connections open to the API socket,
  far beyond what one uid is served, likewise.

The daemon holds only a few of each (8 metrics connections and 8 + 16 API ones per uid)
and closes or refuses the rest at once, so the flooders spin, reconnecting: a harder load
than connections that stay idle.

Throughout, root calls the API with the CLI's own 5 s deadline (in this process, so that
Python's start-up under TCG is not counted), and runs the real `nodeagent allocations` now
and then. The flood lasts until 30 ticks have passed during it (and at least 20 s, so that
the daemon's request deadlines cut the idle connections several times over), with a ceiling
of 10 minutes for a busy host. Shown: every one of root's calls answered within 5 s, ticks
kept coming without a failed tick, the daemon's descriptors bounded far below the limit, a
scrape still answered. The figures (connections held, ticks, root's latency before and
during the flood) are printed and kept in the JUnit report (out/test-kernel/nightly.xml: the
flood is in the nightly tier, ./scripts/test nightly).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from floods import CLI_DEADLINE, Calls, Flood
from helpers import rel, sleeper, wait_for

from nodeagent.api import client
from nodeagent.errors import NodeagentError

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "nodeagent.service"
GROUP = 4242  # the socket's group: no user on the node has it
NOBODY = 65534
METRICS_FLOOD, API_FLOOD = 800, 200
TICKS_DURING, AT_LEAST_S, CEILING_S = 30, 20.0, 600.0
POLICY = """\
version: 1
agent:
  interval: 200ms
  managed_root: {managed}
  state_file: {tmp}/state.json
  socket: {socket}
  socket_group: "{group}"
  metrics: {{listen: "127.0.0.1:{port}"}}
tenants:
  a: {{shares: 1}}
rules:
  - {{name: jobs, match: {{}}, tenant: a, limits: {{cpu_max: 1}}}}
"""


def unit_nofile() -> int:
    found = re.search(r"^LimitNOFILE=(\d+)$", UNIT.read_text(), re.MULTILINE)
    assert found, f"{UNIT} sets no LimitNOFILE="
    return int(found.group(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    log: Path
    socket: str
    port: int

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def limit(self) -> str:
        limits = Path(f"/proc/{self.proc.pid}/limits").read_text()
        return next(line for line in limits.splitlines() if line.startswith("Max open files"))

    def tick(self) -> int:
        status = client.get(self.socket, "/v1/status", timeout=CLI_DEADLINE)
        assert isinstance(status, dict)
        return int(status["tick"] or 0)

    def events(self) -> list[dict[str, object]]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [json.loads(line) if line.startswith("{") else {"raw": line} for line in lines]


@pytest.fixture
def daemon(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[Daemon]:
    run = Path(tempfile.mkdtemp(prefix="nodeagent-floods-", dir="/run"))
    run.chmod(0o755)  # nobody may reach the socket's directory, which the daemon makes 0750
    sock = str(run / "api" / "nodeagent.sock")
    managed = cgroup_sandbox / "managed"
    port = free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        POLICY.format(managed=rel(managed), tmp=tmp_path, socket=sock, group=GROUP, port=port)
    )
    nofile = unit_nofile()
    log = tmp_path / "daemon.log"
    argv = [sys.executable, "-m", "nodeagent", "run", "--config", str(policy)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["prlimit", f"--nofile={nofile}:{nofile}", "--", *argv], stdout=out, stderr=out
        )
    served = Daemon(proc, log, sock, port)
    sleepers = []
    try:
        assert wait_for(lambda: _answers(sock), timeout=240), log.read_text()
        for i in range(4):
            (managed / f"job-{i}").mkdir()
            sleepers.append(sleeper(managed / f"job-{i}"))
        assert served.limit().split()[3:5] == [str(nofile), str(nofile)], served.limit()
        yield served
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        for p in sleepers:
            p.kill()
            p.wait()
        shutil.rmtree(run, ignore_errors=True)


def _answers(sock: str) -> bool:
    try:
        client.get(sock, "/v1/status")
    except NodeagentError:
        return False
    return True


def scrape(port: int) -> tuple[int, float]:
    """(HTTP status, seconds) of one scrape as Prometheus makes it; status 0 on no answer."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            r.read()
            return int(r.status), time.monotonic() - t0
    except OSError:
        return 0, time.monotonic() - t0


def cli_allocations(sock: str) -> tuple[int, float]:
    """The real command, as root types it: (exit status, seconds with Python's start-up)."""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "nodeagent", "allocations", "--socket", sock]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.returncode, time.monotonic() - t0


def measure(daemon: Daemon, calls: Calls, ticks: int, at_least: float) -> dict[str, float]:
    """Root's calls until `ticks` ticks have passed and `at_least` seconds; returns the ticks
    seen, the seconds, and the most descriptors the daemon held."""
    t0, first = time.monotonic(), daemon.tick()
    seen, fds = 0, 0
    while seen < ticks or time.monotonic() - t0 < at_least:
        assert time.monotonic() - t0 < CEILING_S, f"only {seen} ticks in {CEILING_S:.0f}s"
        calls.call(daemon.socket, "/v1/allocations")
        status = calls.call(daemon.socket, "/v1/status")
        if isinstance(status, dict):
            seen = int(status["tick"] or 0) - first
        fds = max(fds, daemon.fds())
        assert daemon.proc.poll() is None, "the daemon exited"
        time.sleep(0.2)
    return {"ticks": seen, "seconds": round(time.monotonic() - t0, 1), "most_fds": fds}


@pytest.mark.nightly
@pytest.mark.timeout(900)
def test_floods_leave_the_loop_ticking_and_root_answered(
    daemon: Daemon,
    capsys: pytest.CaptureFixture[str],
    record_testsuite_property: Callable[[str, object], None],
) -> None:
    before = Calls()
    quiet = measure(daemon, before, ticks=10, at_least=2.0)

    during = Calls()
    scrapes: list[tuple[int, float]] = []
    cli: list[tuple[int, float]] = []
    with (
        Flood(("127.0.0.1", daemon.port), METRICS_FLOOD, NOBODY) as metrics,
        Flood(daemon.socket, API_FLOOD, NOBODY, groups=(GROUP,)) as api,
    ):
        assert wait_for(metrics.opened_all, timeout=300), metrics.latest
        assert wait_for(api.opened_all, timeout=300), api.latest
        cli.append(cli_allocations(daemon.socket))
        loud = measure(daemon, during, ticks=TICKS_DURING, at_least=AT_LEAST_S)
        scrapes.append(scrape(daemon.port))
        cli.append(cli_allocations(daemon.socket))
        flooders = {"metrics": dict(metrics.latest), "api": dict(api.latest)}
        most = {"metrics": metrics.most_open, "api": api.most_open}

    figures = {
        "limit_nofile": unit_nofile(),
        "connections_held": most,
        "flooders": flooders,
        "before": {**quiet, **before.figures()},
        "during": {**loud, **during.figures()},
        "ticks_per_s": {
            "before": round(quiet["ticks"] / quiet["seconds"], 2),
            "during": round(loud["ticks"] / loud["seconds"], 2),
        },
        "scrape_during": {"status": scrapes[0][0], "seconds": round(scrapes[0][1], 2)},
        "cli_allocations_s_with_startup": [round(s, 1) for _, s in cli],
    }
    record_testsuite_property("floods", json.dumps(figures))  # out/test-kernel/nightly.xml
    with capsys.disabled():
        print("\nfloods:", json.dumps(figures))

    assert during.failed == [], during.failed[:5]  # root answered within 5 s, every time
    assert loud["ticks"] >= TICKS_DURING
    failed = [e for e in daemon.events() if str(e.get("event")).endswith("failed") or "raw" in e]
    assert failed == [], failed[:5]  # no tick.failed, no accept_failed, no traceback
    # the daemon closed or refused what it would not hold, and the flooders opened more
    assert flooders["metrics"]["cut"] > METRICS_FLOOD and flooders["api"]["cut"] > API_FLOOD
    # 8 of the flooder's metrics connections and 24 of its API ones, the loop's own, Python's
    assert loud["most_fds"] < 150 < unit_nofile()
    assert scrapes[0][0] == 200
