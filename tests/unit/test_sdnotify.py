"""sd_notify against a real datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent import sdnotify


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
