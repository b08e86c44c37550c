"""The sensor on fixture trees: one bad cgroup is skipped with its reason, the rest sensed."""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupDir, CgroupReadError, CgroupTree, KeptDir
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight
from nodeagent.identity import Kind, Owner, Runtime, WorkloadIdentity
from nodeagent.sense import sensor as sensor_module
from nodeagent.sense.cgroup_files import Needs
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
    "cgroup.threads": "11\n12\n",
}


def job(name: str) -> WorkloadIdentity:
    return WorkloadIdentity(f"s/{name}", Kind.JOB, Runtime.NODEAGENT, Owner.NODEAGENT, name)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the interface files read, in order."""
    names: list[str] = []
    count_reads(monkeypatch, lambda _, name: names.append(name))
    return names


def count_reads(monkeypatch: pytest.MonkeyPatch, seen: Callable[[CgroupDir, str], object]) -> None:
    """`seen(dir, name)` at each interface file read: opened (CgroupDir.read) or read
    again where it is kept open (KeptDir.reread)."""
    real, real_again = CgroupDir.read, KeptDir.reread

    def counting(self: CgroupDir, name: str) -> str:
        seen(self, name)
        return real(self, name)

    def counting_again(self: KeptDir, name: str) -> str:
        seen(self, name)
        return real_again(self, name)

    monkeypatch.setattr(CgroupDir, "read", counting)
    monkeypatch.setattr(KeptDir, "reread", counting_again)


@pytest.fixture
def tree(tmp_path: Path) -> CgroupTree:
    for name in ("good", "good2", "bad", "worse"):
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


def test_a_steady_tick_reads_usage_and_verifies_a_few_in_turn(
    tree: CgroupTree, tmp_path: Path, opened: list[str]
) -> None:
    """After a workload's first (full) read, a tick reads its cpu.stat only; settings come
    from what is known, and every workload is read in full again within verify_every."""
    sensor = Sensor(tree, NodeSensor(), verify_every=3.0)
    jobs = [job("good")]
    sensor.snapshot(jobs, 0.0, 0.0)
    assert "cpu.weight" in opened, "first sight: a full read"
    (tmp_path / "s" / "good" / "cpu.weight").write_text("777\n")  # another writer
    seen = []
    for t in (1.0, 2.0, 3.0):
        opened.clear()
        snap = sensor.snapshot(jobs, t, t)
        seen.append(snap.workloads[0].sample.settings[Attribute.CPU_WEIGHT])
        if t < 3.0:
            assert opened == ["cpu.stat"], f"tick at {t}: {opened}"
    assert seen == [CpuWeight(100), CpuWeight(100), CpuWeight(777)], "verified in its turn"
    assert sensor.fresh == {"s/good"}


def test_cpu_stat_is_opened_once_and_read_again_at_each_lean_read(
    tree: CgroupTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lean reads pread the cpu.stat they keep open (kernfs makes its content anew at each
    read from offset 0); a workload no longer sensed has its descriptors closed."""
    opens: list[str] = []
    real = CgroupDir._open_file

    def counting(self: CgroupDir, name: str, mode: int) -> int:
        opens.append(name)
        return real(self, name, mode)

    monkeypatch.setattr(CgroupDir, "_open_file", counting)
    sensor = Sensor(tree, NodeSensor(), verify_every=3600)
    stat = tmp_path / "s" / "good" / "cpu.stat"
    usage = []
    for t in (0.0, 1.0, 2.0, 3.0):
        stat.write_text(f"usage_usec {100 + int(t) * 500}\nuser_usec 0\nsystem_usec 0\n")
        opens.clear()
        snap = sensor.snapshot([job("good")], t, t)
        usage.append(snap.workloads[0].sample.cpu_usage_us)
        if t == 1.0:
            assert opens == ["cpu.stat"], "the first lean read opens it"
        elif t > 1.0:
            assert opens == [], f"tick at {t}: {opens}"
    assert usage == [100, 600, 1100, 1600]
    kept = sensor._dirs["s/good"]
    descriptors = [kept.fd, *kept._files.values()]
    sensor.snapshot([], 4.0, 4.0)
    for fd in descriptors:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)


