"""The scan: one directory that cannot be read must not hide the rest of the tree."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import structlog

from nodeagent.cgroupfs.tree import CgroupDir, CgroupTree
from nodeagent.discovery.layouts import classify
from nodeagent.discovery.registry import Registry
from nodeagent.discovery.scan import descends
from nodeagent.errors import NodeagentError
from nodeagent.identity import Kind

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


# -- the managed root below the agent's own service (Delegate=yes) ---------------------------
SERVICE = "system.slice/nodeagent.service"
MANAGED = f"{SERVICE}/workloads"


def test_descends_into_a_workload_only_on_the_way_to_the_managed_root() -> None:
    service = classify(SERVICE, MANAGED)
    other = classify("system.slice/cron.service", MANAGED)
    job = classify(f"{MANAGED}/train-0", MANAGED)
    assert service is not None and other is not None and job is not None
    assert descends(service, SERVICE, MANAGED)  # the managed root lies below it
    assert not descends(other, "system.slice/cron.service", MANAGED)
    assert not descends(job, f"{MANAGED}/train-0", MANAGED)  # a job's children are its own
    # a name that only starts like the service is not on the way
    assert not descends(other, "system.slice/nodeagent.serv", MANAGED)
    assert descends(None, "system.slice", MANAGED)


@pytest.fixture
def service_root(tmp_path: Path) -> Path:
    for p in [
        f"{MANAGED}/train-0",
        f"{MANAGED}/train-0/inner",
        f"{SERVICE}/agent",
        "system.slice/cron.service/child",
    ]:
        (tmp_path / p).mkdir(parents=True)
    return tmp_path


def test_the_managed_root_below_a_service_is_scanned_and_other_services_are_not(
    service_root: Path,
) -> None:
    registry = Registry(CgroupTree(str(service_root)), MANAGED, watch=False)
    registry.resync()
    assert set(registry.workloads) == {
        SERVICE,
        f"{MANAGED}/train-0",
        "system.slice/cron.service",
    }
    assert registry.workloads[f"{MANAGED}/train-0"].kind is Kind.JOB


def test_a_workload_made_below_the_service_s_managed_root_is_seen_by_inotify(
    tmp_path: Path,
) -> None:
    (tmp_path / "system.slice/cron.service").mkdir(parents=True)
    registry = Registry(CgroupTree(str(tmp_path)), MANAGED, watch=True)
    registry.resync()
    assert set(registry.workloads) == {"system.slice/cron.service"}
    # the service starts, its agent makes the managed root, then a job appears in it
    (tmp_path / SERVICE).mkdir()
    assert registry.poll()
    (tmp_path / MANAGED).mkdir()
    registry.poll()
    (tmp_path / f"{MANAGED}/train-0").mkdir()
    (tmp_path / "system.slice/cron.service/child").mkdir()
    assert registry.poll()
    assert set(registry.workloads) == {"system.slice/cron.service", SERVICE, f"{MANAGED}/train-0"}
    assert f"{MANAGED}/train-0" in registry.new
