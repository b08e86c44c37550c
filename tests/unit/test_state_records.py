"""The state file's job and hold records, and the clocks of GPU timeouts (issue 12, items
13-15): every record is checked one by one as the API checks a request, a bad one is dropped
with a warning and the rest kept; saving never raises; a step of the wall clock lapses
nothing."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from daemon_api import ALICE, ROOT, Daemon, daemon, restart

from nodeagent import state


@pytest.fixture
def d(tmp_path: Path) -> Daemon:
    return daemon(tmp_path)


def write_state(d: Daemon, jobs: list[Any] = (), gpus: list[Any] = ()) -> None:  # type: ignore[assignment]
    path = d.agent.rec.spec.agent.state_file
    body = {"version": 1, "saved_at": time.time(), "tenant_usage": {}, "jobs": jobs, "gpus": gpus}
    Path(path).write_text(json.dumps(body))


def events(logs: Iterable[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


GOOD_HOLD = {
    "owner": "web",
    "kind": "reservation",
    "uuids": ["GPU-11111111-1111-1111-1111-111111111111"],
    "indices": [1],
    "until": 2e9,
    "id": "abcdefghijklmnop",
    "uid": 1000,
}


@pytest.mark.parametrize(
    "bad",
    [
        {"owner": "x"},
        {**GOOD_HOLD, "kind": "mystery"},
        {**GOOD_HOLD, "indices": ["one"]},
        {**GOOD_HOLD, "until": math.nan},
        {**GOOD_HOLD, "until": math.inf},
        {**GOOD_HOLD, "owner": "x" * 60_000},
        {**GOOD_HOLD, "uid": -1},
        {**GOOD_HOLD, "cgroup": "../../etc"},
        "not a record",
    ],
)
def test_a_malformed_hold_is_dropped_and_the_rest_kept(d: Daemon, bad: Any) -> None:
    write_state(d, gpus=[bad, GOOD_HOLD])
    with structlog.testing.capture_logs() as logs:
        again = restart(d)
    assert again.holds() == [("web", "reservation")]
    assert len(events(logs, "state.hold_dropped")) == 1


GOOD_JOB = {
    "name": "j",
    "cgroup": "nodeagent.slice/j",
    "tenant": "research",
    "workload_class": "batch",
    "uid": 1000,
    "pid": 4001,
    "submitted_at": 1.7e9,
}


@pytest.mark.parametrize(
    "fields",
    [
        {"cpus": -1},
        {"cpus": math.nan},
        {"cpus": 1e300},
        {"memory": -5},
        {"deadline": math.inf, "work": 10},
        {"deadline": math.nan, "work": 10},
        {"work": -1, "deadline": 2e9},
        {"pid": 0},
        {"submitted_at": "yesterday"},
        {"tenant": ["research"]},
    ],
)
def test_a_job_record_out_of_range_is_dropped_and_ticks_go_on(
    d: Daemon, fields: dict[str, Any]
) -> None:
    for name in ("j", "k"):
        d.agent.rec.tree.mkdir(f"nodeagent.slice/{name}")
        (d.root / "nodeagent.slice" / name / "cgroup.procs").write_text("4001")
    other = {**GOOD_JOB, "name": "k", "cgroup": "nodeagent.slice/k"}
    write_state(d, jobs=[{**GOOD_JOB, **fields}, other])
    with structlog.testing.capture_logs() as logs:
        again = restart(d)
        again.agent.tick()
        again.agent.save_state()
    assert again.jobs() == ["k"]
    assert len(events(logs, "state.job_dropped")) == 1
    assert not events(logs, "tick.failed") and not events(logs, "state.save_failed")
    saved = json.loads(Path(d.agent.rec.spec.agent.state_file).read_text())
    assert [j["name"] for j in saved["jobs"]] == ["k"]


def test_saving_never_raises_and_says_so_once_per_interval(d: Daemon, monkeypatch: Any) -> None:
    d.start(ALICE, "j")
    bad = [{**d.agent.rec.jobs.dump()[0], "deadline": math.nan}]  # a value the file cannot hold
    monkeypatch.setattr(d.agent.rec.jobs, "dump", lambda: bad)
    with structlog.testing.capture_logs() as logs:
        d.agent.save_state()
        d.agent.save_state()
        d.start(ALICE, "k")  # an exec answered, not a 500, whatever the save did
    assert [e["event"] for e in logs if e["event"].startswith("state.")] == ["state.save_failed"]

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(state, "save", broken)
    d.agent.rec.saver.logged_at = -math.inf
    with structlog.testing.capture_logs() as logs:
        d.agent.save_state()
    assert events(logs, "state.save_failed")[0]["error"] == "RuntimeError: a bug"


def test_a_jobs_hold_survives_a_restart_and_goes_with_its_job(d: Daemon) -> None:
    grant = d.ask(ALICE, "train")
    job = d.start(ALICE, "train", gpu_request=grant["id"])
    again = restart(d)
    assert again.holds() == [("train", "job")]
    (hold,) = again.agent.rec.gpus.ledger.holds()
    assert hold.id == job["gpu_hold"] and hold.uid == 1000
    again.exit("train")
    again.call(ALICE, "DELETE", "/v1/jobs", {"name": "train", "exit_status": 0})
    assert again.holds() == []


def test_a_file_from_before_hold_ids_keeps_its_holds(d: Daemon) -> None:
    d.agent.rec.tree.mkdir("nodeagent.slice/train")
    (d.root / "nodeagent.slice" / "train" / "cgroup.procs").write_text("4001")
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    job = {**GOOD_JOB, "name": "train", "cgroup": "nodeagent.slice/train", "gpus": [uuid]}
    old = {"owner": "train", "kind": "job", "uuids": [uuid], "indices": [0],
           "cgroup": "nodeagent.slice/train", "workload_class": "batch", "cpus": [0]}  # fmt: skip
    reservation = {k: v for k, v in GOOD_HOLD.items() if k not in ("id", "uid")}
    write_state(d, jobs=[job], gpus=[old, reservation])
    again = restart(d)
    assert again.holds() == [("train", "job"), ("web", "reservation")]
    owners = {h.owner: h.uid for h in again.agent.rec.gpus.ledger.holds()}
    assert owners == {"train": 1000, "web": 0}, "the job's uid; a reservation root's alone"
    again.exit("train")
    again.call(ALICE, "DELETE", "/v1/jobs", {"name": "train", "exit_status": 0})
    assert again.holds() == [("web", "reservation")]


def test_a_step_of_the_wall_clock_lapses_no_grant_and_drops_no_waiter(
    d: Daemon, monkeypatch: Any
) -> None:
    granted = d.ask(ROOT, "first", 2)
    waiting = d.ask(ROOT, "second", 1)
    assert (granted["status"], waiting["status"]) == ("granted", "waiting")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 601)
    d.agent.tick()
    assert d.call(ROOT, "GET", "/v1/gpus/requests", query={"id": granted["id"]})["status"] == (
        "granted"
    )
    assert d.call(ROOT, "GET", "/v1/gpus/requests", query={"id": waiting["id"]})["status"] == (
        "waiting"
    )
    assert d.holds() == [("first", "request")]


def test_a_hold_s_expected_end_and_the_classes_hold_durations_survive_restarts(
    tmp_path: Path,
) -> None:
    """Issue 18.7: what placement is told of durations is not lost on a restart."""
    d = daemon(tmp_path, {"classes": {"batch": {"declared_deadlines": "scheduled"}}})
    grant = d.ask(ALICE, "train", deadline=time.time() + 3600, work=1800, cpus=2)
    d.start(ALICE, "train", gpu_request=grant["id"])
    again = restart(d)
    (hold,) = again.agent.rec.gpus.ledger.holds()
    assert hold.since is not None and hold.expected_end is not None
    assert hold.expected_end - hold.since == pytest.approx(900.0, abs=1.0)
    again.exit("train")
    again.call(ALICE, "DELETE", "/v1/jobs", {"name": "train", "exit_status": 0})
    history = again.agent.rec.gpus.ledger.history()
    assert list(history) == [hold.workload_class] and len(history[str(hold.workload_class)]) == 1
    again.agent.save_state()
    assert restart(again).agent.rec.gpus.ledger.history() == history