def test_what_the_agent_writes_is_known_without_reading_it(tree: CgroupTree) -> None:
    sensor = Sensor(tree, NodeSensor(), verify_every=3600)
    sensor.snapshot([job("good")], 0.0, 0.0)
    sensor.learn("s/good", Attribute.CPU_WEIGHT, CpuWeight(250))
    snap = sensor.snapshot([job("good")], 1.0, 1.0)
    assert snap.workloads[0].sample.settings[Attribute.CPU_WEIGHT] == CpuWeight(250)
    assert snap.workloads[0].sample.populated is None, "unknown in a lean read: the rate says"


def test_needs_add_what_a_policy_uses_every_tick(tree: CgroupTree) -> None:
    sensor = Sensor(tree, NodeSensor(), verify_every=3600)
    sensor.snapshot([job("good")], 0.0, 0.0)
    needs = {"s/good": Needs(events=True, memory=True, pressure=True, threads=True)}
    (w,) = sensor.snapshot([job("good")], 1.0, 1.0, needs=needs).workloads
    assert w.sample.populated is True
    assert w.sample.memory_current == 4096
    assert w.sample.cpu_psi is not None
    assert w.sample.threads == 2


def test_a_cgroup_without_cgroup_threads_is_sensed_with_threads_unknown(
    tree: CgroupTree, tmp_path: Path
) -> None:
    """A kernel before 4.14 (and a fixture tree) has no cgroup.threads: a deadline job there
    was taken for a vanished cgroup and dropped from the snapshot, counted nowhere; now it
    is sensed, its threads unknown (its parallelism then comes from --cpus and the node)."""
    (tmp_path / "s" / "good" / "cgroup.threads").unlink()
    sensor = Sensor(tree, NodeSensor(), verify_every=3600)
    needs = {"s/good": Needs(events=True, threads=True)}
    for t in (0.0, 1.0):  # a full read, then a lean one
        snap = sensor.snapshot([job("good")], t, t, needs=needs)
        assert [w.path for w in snap.workloads] == ["s/good"], (t, snap.vanished, snap.skipped)
        assert snap.workloads[0].sample.threads is None


@pytest.mark.parametrize(
    ("soft", "budget"), [(1024, 256), (8192, 2048), (1 << 20, 4096), (7, 1), (3, 0)]
)
def test_the_directories_kept_open_leave_half_the_descriptors(
    monkeypatch: pytest.MonkeyPatch, soft: int, budget: int
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, 1 << 20))
    assert sensor_module.dir_budget() == budget


def test_beyond_its_budget_a_workload_is_opened_for_each_read(
    tree: CgroupTree, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (4, 4))  # budget 1
    sensor = Sensor(tree, NodeSensor())
    snap = sensor.snapshot([job("good"), job("good2")], 1.0, 1.0)
    assert [w.identity.name for w in snap.workloads] == ["good", "good2"]
    assert len(sensor._dirs) == 1


@pytest.mark.parametrize(
    ("soft", "hard", "now"),
    [(1024, 524288, 16384), (1024, 4096, 4096), (65536, 524288, 65536)],
)
def test_the_daemon_raises_its_soft_descriptor_limit_within_the_hard_one(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, now: int
) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda _, v: set_to.append(v))
    assert sensor_module.raise_fd_limit() == now
    assert set_to == ([] if now == soft else [(now, hard)])


