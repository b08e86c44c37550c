"""CgroupTree on a fixture tree: no path leaves the root, by '..' or by a symlink."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeagent.cgroupfs.paths import split_path
from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.errors import NodeagentError, UnsafePath


def cgroup(path: Path, **files: str) -> Path:
    """A fake cgroup directory: every real one has cgroup.procs."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.procs").write_text("")
    for name, text in files.items():
        (path / name.replace("_", ".", 1)).write_text(text)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = cgroup(tmp_path / "root", cgroup_controllers="cpu memory\n")
    cgroup(r / "system.slice" / "cron.service", cpu_weight="100\n", memory_max="max\n")
    cgroup(r / "nodeagent.slice" / "job-1", cpu_weight="250\n")
    return r


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the root holding a secret the tree must never read."""
    return cgroup(tmp_path / "outside", secret="do not read\n")


# --- split_path ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("", ()),
        ("/", ()),
        ("system.slice", ("system.slice",)),
        ("system.slice/cron.service", ("system.slice", "cron.service")),
        ("a b/c..d/.e", ("a b", "c..d", ".e")),  # dots inside a name are fine
    ],
)
def test_split_path_accepts(path: str, parts: tuple[str, ...]) -> None:
    assert split_path(path) == parts


@pytest.mark.parametrize(
    "path",
    [
        "..",
        "../outside",
        "system.slice/../..",
        "system.slice/..",
        ".",
        "./system.slice",
        "system.slice/.",
        "system.slice//cron.service",
        "system.slice/",
        "/system.slice",
        "//",
        "/etc/passwd",
        "system.slice\0/x",
        "\0",
    ],
)
def test_split_path_refuses(path: str) -> None:
    with pytest.raises(UnsafePath):
        split_path(path)


def test_path_of_is_under_the_root(root: Path) -> None:
    tree = CgroupTree(str(root))
    assert tree.path_of("system.slice/cron.service") == str(root / "system.slice/cron.service")
    assert tree.path_of("") == str(root)
    with pytest.raises(UnsafePath):
        tree.path_of("../outside")


# --- open / read -----------------------------------------------------------------------


def test_open_and_read(root: Path) -> None:
    tree = CgroupTree(str(root))
    with tree.open("system.slice/cron.service") as d:
        assert d.path == "system.slice/cron.service"
        assert d.read("cpu.weight") == "100\n"
        assert d.read("memory.max") == "max\n"
    with tree.open("") as d:
        assert d.read("cgroup.controllers") == "cpu memory\n"


def test_root_is_resolved_through_a_symlink(tmp_path: Path, root: Path) -> None:
    link = tmp_path / "root-link"
    link.symlink_to(root)
    tree = CgroupTree(str(link))
    assert tree.root == str(root)
    with tree.open("nodeagent.slice/job-1") as d:
        assert d.read("cpu.weight") == "250\n"


@pytest.mark.parametrize("path", ["../outside", "/etc", "system.slice/../../outside"])
def test_open_refuses_unsafe_paths(root: Path, path: str) -> None:
    with pytest.raises(UnsafePath), CgroupTree(str(root)).open(path):
        pass


def test_open_refuses_a_symlinked_intermediate_component(root: Path, outside: Path) -> None:
    (root / "escape.slice").symlink_to(outside.parent)
    with (
        pytest.raises(UnsafePath, match="symlink"),
        CgroupTree(str(root)).open("escape.slice/outside"),
    ):
        pass


def test_open_refuses_a_symlinked_intermediate_even_inside_the_root(root: Path) -> None:
    (root / "alias.slice").symlink_to(root / "system.slice")
    with pytest.raises(UnsafePath), CgroupTree(str(root)).open("alias.slice/cron.service"):
        pass


def test_open_refuses_a_symlinked_final_directory(root: Path, outside: Path) -> None:
    (root / "system.slice" / "evil.service").symlink_to(outside)
    with pytest.raises(UnsafePath), CgroupTree(str(root)).open("system.slice/evil.service"):
        pass


def test_open_refuses_a_symlinked_final_directory_inside_the_root(root: Path) -> None:
    (root / "system.slice" / "alias.service").symlink_to(root / "system.slice" / "cron.service")
    with pytest.raises(UnsafePath), CgroupTree(str(root)).open("system.slice/alias.service"):
        pass


def test_open_refuses_a_file_as_a_directory(root: Path) -> None:
    with (
        pytest.raises(UnsafePath),
        CgroupTree(str(root)).open("system.slice/cron.service/cpu.weight"),
    ):
        pass


def test_read_refuses_a_symlinked_file(root: Path, outside: Path) -> None:
    job = root / "nodeagent.slice" / "job-1"
    (job / "memory.max").symlink_to(outside / "secret")
    with CgroupTree(str(root)).open("nodeagent.slice/job-1") as d:
        with pytest.raises(UnsafePath, match=r"memory\.max"):
            d.read("memory.max")
        with pytest.raises(UnsafePath):
            d.read_optional("memory.max")


def test_read_refuses_a_symlinked_file_inside_the_root(root: Path) -> None:
    job = root / "nodeagent.slice" / "job-1"
    (job / "memory.max").symlink_to(root / "system.slice" / "cron.service" / "memory.max")
    with CgroupTree(str(root)).open("nodeagent.slice/job-1") as d, pytest.raises(UnsafePath):
        d.read("memory.max")


@pytest.mark.parametrize("name", ["../../../outside/secret", "/etc/hostname"])
def test_read_takes_one_file_name_and_never_leaves_the_cgroup(
    root: Path, outside: Path, name: str
) -> None:
    """The module promises that no path leaves the root through '..'; file names included."""
    with CgroupTree(str(root)).open("nodeagent.slice/job-1") as d, pytest.raises(UnsafePath):
        d.read(name)


def test_missing_path_raises_vanished(root: Path) -> None:
    tree = CgroupTree(str(root))
    with pytest.raises(CgroupVanished) as info, tree.open("system.slice/gone.service"):
        pass
    assert info.value.path == "system.slice/gone.service"


def test_missing_file_in_an_existing_cgroup(root: Path) -> None:
    with CgroupTree(str(root)).open("nodeagent.slice/job-1") as d:
        assert d.read_optional("memory.max") is None  # the memory controller is off here
        assert d.read_optional("cpu.weight") == "250\n"
        with pytest.raises(CgroupVanished):
            d.read("memory.max")
        assert d.has("cpu.weight")
        assert not d.has("memory.max")


def test_read_optional_in_a_removed_cgroup_raises_vanished(root: Path) -> None:
    job = root / "nodeagent.slice" / "job-1"
    with CgroupTree(str(root)).open("nodeagent.slice/job-1") as d:
        for f in job.iterdir():
            f.unlink()
        job.rmdir()
        with pytest.raises(CgroupVanished):
            d.read_optional("memory.max")


def test_root_missing_is_an_error(tmp_path: Path) -> None:
    with (
        pytest.raises(NodeagentError, match="cannot open cgroup root"),
        CgroupTree(str(tmp_path / "nope")).open(""),
    ):
        pass


# --- subdirs ---------------------------------------------------------------------------


def test_subdirs_lists_real_directories_only(root: Path, outside: Path) -> None:
    system = root / "system.slice"
    cgroup(system / "ssh.service")
    (system / "link.service").symlink_to(system / "cron.service")
    (system / "escape.service").symlink_to(outside)
    (system / "dangling.service").symlink_to(root / "nope")
    with CgroupTree(str(root)).open("system.slice") as d:
        assert sorted(d.subdirs()) == ["cron.service", "ssh.service"]
    with CgroupTree(str(root)).open("") as d:
        assert sorted(d.subdirs()) == ["nodeagent.slice", "system.slice"]


# --- mkdir / rmdir ---------------------------------------------------------------------


def test_mkdir_creates_once(root: Path) -> None:
    tree = CgroupTree(str(root))
    assert tree.mkdir("nodeagent.slice/job-2") is True
    assert (root / "nodeagent.slice" / "job-2").is_dir()
    assert tree.mkdir("nodeagent.slice/job-2") is False
    assert tree.mkdir("") is False


def test_mkdir_needs_the_parent(root: Path) -> None:
    with pytest.raises(CgroupVanished):
        CgroupTree(str(root)).mkdir("nodeagent.slice/missing/job")
    assert not (root / "nodeagent.slice" / "missing").exists()


def test_mkdir_over_a_file_or_symlink_is_unsafe(root: Path, outside: Path) -> None:
    slice_ = root / "nodeagent.slice"
    (slice_ / "afile").write_text("")
    (slice_ / "alink").symlink_to(outside)
    tree = CgroupTree(str(root))
    with pytest.raises(UnsafePath, match="not a directory"):
        tree.mkdir("nodeagent.slice/afile")
    with pytest.raises(UnsafePath, match="not a directory"):
        tree.mkdir("nodeagent.slice/alink")


@pytest.mark.parametrize("path", ["../escape", "nodeagent.slice/../../escape", "/abs"])
def test_mkdir_refuses_unsafe_paths(root: Path, path: str) -> None:
    with pytest.raises(UnsafePath):
        CgroupTree(str(root)).mkdir(path)
    assert not (root.parent / "escape").exists()


def test_mkdir_through_a_symlinked_parent_is_unsafe(root: Path, outside: Path) -> None:
    (root / "link.slice").symlink_to(outside)
    with pytest.raises(UnsafePath):
        CgroupTree(str(root)).mkdir("link.slice/job")
    assert not (outside / "job").exists()


def test_tree_root_unchanged_by_reads(root: Path) -> None:
    before = sorted(os.walk(root))
    tree = CgroupTree(str(root))
    with tree.open("system.slice/cron.service") as d:
        d.read("cpu.weight")
        d.subdirs()
    assert sorted(os.walk(root)) == before
