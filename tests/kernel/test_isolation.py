"""One workload never costs the others their tick, on a real kernel.

Each test breaks one cgroup at one step of the tick (vanished after discovery, an
interface file that cannot be read or parsed when sensed or when written) and checks
that every other workload is still planned and written in that same tick.

Unreadable and unparsable files are made with bind mounts over the interface files:
root reads any cgroup file, and the kernel's own files are always well formed, so a
mount is the way to put a write-only file or garbage where the agent expects a number.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, agent, bind, rel, sleeper, spec

from nodeagent.act import Outcome, WriteResult
from nodeagent.cgroupfs.values import Attribute
from nodeagent.report import TickRecord, allocations
from nodeagent.snapshot import NodeSnapshot

CAPPED = {
    "tenants": {"a": {"shares": 1}},
    "rules": [
        {"name": "all", "match": {}, "tenant": "a", "limits": {"cpu_max": 1, "memory_max": "1Gi"}}
    ],
}


def jobs(managed: str, *names: str) -> list[Path]:
    paths = [Path(ROOT, managed, n) for n in names]
    for p in paths:
        p.mkdir()
    return paths


def written(record: TickRecord, name: str) -> set[Attribute]:
    return {
        r.attribute
        for r in record.results
        if r.path.rsplit("/", 1)[1] == name and r.outcome is Outcome.WRITTEN
    }


def test_a_cgroup_removed_between_discovery_and_sensing(
    managed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = agent(spec(managed, tmp_path, **CAPPED))
    _, gone, _ = jobs(managed, "j-1", "j-2", "j-3")
    a.rec.registry.resync()
    real = a.rec.sensor.snapshot

    def remove_then_sense(*args: Any, **kwargs: Any) -> NodeSnapshot:
        gone.rmdir()  # discovered, then gone before it is read
        return real(*args, **kwargs)

    monkeypatch.setattr(a.rec.sensor, "snapshot", remove_then_sense)
    record = a.tick()
    assert record.snapshot.vanished == (rel(gone),)
    assert (
        written(record, "j-1")
        == written(record, "j-3")
        == {
            Attribute.CPU_MAX,
            Attribute.MEMORY_MAX,
        }
    )
    assert Path(ROOT, managed, "j-1", "cpu.max").read_text().strip() == "100000 100000"
    assert rel(gone) not in a.rec.registry.workloads, (
        "the registry forgets what the sensor found gone"
    )


def test_unreadable_and_unparsable_files_skip_only_their_cgroup(
    managed: str, tmp_path: Path, mounts: list[Path]
) -> None:
    a = agent(spec(managed, tmp_path, **CAPPED))
    ok, unreadable, unparsable = jobs(managed, "ok", "unreadable", "unparsable")
    (tmp_path / "garbage").write_text("lots\n")
    # cgroup.kill is write-only: opening it for reading fails with EACCES, even for root
    bind(unreadable / "cgroup.kill", unreadable / "cpu.stat", mounts)
    bind(tmp_path / "garbage", unparsable / "memory.current", mounts)  # int("lots")
    a.rec.registry.resync()

    record = a.tick()
    skipped = {s.path: s.reason for s in record.snapshot.skipped}
    assert set(skipped) == {rel(unreadable), rel(unparsable)}
    assert "cpu.stat" in skipped[rel(unreadable)] and rel(unreadable) in skipped[rel(unreadable)]
    assert "ValueError" in skipped[rel(unparsable)]
    assert written(record, "ok") == {Attribute.CPU_MAX, Attribute.MEMORY_MAX}
    assert (unreadable / "cpu.max").read_text().strip() == "max 100000", "a skipped cgroup"

    rows = {r["cgroup"]: r for r in allocations(record)["allocations"]}
    assert rows[rel(ok)]["status"] == "ok"
    assert rows[rel(unreadable)]["status"] == "skipped"
    assert rows[rel(unparsable)]["status"] == "skipped"
    assert rows[rel(unparsable)]["tenant"] == "a"

    for target in reversed(mounts):  # fixed: the next tick manages them again
        subprocess.run(["umount", str(target)], check=True)
    mounts.clear()
    record = a.tick()
    assert record.snapshot.skipped == ()
    assert written(record, "unreadable") == {Attribute.CPU_MAX, Attribute.MEMORY_MAX}


def test_a_file_that_breaks_at_write_time_fails_that_write_only(
    managed: str, tmp_path: Path, mounts: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    a = agent(spec(managed, tmp_path, **CAPPED))
    _, bad = jobs(managed, "ok", "bad")
    a.rec.registry.resync()
    (tmp_path / "garbage").write_text("lots\n")
    real = a.rec.executor.apply

    def break_then_apply(*args: Any) -> list[WriteResult]:
        # read fine when sensed; the memory guard re-reads memory.current before writing
        bind(tmp_path / "garbage", bad / "memory.current", mounts)
        return real(*args)

    monkeypatch.setattr(a.rec.executor, "apply", break_then_apply)
    record = a.tick()
    outcomes = {(r.path.rsplit("/", 1)[1], r.attribute): r for r in record.results}
    failed = outcomes[("bad", Attribute.MEMORY_MAX)]
    assert failed.outcome is Outcome.FAILED and "ValueError" in failed.detail
    assert outcomes[("bad", Attribute.CPU_MAX)].outcome is Outcome.WRITTEN
    assert written(record, "ok") == {Attribute.CPU_MAX, Attribute.MEMORY_MAX}
    rows = {r["cgroup"]: r for r in allocations(record)["allocations"]}
    assert rows[rel(bad)]["status"] == "failed"


def test_run_once_exits_nonzero_when_its_tick_fails(managed: str, tmp_path: Path) -> None:
    """A /proc without stat: the host checks pass (mountinfo is there), the tick cannot
    measure the node, and `run --once` must say so with its exit status."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(Path("/proc/self/mountinfo").read_text())
    (proc / "self" / "cgroup").write_text(Path("/proc/self/cgroup").read_text())
    config = tmp_path / "policy.yaml"
    config.write_text(
        f"version: 1\nagent: {{managed_root: {managed}, state_file: {tmp_path}/state.json}}\n"
        "tenants: {a: {shares: 1}}\n"
    )
    args = ["nodeagent", "run", "--once", "--config", str(config), "--log-level", "error"]
    failed = subprocess.run(
        [*args, "--proc-root", str(proc)], capture_output=True, text=True, check=False
    )
    assert failed.returncode == 1, failed.stderr
    assert "tick.failed" in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith("nodeagent: error: the tick failed")
    good = subprocess.run(args, capture_output=True, text=True, check=False)
    assert good.returncode == 0, good.stderr


def test_fair_share_goes_on_for_a_tenant_with_a_skipped_cgroup(
    managed: str, tmp_path: Path, mounts: list[Path]
) -> None:
    """Fair share weighs the healthy workloads of a tenant when one of its cgroups is skipped."""
    policy = spec(
        managed,
        tmp_path,
        fair_share={"active_threshold": 0},
        tenants={"a": {"shares": 3}, "b": {"shares": 1}},
        rules=[
            {"name": "a", "match": {"name": "a-*"}, "tenant": "a"},
            {"name": "b", "match": {"name": "b-*"}, "tenant": "b"},
        ],
    )
    a = agent(policy)
    a1, a2, b1 = jobs(managed, "a-1", "a-2", "b-1")
    procs = [sleeper(p) for p in (a1, a2, b1)]
    try:
        (tmp_path / "garbage").write_text("some x\n")
        bind(tmp_path / "garbage", a2 / "cpu.stat", mounts)
        a.rec.registry.resync()
        a.tick()
        # a-2 is skipped: a has one active workload of 3 shares against b's one of 1
        assert (a1 / "cpu.weight").read_text().strip() == "150"
        assert (b1 / "cpu.weight").read_text().strip() == "50"
    finally:
        for p in procs:
            p.kill()
            p.wait()
