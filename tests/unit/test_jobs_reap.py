"""The loop's job reaper (`Jobs.reap`, issue 33 item 3): a job whose cgroup empties without
its `nodeagent exec` saying so (DELETE /v1/jobs) is ended by the loop: its cgroup removed,
its record gone, its GPU hold returned, once. On the daemon of daemon_api (a plain tree as
the cgroup root, a simulated GPU node: stand-ins); the same on the real kernel, with real
processes, is tests/kernel/test_jobs_reap.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from daemon_api import ALICE, FilesTree, daemon
from daemon_api import Daemon as ApiDaemon

from nodeagent.daemon import open_agent
from nodeagent.jobs import Job

_os_rmdir = os.rmdir


def cgroupfs_rmdir(path: str, *, dir_fd: int | None = None) -> None:
    """os.rmdir as cgroupfs answers it (a stand-in): a cgroup holding only its interface
    files is removed with them; one with a process is EBUSY, one with a child ENOTEMPTY.
    Anything that is not a cgroup (no cgroup.procs) is removed as os.rmdir removes it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        names = os.listdir(fd)
        if "cgroup.procs" in names:
            if Path(f"/proc/self/fd/{fd}/cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
            if any(Path(f"/proc/self/fd/{fd}/{n}").is_dir() for n in names):
                raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)
            for name in names:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    _os_rmdir(path, dir_fd=dir_fd)


@pytest.fixture
def d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ApiDaemon:
    monkeypatch.setattr(os, "rmdir", cgroupfs_rmdir)
    return daemon(tmp_path)


def record_ends(d: ApiDaemon) -> list[str]:
    """The names of the jobs whose end (their GPUs' return) runs from now on, in order."""
    ended: list[str] = []
    inner = d.agent.rec.jobs.on_end

    def on_end(job: Job) -> None:
        ended.append(job.name)
        inner(job)

    d.agent.rec.jobs.on_end = on_end
    return ended


def gpu_job(d: ApiDaemon, name: str, count: int = 1) -> None:
    grant = d.ask(ALICE, name, count)
    assert grant["status"] == "granted", grant
    d.start(ALICE, name, gpu_request=grant["id"])


def cgroup(d: ApiDaemon, name: str) -> Path:
    return d.root / "nodeagent.slice" / name


def test_a_job_whose_process_died_is_reaped_at_the_next_tick(d: ApiDaemon) -> None:
    gpu_job(d, "train", 2)
    ended = record_ends(d)
    d.agent.tick()
    assert (d.jobs(), d.holds(), ended) == (["train"], [("train", "job")], []), "it runs"
    d.exit("train")  # killed; its exec never says so
    d.agent.tick()
    assert d.jobs() == [], "its record is gone"
    assert d.holds() == [], "its GPUs are back in the ledger"
    assert not cgroup(d, "train").exists(), "its cgroup is removed"
    assert ended == ["train"]
    d.agent.tick()
    assert ended == ["train"], "ended once"
    free = d.ask(ALICE, "next", 2)
    assert free["status"] == "granted", "both GPUs can be granted again"


def test_a_job_that_ended_while_the_agent_was_down_is_reaped_at_its_first_tick(
    d: ApiDaemon,
) -> None:
    gpu_job(d, "train")
    (hold,) = d.agent.rec.gpus.ledger.holds()
    d.agent.save_state()  # the agent stops here ...
    d.exit("train")  # ... its job ends meanwhile
    again = open_agent(d.agent.rec.spec, FilesTree(str(d.root)))  # started again: no tick yet
    assert [j.name for j in again.rec.jobs.running()] == ["train"], "restored: its cgroup is there"
    assert [h.id for h in again.rec.gpus.ledger.holds()] == [hold.id], "and its hold"
    after = ApiDaemon(again, d.root, d.proc)
    ended = record_ends(after)
    again.tick()
    assert (after.jobs(), after.holds(), ended) == ([], [], ["train"])
    assert not cgroup(d, "train").exists()
    again.save_state()
    assert open_agent(d.agent.rec.spec, FilesTree(str(d.root))).rec.jobs.running() == [], (
        "forgotten"
    )


def test_a_job_whose_exec_failed_is_reaped_and_holds_nothing(d: ApiDaemon) -> None:
    """Its process exits (127) as soon as the daemon lets it exec, before any tick saw the
    job running: the first tick after its start ends it."""
    gpu_job(d, "typo")
    d.start(ALICE, "plain")
    ended = record_ends(d)
    d.exit("typo")
    d.exit("plain")
    d.agent.tick()
    assert (d.jobs(), d.holds(), sorted(ended)) == ([], [], ["plain", "typo"])
    assert not cgroup(d, "typo").exists() and not cgroup(d, "plain").exists()
    assert d.agent.rec.gpus.ledger.queue() == []


def test_a_job_whose_cgroup_still_holds_a_process_is_not_reaped(d: ApiDaemon) -> None:
    """What its command started still runs (the cgroup is populated): the job stays, with
    its GPUs, whatever the tick saw before."""
    gpu_job(d, "train")
    ended = record_ends(d)
    for _ in range(2):
        d.agent.tick()
    assert (d.jobs(), d.holds(), ended) == (["train"], [("train", "job")], [])
    assert cgroup(d, "train").exists()
