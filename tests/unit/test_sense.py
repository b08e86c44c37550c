"""The sensor on fixture trees: one bad cgroup is skipped with its reason, the rest sensed."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from nodeagent.cgroupfs.tree import CgroupDir, CgroupReadError, CgroupTree
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.sense.node import NodeSensor
from nodeagent.sense.sensor import Sensor

FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.stat": "usage_usec 100\nuser_usec 60\nsystem_usec 40\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "cpu.pressure": "some avg10=1.00 avg60=0.50 avg300=0.10 total=1234\n",
    "memory.current": "4096\n",
}


def job(name: str) -> WorkloadIdentity:
    return WorkloadIdentity(f"s/{name}", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, name)


@pytest.fixture
def tree(tmp_path: Path) -> CgroupTree:
    for name in ("good", "bad", "worse"):
        d = tmp_path / "s" / name
        d.mkdir(parents=True)
        for f, text in FILES.items():
            (d / f).write_text(text)
    (tmp_path / "s" / "bad" / "cpu.stat").write_text("usage_usec lots\n")
    (tmp_path / "s" / "worse" / "memory.current").write_bytes(b"\xff\xfe\n")
    return CgroupTree(str(tmp_path))


def test_unparsable_files_skip_their_cgroup_only(tree: CgroupTree) -> None:
    sensor = Sensor(tree, NodeSensor())
    snap = sensor.snapshot([job("good"), job("bad"), job("worse"), job("gone")], 1.0, 1.0)
    assert [w.path for w in snap.workloads] == ["s/good"]
    reasons = {s.path: s.reason for s in snap.skipped}
    assert set(reasons) == {"s/bad", "s/worse"}
    assert reasons["s/bad"].startswith("cgroup s/bad: cpu.stat: ValueError: invalid literal for")
    assert (
        reasons["s/worse"] == "cgroup s/worse: memory.current is not ASCII text: b'\\xff\\xfe\\n'"
    )
    assert all(s.step == "sense" for s in snap.skipped)
    assert snap.vanished == ("s/gone",)


def test_pressure_files_on_a_kernel_without_psi_read_as_none(
    tree: CgroupTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = CgroupDir.read

    def no_psi(self: CgroupDir, name: str) -> str:
        if name.endswith(".pressure"):
            raise CgroupReadError(f"cgroup {self.path}: cannot read {name}", errno.EOPNOTSUPP)
        return real(self, name)

    monkeypatch.setattr(CgroupDir, "read", no_psi)
    snap = Sensor(tree, NodeSensor()).snapshot([job("good")], 1.0, 1.0)
    assert snap.skipped == ()
    assert snap.workloads[0].sample.cpu_psi is None
    assert snap.workloads[0].sample.cpu_usage_us == 100


def test_other_read_errors_on_pressure_still_skip(
    tree: CgroupTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = CgroupDir.read

    def eio(self: CgroupDir, name: str) -> str:
        if name == "cpu.pressure":
            raise CgroupReadError(f"cgroup {self.path}: cannot read {name}: I/O error", errno.EIO)
        return real(self, name)

    monkeypatch.setattr(CgroupDir, "read", eio)
    snap = Sensor(tree, NodeSensor()).snapshot([job("good")], 1.0, 1.0)
    assert [s.reason for s in snap.skipped] == [
        "cgroup s/good: cannot read cpu.pressure: I/O error"
    ]


def test_a_skipped_cgroup_keeps_its_rate_baseline(tree: CgroupTree, tmp_path: Path) -> None:
    sensor = Sensor(tree, NodeSensor())
    sensor.snapshot([job("good")], 1.0, 1.0)
    stat = tmp_path / "s" / "good" / "cpu.stat"
    stat.write_text("usage_usec ???\n")
    assert sensor.snapshot([job("good")], 2.0, 2.0).skipped
    stat.write_text("usage_usec 2000100\n")
    (w,) = sensor.snapshot([job("good")], 3.0, 3.0).workloads
    assert w.cpu_rate == pytest.approx(1.0), "2 s of CPU over the 2 s since the last good read"
