"""A minimal sd_notify(3): systemd's Type=notify readiness and watchdog protocol, stdlib only.

Messages are newline-separated VAR=VALUE assignments in one datagram to $NOTIFY_SOCKET.
Every function returns False instead of raising when there is no systemd to tell, so the
daemon runs the same outside a unit.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

SEND_TIMEOUT_S = 1.0
"""The most one message may wait for room in the supervisor's queue (the loop's thread sends
READY and STOPPING): past it the message is not sent, as when the socket is gone."""


def notify(message: str) -> bool:
    """Send `message` to $NOTIFY_SOCKET; True if sent, False when unset, unsupported or failed.

    Failure is not raised: a daemon must not die because its supervisor's socket went away.
    The caller may log the False.
    """
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    elif not address.startswith("/"):
        return False  # unset, or a transport (e.g. vsock:) we do not speak
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT_S)  # a full queue would block the loop's thread
            sock.sendto(message.encode(), address)
    except OSError:
        return False
    return True


def ready() -> bool:
    """Startup finished: systemd stops waiting and starts units ordered after us."""
    return notify("READY=1")


def watchdog() -> bool:
    """Keep-alive ping; systemd restarts the service when one is missing for WatchdogSec."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """Free-form status line shown by `systemctl status`; newlines would start new fields."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def stopping() -> bool:
    """Shutdown began, so systemd does not mistake a slow stop for a hang."""
    return notify("STOPPING=1")


def watchdog_interval() -> float | None:
    """WatchdogSec in seconds if systemd expects pings from this process, else None.

    Ping at half of it, as sd_watchdog_enabled(3) advises. WATCHDOG_PID, when set, names the
    process the watchdog is meant for; a child that inherited the environment must not ping.
    """
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 1_000_000 if usec > 0 else None


HEALTHY_TICKS = 3
"""The loop is healthy while its last good tick is at most this many intervals old (or one
WatchdogSec, when that is longer): a tick or two may fail or run slow, a loop that keeps
failing or hangs is not."""


def healthy(last_ok: float | None, now: float, interval: float, watchdog_sec: float) -> bool:
    """Whether the loop may tell systemd's watchdog it is alive."""
    return last_ok is not None and now - last_ok < max(HEALTHY_TICKS * interval, watchdog_sec)


class Pinger:
    """Pings the watchdog every half WatchdogSec from a thread of its own, for as long as the
    loop is `healthy`: a tick slower than WatchdogSec does not get the agent killed, and
    neither does a wait between ticks longer than it; a loop that hangs (mid-tick or between
    ticks) or keeps failing stops the pings, and systemd acts one WatchdogSec later. The
    thread only sends datagrams; the loop tells it of each good tick (`beat`)."""

    def __init__(self, watchdog_sec: float, interval: Callable[[], float]) -> None:
        self.watchdog_sec = watchdog_sec
        self._interval = interval  # read at each ping: a reload may change agent.interval
        self._last_ok: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def beat(self) -> None:
        """A good tick just ended; the first starts the pings."""
        self._last_ok = time.monotonic()
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            if healthy(self._last_ok, time.monotonic(), self._interval(), self.watchdog_sec):
                watchdog()
            if self._stop.wait(self.watchdog_sec / 2):
                return
