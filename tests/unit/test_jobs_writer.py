"""One writer (issue 14, item 5): a job's limits are planned by the policy code and written
by the executor, audited and recorded as every other write, before its process moves in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import daemon_api
import pytest
from daemon_api import ALICE, Daemon, daemon
from structlog.testing import capture_logs

from nodeagent.errors import BadRequest
from nodeagent.jobs import Job
from nodeagent.policyfile.model import WorkloadClass
from nodeagent.state import JobRecord

JOB = "nodeagent.slice/j"


def writes(logs: Sequence[Mapping[str, Any]]) -> list[tuple[str, str | None, str, str]]:
    """The audited cgroup writes, in order: (attribute, old, new, reason)."""
    return [
        (e["attribute"], e["old"], e["new"], e["reason"])
        for e in logs
        if e["event"] == "cgroup.write"
    ]


def test_a_jobs_limits_are_executor_writes_audited_and_made_before_it_runs(
    tmp_path: Path,
) -> None:
    d = daemon(tmp_path)
    with capture_logs() as logs:
        d.start(ALICE, "j", cpus=2, memory=1 << 30)
    wrote = writes(logs)
    limits = [w for w in wrote if w[0] in ("cpu.max", "memory.max")]
    assert sorted(limits) == [
        ("cpu.max", "max 100000", "200000 100000", "rule exec:j: cpu_max 2.0 cores"),
        ("memory.max", "max", str(1 << 30), f"rule exec:j: memory_max {1 << 30}"),
    ], "the policy's reasons, as for any workload's write"
    moved = [i for i, w in enumerate(wrote) if w[0] == "cgroup.procs"]
    assert len(moved) == 1 and all(wrote.index(w) < moved[0] for w in limits), "capped first"
    assert (d.root / JOB / "cpu.max").read_text() == "200000 100000"
    assert (d.root / JOB / "memory.max").read_text() == str(1 << 30)
    # the job's own terms, not a change release hands back (a stop leaves jobs running)
    assert not [(p, a) for p, a, _ in d.agent.rec.originals.items() if p == JOB]


def test_a_job_whose_cpu_max_write_fails_is_refused_and_its_cgroup_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = daemon(tmp_path)
    monkeypatch.delitem(daemon_api.FILES, "cpu.max")  # its controller is off: no cpu.max
    rmdir = d.agent.rec.jobs._rmdir

    def kernel_rmdir(job: Job) -> None:  # the kernel's rmdir takes the interface files too
        for f in (d.root / job.cgroup).iterdir():
            f.unlink()
        rmdir(job)

    monkeypatch.setattr(d.agent.rec.jobs, "_rmdir", kernel_rmdir)
    grant = d.ask(ALICE, "j", 1)
    e = d.refused(
        ALICE, "POST", "/v1/jobs", {"name": "j", "pid": d.child(ALICE), "cpus": 1,
                                    "gpu_request": grant["id"]},
    )  # fmt: skip
    assert isinstance(e, BadRequest) and "cpu.max" in str(e), e
    assert not (d.root / JOB).exists(), "its cgroup is removed"
    assert d.jobs() == []
    assert all(kind != "job" for _, kind in d.holds()), "its GPUs went back"


def pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    """A daemon that pins jobs to their GPUs' CPUs, on a tree with the cpuset controller."""
    monkeypatch.setitem(daemon_api.FILES, "cpuset.cpus", "")
    return daemon(tmp_path, {"gpu": {"pin_cpus": True}})


def test_a_pinned_jobs_cpuset_is_the_policys_written_by_the_executor_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = pinned(tmp_path, monkeypatch)
    grant = d.ask(ALICE, "j", 1)
    with capture_logs() as logs:
        d.start(ALICE, "j", gpu_request=grant["id"])
    cpuset = [w for w in writes(logs) if w[0] == "cpuset.cpus"]
    assert len(cpuset) == 1 and cpuset[0][:3] == ("cpuset.cpus", "", "0-3"), cpuset
    assert cpuset[0][3].startswith("rule exec:j: "), "the policy's reason"
    file = d.root / JOB / "cpuset.cpus"
    assert file.read_text() == "0-3"
    file.write_text("7")  # another writer
    d.agent.tick()
    assert file.read_text() == "0-3", "the tick's plan holds the job's CPUs too: repaired"


def test_without_the_cpuset_controller_a_pinned_job_runs_unpinned(tmp_path: Path) -> None:
    d = daemon(tmp_path, {"gpu": {"pin_cpus": True}})
    grant = d.ask(ALICE, "j", 1)
    with capture_logs() as logs:
        d.start(ALICE, "j", gpu_request=grant["id"])
    assert not (d.root / JOB / "cpuset.cpus").exists()
    assert all(w[0] != "cpuset.cpus" for w in writes(logs))
    record = d.agent.tick()
    assert d.jobs() == ["j"]
    assert all(r.attribute != "cpuset.cpus" for r in record.results), "nothing to write"


def test_a_pinned_jobs_cpus_are_kept_in_its_record_and_its_assignment() -> None:
    """Restarted on its state file, the daemon's plan still pins the job; a record written
    before jobs kept their CPUs loads as not pinned."""
    job = Job("j", JOB, "research", WorkloadClass.BATCH, 1000, 4001, 1.8e9, pinned_cpus=(0, 1, 2))
    again = Job.from_record(JobRecord.from_json(job.record().to_json()))
    assert again == job and again.assignment().cpuset == (0, 1, 2)
    old = {k: v for k, v in job.record().to_json().items() if k != "pinned_cpus"}
    assert Job.from_record(JobRecord.from_json(old)).assignment().cpuset == ()
