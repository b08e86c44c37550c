"""Connection slots counted by who holds them, so that one user's connections cannot crowd
out another's, nor anyone's crowd out root's.

A pool has `size` slots. `reserved` of them only privileged callers (root and the daemon's
own user) may take; every other uid may hold at most `per_uid` at once, and together they
hold at most `size - reserved`. Privileged callers have no cap of their own. The caller
holds the lock: a pool is plain bookkeeping.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class Pool:
    size: int
    reserved: int
    per_uid: int
    _held: Counter[int] = field(default_factory=Counter)
    _privileged: int = 0
    _total: int = 0

    def fits(self, uid: int, privileged: bool) -> bool:
        """Whether `uid` may take a slot now."""
        if self._total >= self.size:
            return False
        if privileged:
            return True
        unprivileged = self._total - self._privileged
        return self._held[uid] < self.per_uid and unprivileged < self.size - self.reserved

    def take(self, uid: int, privileged: bool) -> None:
        self._total += 1
        if privileged:
            self._privileged += 1
        else:
            self._held[uid] += 1

    def give(self, uid: int, privileged: bool) -> None:
        self._total -= 1
        if privileged:
            self._privileged -= 1
        else:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]
