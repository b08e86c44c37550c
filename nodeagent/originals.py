"""What each cgroup attribute held before nodeagent first changed it, for `nodeagent release`.

tuned's way ("old value recorded"): the first write the agent makes to an attribute records
the value it found; later writes only update what it set; a write back to the original drops
the record (nothing is left to hand back). The record is kept in the state file, so that a
restarted agent adds to it and `nodeagent release` can hand everything back when the agent
is stopped for good: the original value, and only where the attribute still holds what the
agent set (a value someone changed since is theirs). Also kept: how the agent wrote it
(directly, or through systemd), so that release writes it the same way without the policy.

A job's own limits (the executor writes them when `nodeagent exec` starts it) are not
recorded: they are the job's terms, not a change to a workload the agent found. What the
loop wrote over them later (a throttle, a freeze) is, with the job's own limit as its original.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Any

import structlog

from nodeagent.cgroupfs.values import Attribute
from nodeagent.ownership import WriteMode

log = structlog.get_logger("nodeagent")

MAX_VALUE_CHARS = 64  # "max 100000", a byte count: anything longer is not a value we wrote


@dataclass(frozen=True, slots=True)
class Original:
    was: str
    """What the attribute held before the agent's first write."""
    set: str
    """What the agent wrote last."""
    via: WriteMode
    """DIRECT or SYSTEMD: how release must write it back."""

    def to_json(self) -> dict[str, str]:
        return {"was": self.was, "set": self.set, "via": str(self.via)}


class Originals:
    """cgroup path -> attribute -> Original. Touched by the loop's thread alone: it notes its
    writes, hands values back, and dumps it at each save (a job's start, which saves at once,
    is a command the loop runs), so it has no lock."""

    def __init__(self) -> None:
        self._by_path: dict[str, dict[Attribute, Original]] = {}
        self._fresh: list[tuple[str, Attribute, Original]] = []
        """First records since the last dump or `take_fresh`: the journal's next lines."""

    def note(
        self, path: str, attribute: Attribute, old: str | None, new: str, via: WriteMode
    ) -> None:
        """One write the agent made (old: what it found there, None when unknown)."""
        if via is WriteMode.READ_ONLY:
            return
        mine = self._by_path.get(path, {})
        known = mine.get(attribute)
        if known is None:
            if old is not None and old != new:
                original = Original(old, new, via)
                self._by_path[path] = {**mine, attribute: original}
                self._fresh.append((path, attribute, original))
        elif new == known.was:
            self.drop(path, attribute)  # handed back by the agent itself
        else:
            mine[attribute] = Original(known.was, new, via)

    def forget(self, paths: Iterable[str]) -> None:
        """Cgroups that are gone: nothing of theirs can be handed back."""
        for path in paths:
            self._by_path.pop(path, None)

    def forget_below(self, roots: Iterable[str]) -> None:
        """Cgroups removed with everything below them (a pod's directory takes its
        containers): nothing of theirs can be handed back, and a busy node's churn must not
        grow the record, nor the state file that saves it, without end. Kept: what was set
        on a service through systemd, which holds the unit's properties across the restarts
        that remove and make its cgroup again (a scope or a slice ends with its cgroup)."""
        gone = set(roots)
        if not gone:
            return
        for path in [p for p in self._by_path if _below(p, gone)]:
            kept = {
                a: o
                for a, o in self._by_path[path].items()
                if o.via is WriteMode.SYSTEMD and path.endswith(".service")
            }
            if kept:
                self._by_path[path] = kept
            else:
                del self._by_path[path]

    def items(self, among: Set[str] | None = None) -> list[tuple[str, Attribute, Original]]:
        """Every record, by path; `among`: those of these paths only (a lookup per path the
        agent holds records of, not a sort of all of them: the loop asks every tick)."""
        paths = sorted(self._by_path if among is None else self._by_path.keys() & among)
        return [(p, a, o) for p in paths for a, o in self._by_path[p].items()]

    def drop(self, path: str, attribute: Attribute) -> None:
        mine = self._by_path.get(path, {})
        mine.pop(attribute, None)
        if not mine:
            self._by_path.pop(path, None)

    def __len__(self) -> int:
        return sum(len(a) for a in self._by_path.values())

    def take_fresh(self) -> list[tuple[str, Attribute, Original]]:
        """The first records noted since the last dump or take, for the state's journal."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def dump(self) -> dict[str, dict[str, dict[str, str]]]:
        """Made anew at each save (every 10 s): 0.2 us an original, where keeping the last
        dump cost about 1 MB at 1,000 workloads."""
        self._fresh = []  # the dump holds them: the save that follows clears the journal
        return {
            path: {str(a): o.to_json() for a, o in attrs.items()}
            for path, attrs in sorted(self._by_path.items())
        }

    @classmethod
    def load(cls, raw: Mapping[str, Any]) -> Originals:
        """From the state file; a malformed entry is dropped with a warning, one by one."""
        out = cls()
        for path, attrs in raw.items():
            if not isinstance(attrs, Mapping):
                log.warning("state.original_dropped", cgroup=str(path)[:200], error="not an object")
                continue
            for name, entry in attrs.items():
                try:
                    attribute = Attribute(name)
                    was, set_, via = entry["was"], entry["set"], WriteMode(entry["via"])
                    if via is WriteMode.READ_ONLY:
                        raise ValueError("a read-only cgroup is never written")
                    if not all(
                        isinstance(v, str) and 0 < len(v) <= MAX_VALUE_CHARS for v in (was, set_)
                    ):
                        raise ValueError("values must be short strings")
                except (KeyError, TypeError, ValueError) as e:
                    log.warning(
                        "state.original_dropped",
                        cgroup=str(path)[:200],
                        attribute=str(name)[:40],
                        error=str(e)[:200],
                    )
                    continue
                out._by_path.setdefault(str(path), {})[attribute] = Original(was, set_, via)
        return out


def _below(path: str, roots: set[str]) -> bool:
    """Whether `path` is one of `roots` or below one."""
    while path:
        if path in roots:
            return True
        path = path.rpartition("/")[0]
    return False
