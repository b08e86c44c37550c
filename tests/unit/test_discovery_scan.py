"""The scan: one directory that cannot be read must not hide the rest of the tree."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog

from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree
from nodeagent.discovery.registry import Registry
from nodeagent.errors import NodeagentError

CID = "ab" * 32


class _Refusing(CgroupTree):
    """A fixture tree where one directory answers EACCES, as a foreign mount might."""

    def __init__(self, root: str, refused: str) -> None:
        super().__init__(root)
        self.refused = refused

    @contextmanager
    def open(self, path: str) -> Iterator[CgroupDir]:
        if path == self.refused:
            raise NodeagentError(f"cannot open cgroup {path}: Permission denied")
        with super().open(path) as d:
            yield d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for p in ["system.slice/cron.service", f"docker/{CID}", "nodeagent.slice/job-1"]:
        (tmp_path / p).mkdir(parents=True)
    return tmp_path


def test_an_unreadable_directory_is_reported_and_the_rest_is_found(root: Path) -> None:
    registry = Registry(_Refusing(str(root), "system.slice"), "nodeagent.slice", watch=False)
    registry.resync()
    assert set(registry.workloads) == {f"docker/{CID}", "nodeagent.slice/job-1"}
    assert registry.problems == {
        "system.slice": "cannot open cgroup system.slice: Permission denied"
    }


def test_forget_drops_a_workload_the_sensor_found_gone(root: Path) -> None:
    registry = Registry(CgroupTree(str(root)), "nodeagent.slice", watch=False)
    registry.resync()
    registry.forget("nodeagent.slice/job-1")
    assert "nodeagent.slice/job-1" not in registry.workloads


def test_symlinks_met_are_reported_and_not_followed(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    (outside / "job-9").mkdir()
    (root / "nodeagent.slice" / "job-link").symlink_to(outside / "job-9")
    registry = Registry(CgroupTree(str(root)), "nodeagent.slice", watch=False)
    with structlog.testing.capture_logs() as logs:
        registry.resync()
        registry.resync()
    assert "nodeagent.slice/job-link" not in registry.workloads
    assert registry.problems == {
        "nodeagent.slice/job-link": "a symlink (cgroupfs has none): not followed"
    }
    assert [(e["event"], e["cgroup"]) for e in logs] == [
        ("discovery.skipped", "nodeagent.slice/job-link")
    ], "logged once while it lasts"
