"""sd_notify against a real datagram socket standing in for systemd."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing

from nodeagent import logs, sdnotify
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.policyfile.load import load_policy
from nodeagent.sdnotify import healthy


@pytest.fixture
def kept_logging() -> Iterator[None]:
    """structlog's configuration as it was before the test: logs.configure() sets it for the
    whole process, and a later test must see the configuration it would have had."""
    was_configured, config = structlog.is_configured(), structlog.get_config()
    yield
    if was_configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    with sock:
        yield sock


def test_ready_and_watchdog_reach_the_socket(receiver: socket.socket) -> None:
    assert sdnotify.ready() is True
    assert receiver.recv(4096) == b"READY=1"
    assert sdnotify.watchdog() is True
    assert receiver.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.stopping() is True
    assert receiver.recv(4096) == b"STOPPING=1"


def test_status_is_kept_on_one_line(receiver: socket.socket) -> None:
    assert sdnotify.status("applied 3 policies\nREADY=1") is True
    assert receiver.recv(4096) == b"STATUS=applied 3 policies READY=1"


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"nodeagent-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("READY=1\nSTATUS=up") is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"


@pytest.mark.parametrize("value", [None, "", "vsock:2:1234"])
def test_no_usable_socket_returns_false(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.ready() is False


def test_vanished_socket_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.watchdog() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("1500000", "self", 1.5),
        ("30000000", "other", None),  # meant for another process (e.g. our parent)
        ("30000000", "garbage", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    pids = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, pids.get(value, value))
    assert sdnotify.watchdog_interval() == expected


# --- the loop's pings (issue 13, item 2) ------------------------------------------------------

POLICY = """\
version: 1
agent:
  interval: {interval}
  state_file: {state}
tenants:
  research: {{shares: 1}}
"""


def _loop_pings(
    tmp_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> list[tuple[float, bytes]]:
    """Run a dry-run Agent's loop (over an empty directory) for `seconds`, under a watchdog of
    `watchdog` seconds; every datagram it sent, with the time it came."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(interval=kw["interval"], state=tmp_path / "state.json"))
    (tmp_path / "cgroup").mkdir()
    monkeypatch.setenv("WATCHDOG_USEC", str(int(kw["watchdog"] * 1e6)))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    agent = open_agent(load_policy(policy), CgroupTree(str(tmp_path / "cgroup")), dry_run=True)
    if "tick" in kw:
        monkeypatch.setattr(agent, "tick", kw["tick"](agent.tick))
    agent.prepare()
    loop = threading.Thread(target=agent.run)
    got: list[tuple[float, bytes]] = []
    receiver.settimeout(0.1)
    loop.start()
    end = time.monotonic() + kw["seconds"]
    try:
        while time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                got.append((time.monotonic(), receiver.recv(4096)))
    finally:
        agent.stop.set()
        loop.join(timeout=30)
    assert not loop.is_alive(), "the loop did not stop"
    return got


