"""The agent applies weights, cpu.max and memory limits on a real cgroup v2 kernel."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, agent, hog_memory, read, sleeper, spec, wait_for

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.values import Attribute

MiB = 1 << 20


def _jobs(managed: str, *names: str) -> list[Path]:
    paths = [Path(ROOT, managed, n) for n in names]
    for p in paths:
        p.mkdir()
    return paths


TWO_TENANTS = {
    # every populated cgroup counts as active, so sleeping test processes give stable weights
    "fair_share": {"active_threshold": 0},
    "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
    "rules": [
        {
            "name": "a-jobs",
            "match": {"name": "a-*"},
            "tenant": "a",
            "limits": {"cpu_max": 1.5, "memory_max": "64Mi", "memory_high": "48Mi"},
        },
        {"name": "b-jobs", "match": {"name": "b-*"}, "tenant": "b"},
    ],
}
CAPPED = {
    "tenants": {"a": {"shares": 1}},
    "rules": [{"name": "all", "match": {}, "tenant": "a", "limits": {"cpu_max": 1}}],
}


def test_prepare_enables_controllers_down_to_the_managed_root(managed: str, tmp_path: Path) -> None:
    agent(spec(managed, tmp_path, **TWO_TENANTS))
    control = read(Path(ROOT, managed), "cgroup.subtree_control").split()
    assert {"cpu", "memory"} <= set(control)


def test_weights_cpu_max_and_memory_limits_are_applied(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    a = agent(spec(managed, tmp_path, **TWO_TENANTS))
    a1, b1, b2 = _jobs(managed, "a-1", "b-1", "b-2")
    procs.extend(sleeper(p) for p in (a1, b1, b2))
    a.rec.registry.resync()
    record = a.tick()

    # budget 100 x 3 active = 300; a gets 2/3 on one cgroup, b 1/3 split over two
    assert read(a1, "cpu.weight") == "200"
    assert read(b1, "cpu.weight") == read(b2, "cpu.weight") == "50"
    assert read(a1, "cpu.max") == "150000 100000"
    assert read(a1, "memory.max") == str(64 * MiB)
    assert read(a1, "memory.high") == str(48 * MiB)
    assert read(b1, "cpu.max") == "max 100000"
    assert read(b1, "memory.max") == "max"
    written = {(r.path.rsplit("/", 1)[1], r.attribute) for r in record.results}
    assert (a1.name, Attribute.MEMORY_MAX) in written
    assert all(r.outcome is Outcome.WRITTEN for r in record.results)


def test_an_unchanged_plan_writes_nothing(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    a = agent(spec(managed, tmp_path, **CAPPED))
    jobs = _jobs(managed, "x-1", "x-2")
    procs.extend(sleeper(p) for p in jobs)
    a.rec.registry.resync()
    first = a.tick()
    assert {(r.attribute, r.outcome) for r in first.results} == {
        (Attribute.CPU_MAX, Outcome.WRITTEN)
    }
    again = a.tick()
    assert again.results == (), "a second tick with nothing changed must write nothing"


def test_drift_is_repaired(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Settings are read again at least every resync_interval (a few workloads a tick):
    a change by another writer lasts that long at most, then is repaired."""
    a = agent(spec(managed, tmp_path, agent={"resync_interval": 1}, **TWO_TENANTS))
    (a1,) = _jobs(managed, "a-1")
    procs.append(sleeper(a1))
    a.rec.registry.resync()
    a.tick()
    Path(a1, "cpu.max").write_text("max 100000")
    time.sleep(1.1)  # a resync interval: every workload's turn has come
    record = a.tick()
    assert read(a1, "cpu.max") == "150000 100000"
    repaired = [r for r in record.results if r.attribute is Attribute.CPU_MAX]
    assert [(r.old, r.new) for r in repaired] == [("max 100000", "150000 100000")]


def test_a_cgroup_that_vanishes_mid_tick_does_not_break_the_loop(
    managed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = agent(spec(managed, tmp_path, **CAPPED))
    a1, b1 = _jobs(managed, "a-1", "b-1")
    a.rec.registry.resync()
    real_apply = a.rec.executor.apply

    def apply_after_rmdir(*args: Any) -> list[WriteResult]:
        b1.rmdir()  # gone after it was sensed, before it is written
        return real_apply(*args)

    monkeypatch.setattr(a.rec.executor, "apply", apply_after_rmdir)
    record = a.tick()
    outcomes = {r.path.rsplit("/", 1)[1]: r.outcome for r in record.results}
    assert outcomes["b-1"] is Outcome.VANISHED
    assert outcomes["a-1"] is Outcome.WRITTEN
    monkeypatch.undo()

    a1.rmdir()  # gone between discovery and sensing: dropped silently
    record = a.tick()
    assert record.snapshot.workloads == ()


def test_memory_max_is_never_set_below_usage(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    policy = spec(
        managed,
        tmp_path,
        tenants={"a": {"shares": 1}},
        rules=[
            {
                "name": "tight",
                "match": {"name": "*"},
                "tenant": "a",
                "limits": {"memory_max": "32Mi"},
            }
        ],
    )
    a = agent(policy)
    (job,) = _jobs(managed, "hog")
    hog = hog_memory(job, 64)
    procs.append(hog)
    assert wait_for(lambda: int(read(job, "memory.current")) > 60 * MiB, timeout=60)
    a.rec.registry.resync()

    record = a.tick()
    assert read(job, "memory.max") == "max", "memory.max must not go below usage"
    assert read(job, "memory.high") == str(32 * MiB), "memory.high is lowered first"
    outcome = {r.attribute: r.outcome for r in record.results}
    assert outcome[Attribute.MEMORY_MAX] is Outcome.UNREACHABLE
    assert hog.poll() is None, "the workload must not be OOM-killed by the agent"

    hog.kill()
    hog.wait()
    assert wait_for(lambda: int(read(job, "memory.current")) < 32 * MiB, timeout=30)
    a.tick()
    assert read(job, "memory.max") == str(32 * MiB)
    assert read(job, "memory.high") == "max", "the plan owns memory.high: the lowering is undone"


def test_a_new_cgroup_gets_its_policy_without_waiting_for_the_resync(
    managed: str, tmp_path: Path
) -> None:
    policy = spec(
        managed,
        tmp_path,
        agent={"interval": 3600, "resync_interval": 3600},
        tenants={"a": {"shares": 1}},
        rules=[{"name": "cap", "match": {"name": "*"}, "tenant": "a", "limits": {"cpu_max": 0.5}}],
    )
    a = agent(policy)
    loop = threading.Thread(target=a.run, daemon=True)
    loop.start()
    try:
        assert wait_for(lambda: a.rec.last is not None, timeout=30)
        new = Path(ROOT, managed, "late-arrival")
        new.mkdir()
        assert wait_for(lambda: read(new, "cpu.max") == "50000 100000", timeout=10), (
            "inotify must trigger a tick: neither the interval nor the resync is due for an hour"
        )
    finally:
        a.stop.set()
        loop.join(timeout=10)
    assert not loop.is_alive()