def test_a_quiet_workload_is_read_every_few_seconds_until_it_moves(
    tree: CgroupTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its cpu.stat unchanged QUIET_READS times in a row, a workload is read again only
    after QUIET_EVERY seconds; once its usage moves it is read every tick again. One
    whose files a policy needs every tick is always read."""
    opened: list[str] = []
    count_reads(monkeypatch, lambda d, name: opened.append(f"{d.path}/{name}"))
    sensor = Sensor(tree, NodeSensor(), verify_every=0)  # no rolling full reads here
    jobs = [job("good"), job("good2")]
    needs = {"s/good2": Needs(events=True)}

    def tick(t: float) -> set[str]:
        opened.clear()
        snap = sensor.snapshot(jobs, t, t, needs=needs)
        assert [w.identity.name for w in snap.workloads] == ["good", "good2"]
        return {p for p in opened if p.endswith("cpu.stat")}

    q, every = sensor_module.QUIET_READS, sensor_module.QUIET_EVERY
    # a full read, then q lean reads that find the same
    last_read = q
    reads = {t: tick(t) for t in range(last_read + 1)}
    assert all("s/good/cpu.stat" in r for r in reads.values())
    assert "s/good/cpu.stat" not in tick(last_read + 1), "quiet: not read this tick"
    assert "s/good/cpu.stat" not in tick(last_read + every - 1)
    assert "s/good2/cpu.stat" in tick(last_read + every - 0.5), "needed every tick: read"
    assert "s/good/cpu.stat" in tick(last_read + every), f"read again {every:g} s later"

    (tmp_path / "s" / "good" / "cpu.stat").write_text("usage_usec 900100\n")  # it woke
    t = last_read + every + 1
    assert "s/good/cpu.stat" not in tick(t), "still taken as quiet: seen within QUIET_EVERY"
    woke = last_read + 2 * every
    assert "s/good/cpu.stat" in tick(woke)
    assert "s/good/cpu.stat" in tick(woke + 1), "moving: read every tick again"


def test_a_full_read_that_finds_the_same_keeps_a_quiet_workload_quiet(
    tree: CgroupTree, tmp_path: Path, opened: list[str]
) -> None:
    """A rolling full read that finds what the last one found (and the same cpu.stat) is
    the same sample again, and the workload stays quiet; one that finds another writer's
    value is a change: the workload is read every tick again until it is quiet anew."""
    sensor = Sensor(tree, NodeSensor(), verify_every=0)
    jobs = [job("good")]
    q, every = sensor_module.QUIET_READS, sensor_module.QUIET_EVERY
    for t in range(q + 1):  # a full read, then q lean reads that find the same
        sensor.snapshot(jobs, t, t)
    known = sensor._known["s/good"]

    def tick(t: float, full: bool = False) -> list[str]:
        opened.clear()
        sensor.snapshot(jobs, t, t, full=full)
        return list(opened)

    assert "cpu.weight" in tick(q + 1, full=True)
    assert sensor._known["s/good"] is known, "the same full read: the same sample"
    assert tick(q + 2) == [], "still quiet"
    (tmp_path / "s" / "good" / "cpu.weight").write_text("777\n")  # another writer
    assert "cpu.weight" in tick(q + 1 + every, full=True)
    assert sensor._known["s/good"] is not known
    assert tick(q + 2 + every) == ["cpu.stat"], "a change: read every tick again"


def test_a_full_read_parses_a_setting_only_when_its_text_changed(
    tree: CgroupTree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting whose text a full read parsed before (in this workload or another) is the
    value parsed then; a new text is parsed, and a bad file still skips its cgroup. Counters
    are parsed at each read."""
    parsed: list[str] = []
    real = parse.cpu_max

    def counting(text: str) -> CpuMax:
        parsed.append(text.strip())
        return real(text)

    monkeypatch.setattr(parse, "cpu_max", counting)
    sensor = Sensor(tree, NodeSensor())
    first = sensor.snapshot([job("good")], 0.0, 0.0, full=True).workloads[0].sample
    assert parsed == ["max 100000"]
    stat = tmp_path / "s" / "good" / "cpu.stat"
    stat.write_text("usage_usec 900100\n")
    second = sensor.snapshot([job("good")], 1.0, 1.0, full=True).workloads[0].sample
    assert parsed == ["max 100000"], "cpu.max read the same: not parsed again"
    assert second.cpu_usage_us == 900100
    assert second.settings[Attribute.CPU_MAX] is first.settings[Attribute.CPU_MAX]
    (tmp_path / "s" / "good" / "cpu.max").write_text("50000 100000\n")
    third = sensor.snapshot([job("good")], 2.0, 2.0, full=True).workloads[0].sample
    assert parsed == ["max 100000", "50000 100000"]
    assert third.settings[Attribute.CPU_MAX] == CpuMax(50000, 100000)
    other = sensor.snapshot([job("good2")], 2.5, 2.5, full=True).workloads[0].sample
    assert parsed == ["max 100000", "50000 100000"], "another workload's same text: no parse"
    assert other.settings[Attribute.CPU_MAX] is first.settings[Attribute.CPU_MAX]
    stat.write_text("usage_usec lots\n")
    assert [s.path for s in sensor.snapshot([job("good")], 3.0, 3.0, full=True).skipped] == [
        "s/good"
    ]
    stat.write_text("usage_usec 100\n")
    (tmp_path / "s" / "good" / "cpu.max").write_text("max 100000\n")
    (w,) = sensor.snapshot([job("good")], 4.0, 4.0, full=True).workloads
    assert w.sample == first, "a skipped cgroup is read anew"


def test_a_memo_keeps_the_settings_only_not_the_counters(tree: CgroupTree, tmp_path: Path) -> None:
    """Counters move at most reads of a live cgroup: a memo of them held their texts and
    values for every workload (memory.stat alone, fifty-odd keys on 6.1, 6 MB at 1,000
    workloads; cpu.stat, memory.events and the pressure files about 2 MB more), for a parse
    of microseconds. The memo keeps the settings; the counters are parsed at each read, and a
    bad one still skips its cgroup."""
    from nodeagent.sense.cgroup_files import Memo, read_sample

    stat = tmp_path / "s" / "good" / "memory.stat"
    stat.write_text("anon 4096\nfile 8192\nkernel 12\n" + "".join(f"k{n} {n}\n" for n in range(50)))
    memo: Memo = {}
    with tree.open("s/good") as d:
        sample = read_sample(d, 4096, memo=memo)
        assert (sample.memory_anon, sample.memory_file) == (4096, 8192)
        assert set(memo) <= {str(a) for a in Attribute}, sorted(memo)
        assert "cpu.max" in memo and "cpu.weight" in memo
        stat.write_text("anon lots\n")
        with pytest.raises(CgroupReadError, match=r"memory\.stat"):
            read_sample(d, 4096, memo=memo)


def test_the_memo_is_bounded_however_many_distinct_settings_a_node_has(
    tree: CgroupTree, tmp_path: Path
) -> None:
    """One table per file name for all workloads: a node whose workloads all have distinct
    limits empties a full table instead of growing it."""
    from nodeagent.sense.cgroup_files import MEMO_TEXTS, Memo, read_sample

    memo: Memo = {}
    weight = tmp_path / "s" / "good" / "cpu.weight"
    with tree.open("s/good") as d:
        for n in range(1, MEMO_TEXTS + 10):
            weight.write_text(f"{n}\n")
            assert read_sample(d, 4096, memo=memo).settings[Attribute.CPU_WEIGHT] == CpuWeight(n)
            assert len(memo["cpu.weight"]) <= MEMO_TEXTS


MEMINFO = """\
MemTotal:       16331512 kB
MemFree:         1208416 kB
MemAvailable:    9876540 kB
Buffers:          412300 kB
Cached:          7213888 kB
SwapCached:            0 kB
Active:          8312572 kB
Inactive:        5307548 kB
Shmem:            523196 kB
SReclaimable:     588284 kB
"""


@pytest.mark.parametrize("available", [True, False], ids=["MemAvailable", "before-3.14"])
def test_node_memory_is_what_psutil_reads_from_the_same_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, available: bool
) -> None:
    """The two meminfo lines read by hand give what psutil's virtual_memory() gives (it
    parses the whole file); a kernel without MemAvailable gets psutil's estimate."""
    monkeypatch.setattr(psutil, "PROCFS_PATH", psutil.PROCFS_PATH)  # NodeSensor sets it
    meminfo = MEMINFO if available else MEMINFO.replace("MemAvailable:    9876540 kB\n", "")
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "stat").write_text(
        "cpu  100 0 50 800 10 0 5 0 0 0\ncpu0 100 0 50 800 10 0 5 0 0 0\n"
    )
    node = NodeSensor(str(tmp_path)).read()
    mem = psutil.virtual_memory()  # PROCFS_PATH is tmp_path now
    assert (node.memory_total, node.memory_available) == (mem.total, mem.available)
    assert node.memory_total == 16331512 * 1024
    if available:
        assert node.memory_available == 9876540 * 1024
