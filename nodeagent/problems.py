"""Per-cgroup problems, logged once when they start or change and once when they clear.

A cgroup that cannot be read, planned or written is skipped every tick until it is fixed
or gone; logging it every tick would bury everything else in the journal.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from nodeagent.act import Outcome, WriteResult
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
