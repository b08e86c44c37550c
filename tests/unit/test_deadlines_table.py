"""The deadline jobs' table under `nodeagent allocations` (`cli.inspection.deadlines_table`):
each job's status, deadline and predicted finish relative to now, remaining work, the rate
it needs and the rate it is given, its slack; from a real plan, and from hand-made rows for
what a plan rarely shows (a deadline passed, figures unknown, long ids, a narrow terminal).
"""

from __future__ import annotations

import re
from typing import Any

from ticks import A1, DUE, NOW, WITH_DEADLINE, record, state

from nodeagent.api.answers import DeadlineFigures
from nodeagent.cli.inspection import allocations_table, deadlines_table
from nodeagent.report import allocations

HEADERS = ["CGROUP", "STATUS", "DEADLINE", "REMAINING", "NEED", "GIVEN", "SLACK", "FINISH"]
CID = "4f1c2a9be7d3" + "0123456789abcdef" * 3 + "0123"


def row(cgroup: str, **deadline: Any) -> tuple[str, DeadlineFigures]:
    """A job's cgroup and deadline figures as the API serves them: due a minute from NOW
    unless said."""
    figures = {"status": "on-track", "deadline": NOW + 60, "remaining": 0.0, **deadline}
    return cgroup, DeadlineFigures.model_validate(figures)


def cells(text: str) -> list[list[str]]:
    """The table's cells (columns are two spaces apart or more)."""
    return [re.split(r"\s{2,}", line) for line in text.splitlines()]


def test_a_planned_job_shows_its_deadline_work_rates_and_finish() -> None:
    """Due 100 s from now after 60 CPU-s, 20 used: 40 left, 0.40 cores needed; finishing at
    the rate the plan gives it, 40 / rate seconds from now."""
    tick = record([state(A1, 1.0), state(DUE, 0.5, used_s=20.0)], policy=WITH_DEADLINE)
    data = {**allocations(tick), "deadline_misses": 2}  # the daemon adds its count
    (job,) = [a for a in data["allocations"] if a.get("deadline")]
    given = job["deadline"]["rate"]
    shown = allocations_table(data, width=None)
    _, table = shown.split("\n\ndeadline jobs (misses so far: ")
    misses, *lines = table.splitlines()
    assert misses == "2)"
    slack = f"{job['deadline']['slack']:.0f}s"
    expected = [DUE, "on-track", "in 100s", "40.0", "0.40", f"{given:.2f}", slack]
    assert cells("\n".join(lines)) == [HEADERS, [*expected, f"in {40 / given:.0f}s"]]
    assert data["time"] == NOW


def test_past_and_unknown_figures_and_long_ids() -> None:
    late = {"required_rate": 0.65, "rate": 0.1, "slack": -27.4, "predicted_finish": NOW + 32.5}
    rows = [
        row(f"system.slice/docker-{CID}.scope", status="missed", deadline=NOW - 30, remaining=12.5),
        row(
            "nodeagent.slice/late",
            status="predicted-miss",
            deadline=NOW + 5,
            remaining=3.25,
            **late,
        ),
    ]
    assert cells(deadlines_table(rows, NOW)) == [
        HEADERS,
        [f"system.slice/docker-{CID}.scope", "missed", "30s ago", "12.5", "-", "-", "-", "-"],
        [
            "nodeagent.slice/late",
            "predicted-miss",
            "in 5s",
            "3.2",
            "0.65",
            "0.10",
            "-27s",
            "in 32s",
        ],
    ]
    short = deadlines_table(rows, NOW, wide=False)
    assert short.splitlines()[1].startswith(f"system.slice/docker-{CID[:12]}.scope  missed")


def test_a_narrow_terminal_cuts_the_path_keeping_its_end() -> None:
    rows = [row("kubepods.slice/kubepods-burstable.slice/a-very-long-pod-name/its-job")]
    full = deadlines_table(rows, NOW)
    narrow = deadlines_table(rows, NOW, width=80)
    assert max(map(len, narrow.splitlines())) <= 80 < max(map(len, full.splitlines()))
    first, *rest = cells(narrow)[1]
    assert first.startswith("\u2026") and first.endswith("/its-job")
    assert rest == cells(full)[1][1:]
