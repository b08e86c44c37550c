"""Waiting on a condition, never on the clock: the unit suite's one wait.

A sleep that guesses how long something takes passes vacuously on a fast host and fails
for nothing on a loaded one; a wait on the condition itself ends as soon as it holds, and
its ceiling fails the test saying what never came.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def wait_for(check: Callable[[], object], timeout: float, what: str, step: float = 0.02) -> None:
    """Return once `check()` is true; fail naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


def asleep_on(task: str, fd: int) -> bool:
    """Whether the thread /proc/`task` ("PID" for a process's main thread, "self/task/TID"
    for one of this process's) sleeps in a system call whose first argument is descriptor
    `fd`: connect() on a full listen queue, write() on a full pipe. /proc's syscall file
    gives the call's number and arguments while the thread sleeps in one, "running" else;
    so a test sees the block itself rather than guessing how long it takes to come."""
    try:
        fields = Path(f"/proc/{task}/syscall").read_text().split()
    except OSError:  # it has ended
        return False
    return len(fields) > 1 and int(fields[1], 16) == fd


def counted(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> Callable[[], int]:
    """Count the calls of `owner.method` that have returned: e.g. a server's admissions, so
    that a flood test waits until every connection it holds has been taken in."""
    count = [0]
    real = getattr(owner, method)

    def counting(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        finally:
            count[0] += 1

    monkeypatch.setattr(owner, method, counting)
    return lambda: count[0]
