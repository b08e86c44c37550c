"""detect(): find a usable cgroup v2 hierarchy from a fake /proc and fake mount points."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.cgroupfs.detect import CgroupHost, Mount, detect, parse_mountinfo
from nodeagent.errors import CgroupUnavailable

# A real hybrid host's mountinfo (this one's, shortened), for the parser alone.
HYBRID_MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
25 22 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup rw,relatime shared:8 - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""


def test_parse_mountinfo_fields() -> None:
    mounts = parse_mountinfo(HYBRID_MOUNTINFO)
    assert [m.point for m in mounts] == [
        "/",
        "/sys",
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/cpu,cpuacct",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/systemd",
        "/sys/fs/cgroup/unified",
    ]
    assert mounts[2] == Mount("/sys/fs/cgroup", "tmpfs", frozenset({"rw", "mode=755"}))
    assert mounts[3] == Mount(
        "/sys/fs/cgroup/cpu,cpuacct", "cgroup", frozenset({"rw", "cpu", "cpuacct"})
    )
    assert mounts[6].fstype == "cgroup2"
    assert mounts[6].options == frozenset({"rw", "nsdelegate"})


def test_parse_mountinfo_without_optional_fields_and_junk_lines() -> None:
    text = "36 35 98:0 / /mnt rw,relatime - cgroup2 cgroup2 rw\nnot a mountinfo line\n\n"
    assert parse_mountinfo(text) == [Mount("/mnt", "cgroup2", frozenset({"rw"}))]


def test_parse_mountinfo_without_super_options() -> None:
    assert parse_mountinfo("36 35 98:0 / /mnt rw - cgroup2 cgroup2\n") == [
        Mount("/mnt", "cgroup2", frozenset())
    ]


@pytest.mark.parametrize(
    ("escaped", "point"),
    [
        ("/mnt/my\\040cgroups", "/mnt/my cgroups"),
        ("/mnt/tab\\011here", "/mnt/tab\there"),
        ("/mnt/back\\134slash", "/mnt/back\\slash"),
        ("/mnt/new\\012line", "/mnt/new\nline"),
    ],
)
def test_parse_mountinfo_decodes_the_kernels_octal_escapes(escaped: str, point: str) -> None:
    """show_mountinfo escapes space, tab, newline and backslash as \\ooo (seq_path)."""
    line = f"36 35 98:0 / {escaped} rw,relatime - cgroup2 cgroup2 rw\n"
    assert parse_mountinfo(line)[0].point == point


# --- detect() on a fake host -----------------------------------------------------------


class FakeHost:
    """A fake /proc/self/mountinfo plus directories standing in for the mount points."""

    def __init__(self, base: Path) -> None:
        self.base = Path(os.path.realpath(base))
        self.proc = self.base / "proc"
        (self.proc / "self").mkdir(parents=True)
        self.lines = ["22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard"]

    def mount(self, rel: str, fstype: str, options: str, controllers: str | None = None) -> str:
        point = self.base / rel
        point.mkdir(parents=True, exist_ok=True)
        if controllers is not None:
            (point / "cgroup.controllers").write_text(controllers + "\n")
        n = 30 + len(self.lines)
        self.lines.append(f"{n} 22 0:{n} / {point} rw,relatime - {fstype} {fstype} {options}")
        (self.proc / "self" / "mountinfo").write_text("\n".join(self.lines) + "\n")
        return str(point)

    def detect(self, root: str) -> CgroupHost:
        return detect(root, str(self.proc))


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    return FakeHost(tmp_path)


def test_hybrid_v1_layout_is_refused_naming_where_cpu_and_memory_are(host: FakeHost) -> None:
    root = host.mount("cgroup", "tmpfs", "rw,mode=755")
    cpu = host.mount("cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
    memory = host.mount("cgroup/memory", "cgroup", "rw,memory")
    host.mount("cgroup/pids", "cgroup", "rw,pids")
    unified = host.mount("cgroup/unified", "cgroup2", "rw,nsdelegate", controllers="hugetlb")

    with pytest.raises(CgroupUnavailable) as info:
        host.detect(root)
    message = str(info.value)
    assert f"{root} is not a cgroup v2 mount (tmpfs)" in message
    assert f"cpu is bound to cgroup v1 at {cpu}" in message
    assert f"memory is bound to cgroup v1 at {memory}" in message
    assert f"the v2 hierarchy at {unified} offers only: hugetlb" in message
    assert "systemd.unified_cgroup_hierarchy=1" in message
    assert "\n" not in message


def test_hybrid_unified_as_root_lacks_cpu_and_memory(host: FakeHost) -> None:
    host.mount("cgroup", "tmpfs", "rw,mode=755")
    cpu = host.mount("cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct")
    memory = host.mount("cgroup/memory", "cgroup", "rw,memory")
    unified = host.mount("cgroup/unified", "cgroup2", "rw", controllers="hugetlb")

    with pytest.raises(CgroupUnavailable) as info:
        host.detect(unified)
    message = str(info.value)
    assert f"cgroup v2 at {unified} lacks the controllers nodeagent needs" in message
    assert f"cpu (bound to cgroup v1 at {cpu})" in message
    assert f"memory (bound to cgroup v1 at {memory})" in message


def test_pure_v2_with_cpu_and_memory(host: FakeHost) -> None:
    root = host.mount(
        "cgroup",
        "cgroup2",
        "rw,nsdelegate,memory_recursiveprot",
        controllers="cpuset cpu io memory hugetlb pids rdma misc",
    )
    found = host.detect(root)
    assert found == CgroupHost(
        root, frozenset({"cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc"})
    )


def test_a_directory_inside_a_v2_mount_is_accepted(host: FakeHost) -> None:
    host.mount("cgroup", "cgroup2", "rw", controllers="cpu memory pids")
    sub = host.base / "cgroup" / "nodeagent.slice"
    sub.mkdir()
    (sub / "cgroup.controllers").write_text("cpu memory\n")
    assert host.detect(str(sub)) == CgroupHost(str(sub), frozenset({"cpu", "memory"}))


def test_root_given_through_a_symlink_is_resolved(host: FakeHost) -> None:
    root = host.mount("cgroup", "cgroup2", "rw", controllers="cpu memory")
    link = host.base / "link"
    link.symlink_to(root)
    assert host.detect(str(link)).root == root


def test_v2_lacking_memory_names_memory(host: FakeHost) -> None:
    root = host.mount("cgroup", "cgroup2", "rw", controllers="cpuset cpu io pids")
    with pytest.raises(CgroupUnavailable) as info:
        host.detect(root)
    message = str(info.value)
    assert message.endswith("lacks the controllers nodeagent needs: memory")
    assert "cpu," not in message


def test_v2_without_a_controllers_file_lacks_both(host: FakeHost) -> None:
    root = host.mount("cgroup", "cgroup2", "rw")
    with pytest.raises(CgroupUnavailable, match=r"needs: cpu, memory$"):
        host.detect(root)


def test_a_later_mount_on_the_same_point_shadows_the_earlier(host: FakeHost) -> None:
    host.mount("cgroup", "tmpfs", "rw")
    root = host.mount("cgroup", "cgroup2", "rw", controllers="cpu memory")
    assert host.detect(root).controllers == frozenset({"cpu", "memory"})


def test_an_ordinary_directory_is_not_a_cgroup_mount(host: FakeHost) -> None:
    plain = host.base / "plain"
    plain.mkdir()
    host.mount("cgroup", "cgroup2", "rw", controllers="cpu memory")
    with pytest.raises(CgroupUnavailable, match=rf"{plain} is not a cgroup v2 mount \(ext4\)"):
        host.detect(str(plain))


def test_unreadable_mountinfo(tmp_path: Path) -> None:
    with pytest.raises(CgroupUnavailable, match=r"cannot read .*/self/mountinfo"):
        detect(str(tmp_path), str(tmp_path / "no-proc"))
