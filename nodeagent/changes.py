"""What the loop logs when it changes, not every tick: per-cgroup problems and the
policies' notes.

A cgroup that cannot be read, planned or written is skipped every tick until it is fixed
or gone, and a deadline job is on track tick after tick; logging either every tick would
bury everything else in the journal.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from nodeagent.act import Outcome, WriteResult
from nodeagent.logs import audit_warning
from nodeagent.policy.base import Note
from nodeagent.policy.notes import DeadlineProgress, DeadlineStatus, NoteKind
from nodeagent.policy.plan import Plan
from nodeagent.snapshot import NodeSnapshot

log = structlog.get_logger("nodeagent")

Key = tuple[str, ...]


class ProblemLog:
    def __init__(self) -> None:
        self._open: dict[Key, str] = {}

    def update(self, snapshot: NodeSnapshot, plan: Plan, results: Iterable[WriteResult]) -> None:
        now: dict[Key, tuple[str, dict[str, object]]] = {}
        for s in snapshot.skipped:
            now[("skip", s.path)] = (
                "cgroup.skipped",
                {"cgroup": s.path, "step": s.step, "reason": s.reason},
            )
        for cg in plan.cgroups:
            if cg.skipped is not None:
                now[("skip", cg.path)] = (
                    "cgroup.skipped",
                    {"cgroup": cg.path, "step": "plan", "reason": cg.skipped},
                )
        for problem in plan.problems:
            now[("policy", problem)] = ("policy.failed", {"error": problem})
        for r in results:
            if r.outcome in (Outcome.FAILED, Outcome.UNREACHABLE):
                now[("write", r.path, str(r.attribute))] = (
                    f"cgroup.{r.outcome}",
                    {
                        "cgroup": r.path,
                        "attribute": str(r.attribute),
                        "target": r.new,
                        "detail": r.detail,
                    },
                )
        for key, (event, fields) in now.items():
            text = repr(sorted(fields.items()))
            if self._open.get(key) != text:
                log.warning(event, **fields)
                self._open[key] = text
        for key in [k for k in self._open if k not in now]:
            del self._open[key]
            if key[0] != "policy":
                log.info("cgroup.problem_cleared", cgroup=key[1], was=key[0])


AUDITED = frozenset({NoteKind.GPU_VIOLATION})
"""Notes that are also audit events, at level warning: they must be on record even with
logging turned down, and someone should look."""


class NoteLog:
    """Logs a note when its status changes (a deadline job going from on-track to
    predicted-miss, a class throttled or released), and counts deadline misses."""

    def __init__(self) -> None:
        self._last: dict[tuple[str | None, NoteKind, str], str] = {}
        self.deadline_misses = 0
        self._missed: set[tuple[str | None, object]] = set()
        """Called on the loop's thread alone (a job's end is a command the loop runs); the
        API reads the count from the published view (report.AgentView)."""

    def update(self, notes: Iterable[Note]) -> None:
        seen = set()
        for n in notes:
            key = (n.path, n.kind, n.key)
            seen.add(key)
            if self._last.get(key) != n.status:
                event = f"{n.kind}.{n.status.split(maxsplit=1)[0]}"
                emit = audit_warning if n.kind in AUDITED else log.info
                fields = {**n.fields, "cgroup": n.path, "status": n.status, "message": n.message}
                emit(event, **fields)
                self._last[key] = n.status
            p = n.payload
            if isinstance(p, DeadlineProgress) and p.status is DeadlineStatus.MISSED:
                self.missed(n.path, p.deadline)
        for key in [k for k in self._last if k not in seen]:
            del self._last[key]

    def missed(self, path: str | None, deadline: object) -> None:
        """Count one miss per job and deadline, however many ticks it is seen late."""
        if (path, deadline) not in self._missed:
            self._missed.add((path, deadline))
            self.deadline_misses += 1
