"""A cgroup skipped tick after tick is logged once when it starts, once when it clears."""

from __future__ import annotations

from builders import job, plan_claimed, snapshot, spec, workload
from structlog.testing import capture_logs

from nodeagent.changes import ProblemLog
from nodeagent.snapshot import Skipped


def test_each_problem_is_logged_once_until_it_changes_or_clears() -> None:
    policy = spec({"a": 1})
    bad = Skipped(job("nodeagent.slice/a-2"), "sense", "cgroup a-2: cannot read cpu.stat")
    broken = snapshot([workload("nodeagent.slice/a-1")])
    broken = broken.__class__(
        **{**{f: getattr(broken, f) for f in broken.__slots__}, "skipped": (bad,)}
    )
    healthy = snapshot([workload("nodeagent.slice/a-1")])
    problems = ProblemLog()
    with capture_logs() as logs:
        for _ in range(3):
            problems.update(broken, plan_claimed(broken, policy, {}), ())
        problems.update(healthy, plan_claimed(healthy, policy, {}), ())
    assert [(e["event"], e["cgroup"]) for e in logs] == [
        ("cgroup.skipped", "nodeagent.slice/a-2"),
        ("cgroup.problem_cleared", "nodeagent.slice/a-2"),
    ]
    assert logs[0]["reason"] == "cgroup a-2: cannot read cpu.stat"
    assert logs[0]["step"] == "sense"


def test_every_note_kind_logs_and_violations_go_to_the_audit_stream() -> None:
    """A note's figures are logged beside its own cgroup (a GPU violation names the
    process's)."""
    from nodeagent.changes import NoteLog
    from nodeagent.policy.base import Note
    from nodeagent.policy.notes import GpuViolation, ViolationKind

    found = GpuViolation(ViolationKind.UNASSIGNED, 7, "GPU-a", "x.slice/y", None)
    note = Note(None, "gpu-checks", "unassigned", "pid 7 on GPU-a", found, "7@")
    log = NoteLog()
    with capture_logs() as logs:
        log.update([note])
        log.update([note])
    assert [e["event"] for e in logs] == ["gpu-violation.unassigned"]
    assert logs[0]["process_cgroup"] == "x.slice/y"
    assert logs[0]["cgroup"] is None
