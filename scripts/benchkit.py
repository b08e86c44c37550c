"""What every `scripts/bench NAME` benchmark shares: its options, --json, the saved figures.

A benchmark is scripts/bench_NAME.py, run as a script. It opens a `Bench` and reports
through it, so that the table and the JSON object can never disagree:

    with Bench("api", __doc__, options) as bench:
        bench.say(f"{ok}/{n} calls succeeded")    # a line of the table
        bench.figures["succeeded"] = ok            # the same figure, for --json

Without --json the table goes to stdout. With --json, stdout gets one JSON object holding
the figures and nothing else; the table goes to stderr, as progress. Either way the table is
saved to OUT/NAME.txt and the object to OUT/NAME.json when --out OUT is given (scripts/bench
gives out/bench). A benchmark that fails saves what it had, with the traceback, and exits
non-zero without printing an object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any


class Bench:
    def __init__(
        self,
        name: str,
        doc: str | None,
        options: Callable[[argparse.ArgumentParser], None] | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        parser = argparse.ArgumentParser(
            prog=f"scripts/bench {name}",
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument(
            "--json",
            action="store_true",
            help="print one JSON object with the figures, and nothing else, on stdout"
            " (the table goes to stderr)",
        )
        parser.add_argument(
            "--out",
            metavar="DIR",
            help=f"also save the table to DIR/{name}.txt, the figures to DIR/{name}.json",
        )
        if options is not None:
            options(parser)
        self.args = parser.parse_args(argv)
        self.name = name
        self.figures: dict[str, Any] = {
            "benchmark": name,
            "kernel": os.uname().release,
            "cpus": os.cpu_count(),
        }
        self._table = sys.stderr if self.args.json else sys.stdout
        self._saved: Path | None = None
        if self.args.out:
            Path(self.args.out).mkdir(parents=True, exist_ok=True)
            self._saved = Path(self.args.out, f"{name}.txt")
            self._saved.write_text("")
            Path(self.args.out, f"{name}.progress").write_text("")

    def say(self, line: str = "") -> None:
        """A line of the table; saved at once, so a crash keeps what was found."""
        print(line, file=self._table, flush=True)
        if self._saved is not None:
            with open(self._saved, "a") as f:
                f.write(line + "\n")

    def progress(self, line: str) -> None:
        """A line for whoever watches a long run, not a figure: on stderr, and with --out in
        OUT/NAME.progress (the VM's output reaches the host only when it exits)."""
        line = f"{time.strftime('%H:%M:%S')} {line}"
        print(line, file=sys.stderr, flush=True)
        if self.args.out:
            with open(Path(self.args.out, f"{self.name}.progress"), "a") as f:
                f.write(line + "\n")

    def __enter__(self) -> Bench:
        self.say(f"kernel {self.figures['kernel']}, {self.figures['cpus']} CPUs")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.say("".join(traceback.format_exception(exc_type, exc, tb)).rstrip())
            return
        text = json.dumps(self.figures, sort_keys=True)
        if self.args.out:
            Path(self.args.out, f"{self.name}.json").write_text(text + "\n")
        if self.args.json:
            print(text, flush=True)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (0 <= q <= 1) of values, None for no values."""
    return quantile(values, q) if values else None


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0 <= q <= 1) of values that cannot be empty (ValueError)."""
    if not values:
        raise ValueError("a quantile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float | None) -> str:
    """A duration for the table: milliseconds, or - for none."""
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def ms_figure(seconds: float | None) -> float | None:
    """A duration for the JSON object: milliseconds to 0.1, or None for none."""
    return None if seconds is None else round(seconds * 1e3, 1)


def populate(
    parent: Path, names: Sequence[str], *, busy: bool = False
) -> list[subprocess.Popen[bytes]]:
    """A cgroup per name under parent, each with one sleeping process so that it is active;
    `busy`: one spinning process instead, the parent's cpu.weight 1 so that the spinners
    take the CPU time others leave and never delay the benchmark's own process (cpu.idle
    would do it too, but a cgroup with cpu.idle=1 reads cpu.weight 0, which the agent
    reports as a level it cannot weigh)."""
    parent.mkdir(exist_ok=True)
    if (parent / "cpu.weight").exists():
        (parent / "cpu.weight").write_text("1" if busy else "100")
    work = 'exec sh -c "while :; do :; done"' if busy else "exec sleep 3600"
    procs = []
    for name in names:
        (parent / name).mkdir()
        enter = f'echo $$ > "$0/cgroup.procs" && {work}'
        procs.append(subprocess.Popen(["sh", "-c", enter, str(parent / name)]))
    for p, name in zip(procs, names, strict=True):
        while str(p.pid) not in (parent / name / "cgroup.procs").read_text().split():
            time.sleep(0.01)
    return procs


def clear(parent: Path, procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill procs and remove every cgroup directly under parent."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
    for d in sorted(parent.iterdir()) if parent.exists() else []:
        if d.is_dir():
            while True:
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)


def wait_for_api(sock: str, agent: subprocess.Popen[bytes], log: Path) -> None:
    """Until the daemon `agent` (its output in `log`) answers on `sock` with a first tick;
    exits the benchmark with the log's tail when it dies or takes over 5 minutes."""
    from nodeagent.api import client  # noqa: PLC0415 - benchkit itself needs no nodeagent
    from nodeagent.errors import NodeagentError  # noqa: PLC0415

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited:\n{log.read_text()[-3000:]}")
        try:
            status = client.get(sock, "/v1/status")
            if isinstance(status, dict) and status.get("tick"):
                return
        except NodeagentError:
            pass
        time.sleep(0.2)
    raise SystemExit("the agent did not answer in time")
