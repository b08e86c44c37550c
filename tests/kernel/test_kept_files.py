"""Interface files kept open from tick to tick, on the real kernel: kernfs makes a file's
content anew at each read from offset 0, and a kept file of a removed cgroup reads ENODEV."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished, KeptDir
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor


def usage(text: str) -> int:
    return int(text.split()[1])  # "usage_usec N" is cpu.stat's first line


def test_a_kept_cpu_stat_reads_what_the_kernel_counts_now(cgroup_sandbox: Path) -> None:
    (cgroup_sandbox / "w").mkdir()
    tree = CgroupTree(str(cgroup_sandbox.parent))
    path = f"{cgroup_sandbox.name}/w"
    d = KeptDir(path, tree.open_fd(path))
    try:
        before = usage(d.reread("cpu.stat"))
        spin = 'echo $$ > "$0/cgroup.procs" && exec timeout 0.5 sh -c "while :; do :; done"'
        subprocess.run(["sh", "-c", spin, str(cgroup_sandbox / "w")], check=False)
        after = usage(d.reread("cpu.stat"))
        assert after - before > 100_000, (before, after)  # half a second of spinning, counted
        assert d.reread("cpu.stat") == (cgroup_sandbox / "w" / "cpu.stat").read_text()
        (cgroup_sandbox / "w").rmdir()
        with pytest.raises(CgroupVanished):
            d.reread("cpu.stat")
    finally:
        d.close()


def test_the_sensor_reports_a_removed_workload_read_through_its_kept_file(
    cgroup_sandbox: Path,
) -> None:
    tree = CgroupTree(str(cgroup_sandbox.parent))
    names = ["a", "b"]
    for name in names:
        (cgroup_sandbox / name).mkdir()
    jobs = [
        WorkloadIdentity(
            f"{cgroup_sandbox.name}/{n}", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, n
        )
        for n in names
    ]
    sensor = Sensor(tree, NodeSensor(), verify_every=3600)
    try:
        for t in (0.0, 1.0):  # a full read, then a lean one: cpu.stat now kept open
            snap = sensor.snapshot(jobs, t, time.monotonic())
            assert [w.identity.name for w in snap.workloads] == names
        assert all(d._files for d in sensor._dirs.values()), "cpu.stat kept"
        (cgroup_sandbox / "a").rmdir()
        snap = sensor.snapshot(jobs, 2.0, time.monotonic())
        assert snap.vanished == (jobs[0].path,)
        assert [w.identity.name for w in snap.workloads] == ["b"]
        assert jobs[0].path not in sensor._dirs
    finally:
        sensor.close()
