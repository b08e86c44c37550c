"""Signals at a running loop (issue 12, items 11 and 12): a burst of SIGHUPs, and a SIGTERM that
lands while the loop is inside the logger, must neither hang the daemon nor cost it its stop.

Each test runs a real Agent loop (dry-run, over an empty directory standing in for the cgroup
root) in a child process with the daemon's own signal handlers, as `nodeagent run` installs
them, and signals it from here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from waits import asleep_on, wait_for

EXIT_WITHIN_S = 60.0  # generous: the machine is shared; a deadlocked child never exits at all

CHILD = r"""
import sys, structlog
from nodeagent import logs
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import Agent, open_agent
from nodeagent.policyfile.load import load_policy

policy, root, pad = sys.argv[1], sys.argv[2], int(sys.argv[3])
logs.configure("info", fmt="json")
log = structlog.get_logger("nodeagent.test")
agent = open_agent(load_policy(policy), CgroupTree(root), dry_run=True, config_path=policy)
agent.install_signal_handlers()
agent.prepare()

def on_tick(record):
    print("tick", record.snapshot.seq, flush=True)
    if pad:
        log.info("filler", pad="x" * pad)  # fills a stderr nobody reads: print blocks in the lock

ok = agent.run(on_tick=on_tick)
print("exited", flush=True)
"""

POLICY = """\
version: 1
agent:
  interval: 0.05
  state_file: {state}
tenants:
  research: {{shares: 1}}
"""


class Child:
    """The loop in a child process; its stdout lines ("tick N") collected as they come."""

    def __init__(self, tmp_path: Path, pad: int = 0) -> None:
        policy = tmp_path / "policy.yaml"
        policy.write_text(POLICY.format(state=tmp_path / "state.json"))
        root = tmp_path / "cgroup"
        root.mkdir()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(policy), str(root), str(pad)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self.readers: list[threading.Thread] = []
        assert self.proc.stdout is not None
        self._read(self.proc.stdout, self.lines)

    def _read(self, stream: object, into: list[str]) -> None:
        reader = threading.Thread(target=self._collect, args=(stream, into), daemon=True)
        reader.start()
        self.readers.append(reader)

    @staticmethod
    def _collect(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.strip())

    def drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        self._read(self.proc.stderr, self.stderr)

    def ticks(self) -> int:
        return sum(1 for line in self.lines if line.startswith("tick "))

    def running(self) -> bool:
        assert self.proc.poll() is None, f"the loop exited early: {self.lines[-3:]}"
        return True

    def wait_for_ticks(self, n: int, timeout: float = 60.0) -> None:
        wait_for(lambda: self.running() and self.ticks() >= n, timeout, f"tick {n}")

    def blocked_writing_stderr(self, timeout: float = 60.0) -> None:
        """Wait until the loop (the child's main thread) sleeps in write() on its stderr, a
        full pipe nobody reads: inside the logger, its lock held."""
        what = "the loop to block writing to its full stderr"
        wait_for(lambda: self.running() and asleep_on(str(self.proc.pid), 2), timeout, what)

    def pending(self, signum: signal.Signals) -> bool:
        """Whether `signum` was sent to the child and not yet delivered (/proc's masks of
        the signals pending for its main thread, SigPnd, and for the process, ShdPnd)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        masks = [int(line.split()[1], 16) for line in status if line[:7] in ("SigPnd:", "ShdPnd:")]
        return any(mask & 1 << (signum - 1) for mask in masks)

    def exits_within(self, seconds: float) -> int:
        """Its exit status, once what it wrote has been read to the end (the readers can
        lag behind its exit on a busy host: a last line not yet read is not a lost one)."""
        try:
            status = self.proc.wait(timeout=seconds)
            for reader in self.readers:
                reader.join(timeout=seconds)
            return status
        except subprocess.TimeoutExpired:
            stack = Path(f"/proc/{self.proc.pid}/wchan")
            where = stack.read_text() if stack.exists() else "?"
            raise AssertionError(
                f"the daemon did not exit {seconds:.0f} s after SIGTERM (blocked in {where};"
                f" {self.ticks()} ticks, last lines {self.lines[-2:]})"
            ) from None


@pytest.fixture
def child_factory(tmp_path: Path) -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for c in made:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


def test_a_burst_of_sighups_neither_hangs_the_loop_nor_costs_it_its_sigterm(
    tmp_path: Path, child_factory: list[Child]
) -> None:
    """50 SIGHUPs at a time, 300 times, at a loop ticking every 50 ms: it keeps ticking, and
    SIGTERM then stops it (a handler that takes a lock deadlocked here within 100-300 bursts)."""
    child = Child(tmp_path)
    child_factory.append(child)
    child.wait_for_ticks(3)
    for _ in range(300):
        for _ in range(50):
            os.kill(child.proc.pid, signal.SIGHUP)
        time.sleep(0.002)  # no wait on anything: bursts 2 ms apart are what is tested
    before = child.ticks()
    child.wait_for_ticks(before + 3)  # still ticking after the bursts
    child.drain_stderr()
    os.kill(child.proc.pid, signal.SIGTERM)
    assert child.exits_within(EXIT_WITHIN_S) == 0
    assert child.lines[-1] == "exited"
    assert any('"event": "policy.reloaded"' in line for line in child.stderr)
    assert any('"event": "stopping"' in line and "SIGTERM" in line for line in child.stderr)


def test_sigterm_while_the_loop_holds_the_loggers_lock_still_stops_it(
    tmp_path: Path, child_factory: list[Child]
) -> None:
    """The loop blocks in print(), inside structlog's lock, on a stderr nobody reads; SIGTERM
    comes then. Once stderr is read again it must stop (a handler that logs waited for that
    same lock, in the same thread, for good)."""
    child = Child(tmp_path, pad=8000)
    child_factory.append(child)
    child.wait_for_ticks(1)
    child.blocked_writing_stderr()  # the logger's lock held
    os.kill(child.proc.pid, signal.SIGTERM)
    # delivered while the write waits: the write returns to the loop (EINTR, or the part
    # written), which runs the handler there, inside the lock, whenever stderr is read
    wait_for(lambda: not child.pending(signal.SIGTERM), 30, "SIGTERM to reach the loop")
    child.drain_stderr()
    assert child.exits_within(EXIT_WITHIN_S) == 0
    assert child.lines[-1] == "exited"
    stopping = [line for line in child.stderr if '"event": "stopping"' in line]
    assert len(stopping) == 1 and '"signal": "SIGTERM"' in stopping[0]
