"""The daemon under test, run as an operator runs it, for the reliability benchmarks.

`Agent` is `nodeagent run --config FILE` in a subprocess, its JSON log (debug level, so
every tick is an event) appended to a file that `Log` reads back as events. It also reads
the daemon's RSS and CPU time from /proc. `hold` puts a process in a cgroup. `Figures`
gives a benchmark its table and its --json object from the same numbers. Used by
scripts/bench_churn.py and scripts/bench_crash.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
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


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 <= q <= 1), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


class Figures:
    """A benchmark's options (--json, --out DIR) and its output: `say` a line of the table,
    set `figures[key]` for the object. Without --json the table goes to stdout; with it,
    stdout gets the one JSON object and the table goes to stderr. With --out, both are
    saved as DIR/NAME.txt and DIR/NAME.json."""

    def __init__(
        self, name: str, doc: str | None, options: Callable[[argparse.ArgumentParser], None]
    ) -> None:
        parser = argparse.ArgumentParser(
            prog=f"scripts/bench {name}",
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument(
            "--json", action="store_true", help="print one JSON object on stdout, nothing else"
        )
        parser.add_argument("--out", metavar="DIR", help=f"also save DIR/{name}.txt and .json")
        options(parser)
        self.args = parser.parse_args()
        self.name = name
        self.figures: dict[str, Any] = {
            "benchmark": name,
            "kernel": os.uname().release,
            "cpus": os.cpu_count(),
        }
        self._table = sys.stderr if self.args.json else sys.stdout
        self._out = Path(self.args.out) if self.args.out else None
        if self._out is not None:
            self._out.mkdir(parents=True, exist_ok=True)
            (self._out / f"{name}.txt").write_text("")
            (self._out / f"{name}.progress").write_text("")

    def say(self, line: str = "") -> None:
        print(line, file=self._table, flush=True)
        if self._out is not None:
            with open(self._out / f"{self.name}.txt", "a") as f:
                f.write(line + "\n")

    def progress(self, line: str) -> None:
        """A line for whoever watches a long run, not a figure: on stderr, and with --out in
        DIR/NAME.progress (the VM's output reaches the host only when it exits)."""
        line = f"{time.strftime('%H:%M:%S')} {line}"
        print(line, file=sys.stderr, flush=True)
        if self._out is not None:
            with open(self._out / f"{self.name}.progress", "a") as f:
                f.write(line + "\n")

    def done(self) -> None:
        text = json.dumps(self.figures, sort_keys=True)
        if self._out is not None:
            (self._out / f"{self.name}.json").write_text(text + "\n")
        if self.args.json:
            print(text, flush=True)
