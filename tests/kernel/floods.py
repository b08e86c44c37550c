"""Connection floods from another user, for the real-kernel tests: a forked child takes on the
user's credentials (setuid, no exec: the venv lives under /root, which nobody may enter) and
holds idle connections, opening a new one for every one the daemon closes.

The child writes its figures (a JSON line a second) to a pipe: connections open now, opened
and cut in all, connects that failed (the listen queue full). `Flood.most_open` is the most
it held at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from nodeagent.api import client
from nodeagent.errors import NodeagentError

Target = str | tuple[str, int]
"""A Unix socket's path, or (host, port) over TCP."""
CLI_DEADLINE = 5.0  # client.get's default, which every read command uses


def _hold(target: Target, count: int, stop: int, report: int) -> None:
    family = socket.AF_UNIX if isinstance(target, str) else socket.AF_INET
    selector = selectors.DefaultSelector()
    selector.register(stop, selectors.EVENT_READ)
    held: set[socket.socket] = set()
    figures = {"open": 0, "opened": 0, "cut": 0, "failed": 0}
    last = 0.0
    while True:
        while len(held) < count:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            if sock.connect_ex(target) not in (0, errno.EINPROGRESS):
                sock.close()  # the listen queue is full: again after a pause
                figures["failed"] += 1
                break
            selector.register(sock, selectors.EVENT_READ)
            held.add(sock)
            figures["opened"] += 1
        for key, _ in selector.select(0.2):
            if key.fileobj == stop:
                return
            sock = key.fileobj  # type: ignore[assignment]
            try:
                if sock.recv(4096):
                    continue  # an answer (a refusal): its end comes next
            except OSError:
                pass
            selector.unregister(sock)
            held.discard(sock)
            sock.close()
            figures["cut"] += 1
        now = time.monotonic()
        if now - last >= 1.0:
            figures["open"] = len(held)
            os.write(report, json.dumps(figures).encode() + b"\n")
            last = now


CLOSE_WAIT_S = 30.0
"""How long a flooder has to exit once told to stop, before it is killed."""


class Flood:
    """`count` idle connections to `target` from uid `uid` (gid `uid`, supplementary `groups`),
    kept up until `close()`."""

    def __init__(
        self,
        target: Target,
        count: int,
        uid: int,
        groups: tuple[int, ...] = (),
        directory: str | None = None,
    ) -> None:
        """`directory`: where the child goes, as root, before it takes on `uid`; a Unix
        `target` is then the socket's name in it. The way to a socket under the test systemd's
        own /run: root may walk /proc/PID/root, another uid may not, and a name relative to
        the working directory is looked up from where the child already is."""
        assert isinstance(target, str | tuple), target  # a Path would be taken for TCP
        self.target = target
        self.count = count
        self.latest: dict[str, int] = {}
        self.most_open = 0
        self.error: str | None = None
        stop_r, self._stop = os.pipe()
        report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # child: never return into pytest
            try:
                os.close(self._stop)
                os.close(report_r)
                _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                # room for `count` more than what the fork inherited (pytest's own, by then)
                want = count + 64 + len(os.listdir("/proc/self/fd"))
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
                if directory is not None:
                    os.chdir(directory)
                os.setgroups(list(groups))
                os.setgid(uid)
                os.setuid(uid)
                _hold(target, count, stop_r, report_w)
            except BaseException as exc:  # shown by the parent, in `latest`
                error = {"error": f"{type(exc).__name__}: {exc}"}
                os.write(report_w, json.dumps(error).encode() + b"\n")
            finally:
                os._exit(0)
        os.close(stop_r)
        os.close(report_w)
        self._reader = threading.Thread(target=self._read, args=(report_r,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as reports:
            for line in reports:
                figures = json.loads(line)
                if "error" in figures:
                    self.error = str(figures["error"])
                    return
                self.latest = figures
                self.most_open = max(self.most_open, figures["open"])

    def open_now(self) -> int:
        return self.latest.get("open", 0)

    def opened_all(self) -> bool:
        """Whether it has opened `count` connections, in all; a child that died says why."""
        if self.error is not None:
            raise AssertionError(f"the flood of {self.target!r} stopped: {self.error}")
        return self.latest.get("opened", 0) >= self.count

    def close(self) -> None:
        """Tell the flooder to stop and reap it; one that has not exited within CLOSE_WAIT_S
        is killed: this runs after a test's ceiling too, where a wait without one would hold
        the whole run (the nightly floods test stood 31 minutes past its start, with a 900 s
        ceiling; whether this wait held it is not known)."""
        with contextlib.suppress(OSError):
            os.close(self._stop)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.1)
        self._reader.join(timeout=10)

    def __enter__(self) -> Flood:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass
class Calls:
    """Root's calls: how long each took, and those that failed."""

    seconds: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def call(self, sock: str, path: str) -> object:
        t0 = time.monotonic()
        try:
            answer = client.get(sock, path, timeout=CLI_DEADLINE)
        except NodeagentError as exc:
            self.failed.append(f"{path} after {time.monotonic() - t0:.1f}s: {exc}")
            return None
        self.seconds.append(time.monotonic() - t0)
        return answer

    def figures(self) -> dict[str, float | int]:
        s = sorted(self.seconds) or [0.0]
        return {
            "calls": len(self.seconds) + len(self.failed),
            "failed": len(self.failed),
            "p50_ms": round(statistics.median(s) * 1000, 1),
            "max_ms": round(s[-1] * 1000, 1),
        }
