"""Saving the state file from the loop (nodeagent.state says what is in it and how it is
written): a whole save now and then, a first change journalled at once, never two at once,
and a failure logged once per interval instead of at every tick and every job."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import structlog

from nodeagent import state
from nodeagent.errors import one_line
from nodeagent.policyfile.source import PolicySource

log = structlog.get_logger("nodeagent")

SAVE_INTERVAL = 10.0
"""Seconds between whole saves of the state file (and between two logged failures)."""

Journalled = Sequence[tuple[str, str, Mapping[str, str]]]
"""(cgroup, attribute, original) of each first change since the last look."""


class StateSaver:
    """Writes what `gather(monotonic, wall)` collects to the file the policy in force names
    (a reload may name another)."""

    def __init__(
        self, policy: PolicySource, gather: Callable[[float, float], state.SavedState]
    ) -> None:
        self.policy = policy
        self.gather = gather
        self.saved_at = 0.0
        """When (monotonic) the last save was tried: a failed one counts."""
        self.logged_at = -math.inf
        # one save at a time: a save started later must also be renamed into place later
        # (the loop saves, and so do callers while no loop runs)
        self._lock = threading.Lock()

    def due(self) -> bool:
        return time.monotonic() - self.saved_at >= SAVE_INTERVAL

    def save(self) -> None:
        """Save everything now. Never raises: a failure of any kind is logged, at most once
        per interval (a full disk, or a value the file cannot hold, is not logged at every
        tick and every exec), and retried at the next interval, not at the next tick: the
        attempt counts as the save."""
        with self._lock:
            self._save()

    def journal(self, take: Callable[[], Journalled]) -> None:
        """The first changes `take()` hands over, onto the journal; under the save's lock, so
        that a save from another thread (which holds them all and removes the journal) cannot
        come between the take and the append. A journal that cannot be written: a whole
        save instead (or its one logged failure)."""
        with self._lock:
            fresh = take()
            try:
                state.append_originals(self.file(), fresh)
            except OSError:
                self._save()

    def file(self) -> str:
        return self.policy.spec.agent.state_file

    def _save(self) -> None:
        now = time.monotonic()
        self.saved_at = now
        try:
            state.save(self.file(), self.gather(now, time.time()))
        except Exception as e:  # saving must never take the loop, or an API call, down
            if now - self.logged_at >= SAVE_INTERVAL:
                self.logged_at = now
                log.error("state.save_failed", file=self.file(), error=one_line(e))
        else:
            self.logged_at = -math.inf
