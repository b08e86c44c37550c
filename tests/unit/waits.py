"""Waiting on a condition, never on the clock: the unit suite's one wait.

A sleep that guesses how long something takes passes vacuously on a fast host and fails
for nothing on a loaded one; a wait on the condition itself ends as soon as it holds, and
its ceiling fails the test saying what never came.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(check: Callable[[], object], timeout: float, what: str, step: float = 0.02) -> None:
    """Return once `check()` is true; fail naming `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)
