"""The daemon under test, run as an operator runs it, for the reliability benchmarks.

`Agent` is `nodeagent run --config FILE` in a subprocess, its JSON log (debug level, so
every tick is an event) appended to a file that `Log` reads back as events. It also reads
the daemon's RSS and CPU time from /proc. `hold` puts a process in a cgroup. Used by
scripts/bench_churn.py and scripts/bench_crash.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class Log:
    """The daemon's log file as events, read incrementally. A line that is not JSON (a
    traceback on a crash) becomes {"event": "raw", "line": ...}."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[Event] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> list[Event]:
        """The events appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        new = [_event(line) for line in lines if line.strip()]
        self.events += new
        return new


def _event(line: bytes) -> Event:
    try:
        event = json.loads(line)
    except ValueError:
        return {"event": "raw", "line": line.decode("utf-8", "replace")}
    return event if isinstance(event, dict) else {"event": "raw", "line": repr(event)}


class Agent:
    """One `nodeagent run` process at a time; start() again after it exits or is killed."""

    def __init__(self, config: Path, log: Path, *extra: str) -> None:
        self.argv = [sys.executable, "-m", "nodeagent", "run", "--config", str(config)]
        self.argv += ["--log-level", "debug", *extra]
        self.log = Log(log)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.cursor = self._started_cursor = 0
        """Where wait_for looks next, and where this process's events begin."""

    def start(self) -> None:
        self.log.read()
        self.cursor = self._started_cursor = len(self.log.events)
        with open(self.log.path, "ab") as out:
            self.started_at = time.time()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit status if the daemon has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def since_start(self) -> list[Event]:
        """The events this process has logged so far."""
        self.log.read()
        return self.log.events[self._started_cursor :]

    def wait_for(self, match: Callable[[Event], bool], timeout: float = 600) -> Event:
        """The next event, after the last one waited for, that matches; raises if the
        daemon exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            self.log.read()
            events = self.log.events
            for i in range(self.cursor, len(events)):
                if match(events[i]):
                    self.cursor = i + 1
                    return events[i]
            self.cursor = len(events)
            if self.exited() is not None:
                self.log.read()
                tail = "\n".join(json.dumps(e) for e in self.log.events[-20:])
                raise SystemExit(f"the daemon exited ({self.exited()}); its log ends:\n{tail}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not log what was awaited within {timeout}s")
            time.sleep(0.02)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def kill(self) -> float:
        """SIGKILL; returns the wall time of the kill."""
        assert self.proc is not None
        at = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        return at

    def stop(self) -> int:
        """SIGTERM, as systemd stops it; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def rss_kb(self) -> int | None:
        """VmRSS in kB, None once the process is gone."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return None

    def cpu_seconds(self) -> float | None:
        """User plus system CPU time so far, None once the process is gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hold(cgroup: Path) -> int:
    """A `sleep` inside `cgroup`, so that it counts as holding a process; its pid. Spawned,
    then moved in: forking the benchmark's Python costs far more under TCG."""
    pid = os.posix_spawnp("sleep", ["sleep", "3600"], os.environ)
    (cgroup / "cgroup.procs").write_text(str(pid))
    return pid