def test_an_interval_longer_than_the_watchdog_does_not_starve_it(
    tmp_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """interval 3 s, WatchdogSec 0.5 s: the pings come every quarter second or so between
    ticks, never a gap of a whole WatchdogSec (the loop used to ping only within WatchdogSec
    of its last tick, then wait out the interval)."""
    got = _loop_pings(tmp_path, receiver, monkeypatch, interval=3, watchdog=0.5, seconds=4.5)
    ready = next(t for t, m in got if m == b"READY=1")
    pings = [t for t, m in got if m == b"WATCHDOG=1" and t >= ready]
    gaps = [b - a for a, b in zip([ready, *pings], pings, strict=False)]
    assert len(pings) >= 10, got
    assert max(gaps) < 0.5, f"a gap of {max(gaps):.2f} s between pings: systemd kills on 0.5 s"


def test_a_tick_slower_than_the_watchdog_does_not_starve_it(
    tmp_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ticks of 1.2 s under WatchdogSec 0.5 s (interval 1 s: healthy for 3 s after a good
    tick): the pings go on through each tick (a busy host's slow tick used to leave a gap of
    the whole tick, and systemd killed the agent)."""

    def slow(tick: Callable[[], object]) -> Callable[[], object]:
        def slow_tick() -> object:
            time.sleep(1.2)  # no wait on anything: a tick this slow is what is tested
            return tick()

        return slow_tick

    got = _loop_pings(
        tmp_path, receiver, monkeypatch, interval=1, watchdog=0.5, seconds=5, tick=slow
    )
    ready = next(t for t, m in got if m == b"READY=1")
    pings = [t for t, m in got if m == b"WATCHDOG=1" and t >= ready]
    gaps = [b - a for a, b in zip([ready, *pings], pings, strict=False)]
    assert len(pings) >= 10, got
    assert max(gaps) < 0.5, f"a gap of {max(gaps):.2f} s between pings: systemd kills on 0.5 s"


def test_a_loop_whose_ticks_keep_failing_lets_the_watchdog_lapse(
    tmp_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ticks fail from the second on: pings go on while the last good tick is younger than
    max(3 intervals, WatchdogSec) = 0.6 s, then stop, so that systemd restarts it."""

    def failing_after_one(tick: Callable[[], object]) -> Callable[[], object]:
        calls = []

        def tick_once() -> object:
            calls.append(1)
            if len(calls) > 1:
                raise OSError("no /proc/stat")
            return tick()

        return tick_once

    got = _loop_pings(
        tmp_path, receiver, monkeypatch, interval=0.2, watchdog=0.4, seconds=3,
        tick=failing_after_one,
    )  # fmt: skip
    ready = next(t for t, m in got if m == b"READY=1")
    pings = [t - ready for t, m in got if m == b"WATCHDOG=1" and t >= ready]
    assert pings, got
    assert max(pings) < 0.6 + 0.1, f"pinged {max(pings):.2f} s after the last good tick"


@pytest.mark.parametrize(
    ("last_ok", "now", "interval", "watchdog", "expected"),
    [
        (None, 5.0, 1.0, 30.0, False),  # no good tick yet: READY=1 has not been sent either
        (0.0, 29.9, 1.0, 30.0, True),  # WatchdogSec is the longer bound
        (0.0, 30.0, 1.0, 30.0, False),
        (0.0, 179.0, 60.0, 30.0, True),  # 3 intervals are
        (0.0, 180.0, 60.0, 30.0, False),
    ],
)
def test_healthy_is_a_good_tick_within_three_intervals_or_the_watchdog(
    last_ok: float | None, now: float, interval: float, watchdog: float, expected: bool
) -> None:
    assert healthy(last_ok, now, interval, watchdog) is expected


def test_the_first_good_tick_logs_agent_ready_once(
    tmp_path: Path, receiver: socket.socket, monkeypatch: pytest.MonkeyPatch, kept_logging: None
) -> None:
    """READY=1 goes to systemd with the first good tick; the same moment is one info line
    in the journal (`agent.ready`: what that tick sensed and wrote, how long it took, and its
    GPUs or why it has none),
    so that an operator, and `scripts/bench overhead`'s restart figure, can see when a
    started daemon has converged the node. Later ticks say nothing at info."""
    logs.configure("info")  # as `nodeagent run` does by default, whatever a test before set
    with structlog.testing.capture_logs() as captured:
        got = _loop_pings(tmp_path, receiver, monkeypatch, interval=0.5, watchdog=30, seconds=2)
    assert [m for _, m in got].count(b"READY=1") == 1
    ready = [e for e in captured if e["event"] == "agent.ready"]
    assert len(ready) == 1, captured
    assert ready[0]["log_level"] == "info"
    assert ready[0]["workloads"] == 0 and ready[0]["writes"] == 0
    assert ready[0]["tick_seconds"] >= 0
    # how many GPUs it found, and why none where none: said once, at start (issue 35)
    assert ("no_gpus" in ready[0]) == (ready[0]["gpus"] == 0), ready[0]
    assert any(m.startswith(b"STATUS=tick 2:") for _, m in got), got  # it went on ticking


def test_a_full_queue_costs_the_loop_a_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor that reads nothing (its datagram queue full) costs a message
    SEND_TIMEOUT_S at most, not the loop's thread for ever (issue 34: every call on the
    loop's thread has a deadline). The supervisor is a real datagram socket, never read."""
    path = str(tmp_path / "notify")
    full = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    full.bind(path)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        for _ in range(100_000):
            filler.sendto(b"x" * 1024, path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    said: list[bool] = []
    sender = threading.Thread(target=lambda: said.append(sdnotify.ready()), daemon=True)
    t0 = time.monotonic()
    sender.start()
    sender.join(10.0)
    took = time.monotonic() - t0
    try:
        assert not sender.is_alive(), f"READY=1 still waiting for room after {took:.1f} s"
        assert said == [False], "not sent: the queue stayed full"
    finally:
        filler.close()
        full.close()
