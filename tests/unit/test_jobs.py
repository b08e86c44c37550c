"""`nodeagent exec`'s requests as the daemon checks them (the cgroup side runs on the real
kernel in tests/kernel/test_exec.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeagent.api.peer import Peer
from nodeagent.api.server import ApiBadRequest, ApiError, ApiForbidden
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.jobs import Job, Jobs, check_name
from nodeagent.spec.model import PolicySpec, WorkloadClass

SPEC = PolicySpec.model_validate(
    {
        "version": 1,
        "tenants": {"research": {"shares": 1}, "prod": {"shares": 1}},
        "jobs": {"default_tenant": "research"},
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
    return Jobs(CgroupTree(str(tmp_path)), lambda *a: None, str(proc))


def check(jobs: Jobs, **body: Any) -> Job:
    return jobs._check({"name": "j", "pid": 4001, **body}, CALLER, SPEC, NOW)


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
            ApiBadRequest,
            "unknown tenant 'reserch'; did you mean 'research'?",
        ),
        ({"class": "urgent"}, ApiBadRequest, "unknown class 'urgent'"),
        ({"deadline": NOW - 5, "work": 10}, ApiBadRequest, "5 s in the past"),
        ({"deadline": NOW + 5}, ApiBadRequest, "a deadline needs the work"),
        ({"deadline": NOW + 5, "work": -1}, ApiBadRequest, "work must be positive"),
        ({"deadline": NOW + 5, "work": True}, ApiBadRequest, "work must be a number"),
        ({"memory": 4096}, ApiBadRequest, "below 1Mi"),
        ({"name": "../x"}, ApiBadRequest, "not a safe cgroup name"),
        ({"pid": 4002}, ApiForbidden, "not a child of the calling process"),
        ({"pid": 4003}, ApiForbidden, "not a child of the calling process"),  # another uid's
        ({"pid": 999_999}, ApiForbidden, "not a child"),
        ({"pid": "4001"}, ApiBadRequest, "pid must be a process id"),
    ],
)
def test_bad_requests_are_refused_with_one_line(
    jobs: Jobs, body: dict[str, Any], error: type[ApiError], message: str
) -> None:
    with pytest.raises(error, match=message.replace("?", r"\?").replace("(", r"\(")):
        check(jobs, **body)


def test_no_tenant_anywhere_is_refused(jobs: Jobs) -> None:
    bare = SPEC.model_copy(update={"jobs": SPEC.jobs.model_copy(update={"default_tenant": None})})
    with pytest.raises(ApiBadRequest, match="no tenant: pass --tenant"):
        jobs._check({"name": "j", "pid": 4001}, CALLER, bare, NOW)


@pytest.mark.parametrize("name", ["train-1", "a", "x.y_z@1+2", "A" * 63])
def test_safe_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", ".hidden", "-x", "a/b", "a\nb", "A" * 64, "x.slice", "y.service"]
)
def test_unsafe_names(name: str) -> None:
    with pytest.raises(ApiBadRequest):
        check_name(name)


def test_records_round_trip_through_json(jobs: Jobs) -> None:
    job = check(jobs, deadline=NOW + 60, work=30, cpus=2, memory=1 << 30)
    assert Job.from_json(job.to_json()) == job
