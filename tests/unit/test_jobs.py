"""`nodeagent exec`'s requests as the daemon checks them (the cgroup side runs on the real
kernel in tests/kernel/test_exec.py)."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from daemon_api import ALICE, AlwaysAlive, daemon
from pydantic import ValidationError

from nodeagent.api.bodies import parse, problem
from nodeagent.api.peer import Peer
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.errors import BadRequest, Forbidden, Refused
from nodeagent.jobs import Job, Jobs, Pidfd, StartBody, check_name
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.state import JobRecord

SPEC = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}},
        "jobs": {
            "default_tenant": "research",
            "access": [{"users": [1000], "tenants": ["research"], "classes": ["training"]}],
        },
        "classes": {"training": {"declared_deadlines": "scheduled"}},
    }
)
NOW = 1_800_000_000.0
CALLER = Peer(pid=4000, uid=1000, gid=1000, groups=frozenset())


@pytest.fixture
def jobs(tmp_path: Path) -> Jobs:
    proc = tmp_path / "proc"
    for pid, ppid, uid in ((4001, 4000, 1000), (4002, 1, 1000), (4003, 4000, 0)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "status").write_text(
            f"Name:\tsh\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        )
    jobs = Jobs(CgroupTree(str(tmp_path)), lambda *a: None, str(proc))
    jobs.open_process = lambda pid: AlwaysAlive()
    return jobs


def check(jobs: Jobs, **body: Any) -> Job:
    request = parse(StartBody, {"name": "j", "pid": 4001, **body})
    job, process = jobs._check(request, CALLER, SPEC, NOW)
    process.close()
    return job


def test_a_plain_request_takes_the_policy_defaults(jobs: Jobs) -> None:
    job = check(jobs)
    assert (job.tenant, job.workload_class) == ("research", WorkloadClass.BATCH)
    assert job.cgroup == "nodeagent.slice/j"
    assert job.assignment().rule == "exec:j"


@pytest.mark.parametrize(
    ("body", "error", "message"),
    [
        (
            {"tenant": "reserch"},
            BadRequest,
            "unknown tenant 'reserch'; did you mean 'research'?",
        ),
        (
            {"class": "urgent"},
            BadRequest,
            "^class: unknown class 'urgent' [(]classes: inference,",
        ),
        (
            {"deadline": NOW - 5, "work": 10},
            BadRequest,
            "^the deadline 2027-01-15T07:59:55Z has passed [(]now 2027-01-15T08:00:00Z[)]$",
        ),
        ({"deadline": 1e-300, "work": 10}, BadRequest, "^the deadline 1970-01-01T00:00:00Z has"),
        ({"deadline": 10**401, "work": 10}, BadRequest, "^deadline: must be a number, got 1000"),
        ({"deadline": 1e300, "work": 10}, BadRequest, "^deadline: must be below 253402300800"),
        ({"deadline": NOW + 5}, BadRequest, "a deadline needs the work"),
        ({"deadline": NOW + 5, "work": -1}, BadRequest, "^work: must be above 0, got -1$"),
        ({"deadline": NOW + 5, "work": True}, BadRequest, "^work: must be a number, got True"),
        ({"memory": 4096}, BadRequest, "^memory: must be at least 1048576, got 4096$"),
        ({"cpus": -1}, BadRequest, "^cpus: must be above 0"),
        ({"cpus": 1e300}, BadRequest, "^cpus: must be at most 100000"),
        ({"tenant": ["x"]}, BadRequest, r"^tenant: must be a string, got \['x'\]$"),
        ({"name": "../x"}, BadRequest, "not a safe cgroup name"),
        ({"name": "io.max"}, BadRequest, "not named like a cgroup interface file"),
        ({"name": "x" * 60_000}, BadRequest, "not a safe cgroup name"),
        ({"surprise": 1}, BadRequest, "^unknown field 'surprise'$"),
        ({"pid": 4002}, Forbidden, "not a child of the calling process"),
        ({"pid": 4003}, Forbidden, "not a child of the calling process"),  # another uid's
        ({"pid": 999_999}, Forbidden, "not a child"),
        ({"pid": "4001"}, BadRequest, "^pid: must be a whole number, got '4001'$"),
        ({"pid": 1}, BadRequest, "^pid: must be at least 2, got 1$"),
    ],
)
def test_bad_requests_are_refused_with_one_line(
    jobs: Jobs, body: dict[str, Any], error: type[Refused], message: str
) -> None:
    pattern = message if message.startswith("^") or ".*" in message else re.escape(message)
    with pytest.raises(error, match=pattern) as info:
        check(jobs, **body)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_no_tenant_anywhere_is_refused(jobs: Jobs) -> None:
    bare = SPEC.model_copy(update={"jobs": SPEC.jobs.model_copy(update={"default_tenant": None})})
    with pytest.raises(BadRequest, match="no tenant: pass --tenant"):
        jobs._check(StartBody(name="j", pid=4001), CALLER, bare, NOW)


@pytest.mark.parametrize("name", ["train-1", "a", "x.y_z@1+2", "A" * 63])
def test_safe_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        *["", ".", "..", ".hidden", "-x", "a/b", "a\nb", "A" * 64, "x.slice", "y.service"],
        *["io.max", "cpuset.cpus", "memory.oom.group", "cgroup.procs", "hugetlb.2MB.max"],
    ],
)
def test_unsafe_names(name: str) -> None:
    with pytest.raises(BadRequest):
        check_name(name)


def test_records_round_trip_through_json(jobs: Jobs) -> None:
    job = check(jobs, deadline=NOW + 60, work=30, cpus=2, memory=1 << 30, **{"class": "training"})
    assert Job.from_record(JobRecord.from_json(job.record().to_json())) == job


PREVIOUS = {
    "name": "train", "cgroup": "nodeagent.slice/train", "tenant": "research",
    "workload_class": "training", "uid": 1000, "pid": 4001, "submitted_at": 1.8e9,
    "deadline": 1.9e9, "work": 30.0, "cpus": 2.0, "memory": 1 << 30,
    "gpus": ["GPU-1"], "gpu_hold": "abcdefghijklmnop", "pinned_cpus": [0, 1],
    "pids": 64, "limits_from": {"pids": "jobs.per_user_limits", "cpus": "the request"},
}  # fmt: skip
"""A record as the previous version wrote it, when the record was an API body."""


def test_a_record_the_previous_version_wrote_loads_and_is_written_back_the_same() -> None:
    record = JobRecord.from_json(PREVIOUS)
    job = Job.from_record(record)
    assert job.limits_from == (("cpus", "the request"), ("pids", "jobs.per_user_limits"))
    assert (job.workload_class, job.gpus, job.pinned_cpus) == (
        WorkloadClass.TRAINING,
        ("GPU-1",),
        (0, 1),
    )
    assert job.record().to_json() == PREVIOUS


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"extra": 1}, "unknown field 'extra'"),
        ({"pid": "4001"}, "pid: must be a whole number, got '4001'"),
        ({"pinned_cpus": [0, "1"]}, "pinned_cpus.1: must be a whole number, got '1'"),
        ({"limits_from": {"gpus": "x"}}, "limits_from.gpus.[key]"),
        ({"cpus": math.inf}, "cpus: must be a finite number"),
        ({"name": "x.slice"}, "name: 'x.slice' is not a safe cgroup name"),
    ],
)
def test_a_malformed_record_is_refused_in_one_line(change: dict[str, object], said: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobRecord.from_json({**PREVIOUS, **change})
    assert said in problem(info.value)


def test_a_members_deadline_is_taken_only_where_its_class_takes_declared_ones(jobs: Jobs) -> None:
    """Issue 34 item 9: a deadline is a claim on CPU ahead of every tenant's share, and a
    defended one throttles and freezes lower classes: a caller's word alone gets nothing.
    Refused in batch (`declared_deadlines` defaults to refused); taken in training, which
    jobs.access lets uid 1000 use and whose deadlines the policy schedules, and marked as the
    caller's."""
    with pytest.raises(Forbidden) as info:
        check(jobs, deadline=NOW + 60, work=1000)
    assert str(info.value).startswith("uid 1000")
    assert (
        "may not declare a deadline in class batch: classes.batch.declared_deadlines is refused"
        in str(info.value)
    )
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    job = check(jobs, deadline=NOW + 60, work=1000, **{"class": "training"})
    assert job.assignment().declared == "uid 1000 through nodeagent exec"
    assert check(jobs, **{"class": "training"}).assignment().declared is None, "no deadline"


