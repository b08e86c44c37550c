"""A cgroup with cpu.idle set (what systemd's CPUWeight=idle writes), on the real kernel: it
reads cpu.weight 0 and refuses another weight with EINVAL. The agent manages its memory and
cpu.max as any workload's, and leaves its idleness and its weight alone."""

from __future__ import annotations

import errno
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT, agent, read, rel, sleeper, spec

from nodeagent.act import IDLE, Outcome
from nodeagent.cgroupfs.values import Attribute
from nodeagent.snapshot import CgroupSample

MiB = 1 << 20
LIMITS = {"cpu_max": 0.5, "memory_max": "64Mi"}
POLICY = {  # every populated cgroup counts as active: sleepers get stable weights
    "fair_share": {"active_threshold": 0},
    "tenants": {"hi": {"shares": 3}, "lo": {"shares": 1}},
    "rules": [
        {"name": "hi", "match": {"name": "hi-*"}, "tenant": "hi", "limits": LIMITS},
        {"name": "lo", "match": {"name": "lo-*"}, "tenant": "lo", "limits": LIMITS},
    ],
}


def test_the_kernel_shows_an_idle_group_weight_0_and_refuses_another(
    cgroup_sandbox: Path,
) -> None:
    w = cgroup_sandbox / "w"
    w.mkdir()
    (w / "cpu.idle").write_text("1")
    assert read(w, "cpu.weight") == "0"
    with pytest.raises(OSError) as refused:
        (w / "cpu.weight").write_text("100")
    assert refused.value.errno == errno.EINVAL


def test_an_idle_workload_gets_its_limits_and_keeps_its_idleness(
    managed: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    a = agent(spec(managed, tmp_path, **POLICY))
    idle, other, hi = (Path(ROOT, managed, n) for n in ("lo-idle", "lo-1", "hi-1"))
    for p in (idle, other, hi):
        p.mkdir()
        procs.append(sleeper(p))
    (idle / "cpu.idle").write_text("1")
    a.rec.registry.resync()
    record = a.tick()
    assert not record.snapshot.skipped, record.snapshot.skipped
    assert read(idle, "memory.max") == str(64 * MiB)
    assert read(idle, "cpu.max") == "50000 100000"
    assert read(idle, "cpu.idle") == "1" and read(idle, "cpu.weight") == "0"
    assert read(other, "memory.max") == str(64 * MiB)
    assert read(hi, "cpu.weight") != "100" and read(other, "cpu.weight") != "100"
    assert not [r for r in record.results if r.outcome is Outcome.FAILED], record.results
    plan = {cg.path: cg for cg in record.plan.cgroups}
    assert Attribute.CPU_WEIGHT not in plan[f"{managed}/lo-idle"].targets
    assert any("cpu.idle is set" in line for line in plan[f"{managed}/lo-idle"].trace)

    # the fast path plans a newcomer's weight from nothing read: the executor's read sees idle
    (hi / "cpu.idle").write_text("1")
    unread = replace(
        record.snapshot,
        workloads=tuple(replace(w, sample=CgroupSample()) for w in record.snapshot.workloads),
    )
    results = a.rec.executor.apply(record.plan, unread)
    (weight,) = [r for r in results if r.attribute is Attribute.CPU_WEIGHT and r.path == rel(hi)]
    assert weight.outcome is Outcome.READ_ONLY and weight.detail == IDLE
    assert read(hi, "cpu.weight") == "0" and read(hi, "cpu.idle") == "1"
    assert not [r for r in results if r.outcome is Outcome.FAILED], results