def test_roots_deadline_is_the_operators_word(jobs: Jobs) -> None:
    root = Peer(pid=4000, uid=0, gid=0, groups=frozenset())
    request = parse(StartBody, {"name": "j", "pid": 4003, "deadline": NOW + 60, "work": 1000})
    job, process = jobs._check(request, root, SPEC, NOW)
    process.close()
    assert job.workload_class is WorkloadClass.BATCH and job.deadline == NOW + 60
    assert job.assignment().declared is None, "defended, as a rule's own deadline"


class EndsDuringTheMove:
    """A pidfd whose process is reaped between the daemon's check and its move (and whose
    pid then names a stranger's process)."""

    def __init__(self) -> None:
        self.asked = 0

    def alive(self) -> bool:
        self.asked += 1
        return self.asked < 3  # alive when checked and just before the write, not after

    def close(self) -> None:
        pass


def test_a_pid_reused_during_the_move_is_not_left_in_the_job(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    (d.root / "cgroup.procs").write_text("")
    d.agent.rec.jobs.open_process = lambda pid: EndsDuringTheMove()
    pid = d.child(ALICE)
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": pid})
    assert isinstance(e, Forbidden) and str(e) == f"process {pid} ended while it was being moved"
    assert d.jobs() == []
    assert (d.root / "cgroup.procs").read_text() == str(pid), "moved out, to the root"


def test_a_pid_that_ends_before_the_move_is_never_written(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    gone = EndsDuringTheMove()
    gone.asked = 1  # alive when checked, gone before the write
    d.agent.rec.jobs.open_process = lambda pid: gone
    e = d.refused(ALICE, "POST", "/v1/jobs", {"name": "j", "pid": d.child(ALICE)})
    assert isinstance(e, Forbidden) and "ended before it could be moved" in str(e)
    assert d.jobs() == []


def test_the_pidfd_is_of_the_real_process(tmp_path: Path) -> None:
    """The stand-ins aside: a real child is alive until reaped, then its pidfd says so."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        process = Pidfd(child.pid)
        assert process.alive()
        child.kill()
        child.wait()
        assert not process.alive()
        process.close()
    finally:
        child.kill()
