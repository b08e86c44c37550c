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


# -- a user's delegated subtree (user@N.service has Delegate=yes) ------------------------------
USER = "user.slice/user-1000.slice/user@1000.service"
OTHER = "user.slice/user-1001.slice/user@1001.service"
ROOTLESS = f"{OTHER}/user.slice/libpod-{CID}.scope"
CAP = 1024
"""The cgroups looked at below one user manager, as docs/architecture.md documents it."""


class _Counting(CgroupTree):
    """A fixture tree that counts the directories opened: the walk's cost, without a clock."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.opened = 0

    @contextmanager
    def open(self, path: str) -> Iterator[CgroupDir]:
        self.opened += 1
        with super().open(path) as d:
            yield d


def kernel_watches(registry: Registry) -> int:
    """The inotify watches the kernel holds for the registry (its fdinfo, one line each)."""
    fd = registry.fileno()
    assert fd is not None
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    return sum(line.startswith("inotify wd:") for line in text.splitlines())


def users_tree(root: Path, flood: list[str]) -> Path:
    """Root's service, user 1001's rootless container, and user 1000's `flood`."""
    for p in ["system.slice/cron.service", ROOTLESS, USER, *(f"{USER}/{f}" for f in flood)]:
        (root / p).mkdir(parents=True, exist_ok=True)
    return root


def test_plain_directories_in_a_users_subtree_are_neither_walked_nor_watched(
    tmp_path: Path,
) -> None:
    """Issue 12.19: 20,100 empty directories below user@1000.service cost 20,104 watches.
    Only slices can hold a workload below a user manager, so none of these is walked."""
    tree = _Counting(
        str(users_tree(tmp_path, [f"d{i}/e{j}" for i in range(50) for j in range(40)]))
    )
    registry = Registry(tree, "nodeagent.slice", watch=True)
    registry.resync()
    assert set(registry.workloads) == {"system.slice/cron.service", ROOTLESS}
    watches = kernel_watches(registry)
    assert watches <= 10, f"{watches} watches: one in every plain directory"
    assert tree.opened <= 10


def test_a_flood_of_slices_in_a_users_subtree_is_capped_and_named_once(tmp_path: Path) -> None:
    """Slices may hold workloads, so they are walked, up to the cap; what is over it is
    neither walked nor watched, the subtree is named once, and other users' and root's
    workloads are found as before."""
    tree = _Counting(str(users_tree(tmp_path, [f"s{i}.slice" for i in range(CAP + 200)])))
    registry = Registry(tree, "nodeagent.slice", watch=True)
    with structlog.testing.capture_logs() as logs:
        registry.resync()
        registry.resync()
    assert set(registry.workloads) == {"system.slice/cron.service", ROOTLESS}
    assert kernel_watches(registry) <= CAP + 10
    assert tree.opened <= 2 * (CAP + 10), "two resyncs"
    assert list(registry.problems) == [USER]
    assert "the rest of this user's subtree is not looked at" in registry.problems[USER]
    assert [(e["event"], e["cgroup"]) for e in logs] == [("discovery.skipped", USER)]


def test_slices_made_after_the_resync_are_capped_too_and_a_removal_gives_room(
    tmp_path: Path,
) -> None:
    registry = Registry(CgroupTree(str(users_tree(tmp_path, []))), "nodeagent.slice", watch=True)
    registry.resync()
    before = kernel_watches(registry)
    with structlog.testing.capture_logs() as logs:
        for i in range(CAP + 200):
            (tmp_path / USER / f"s{i}.slice").mkdir()
            if i % 100 == 0:
                registry.poll()  # inotify's queue holds 16384 events: keep well below it
        registry.poll()
    assert kernel_watches(registry) <= before + CAP
    assert list(registry.problems) == [USER]
    assert [(e["event"], e["cgroup"]) for e in logs] == [("discovery.skipped", USER)]

    # the user removes some: the room they took is theirs again, at once
    for i in range(300):
        (tmp_path / USER / f"s{i}.slice").rmdir()
    registry.poll()
    watched = kernel_watches(registry)
    container = f"{USER}/user.slice/libpod-{'cd' * 32}.scope"
    (tmp_path / container).mkdir(parents=True)
    registry.poll()
    assert container in registry.workloads
    assert kernel_watches(registry) == watched + 1  # user.slice, not the scope


def test_all_users_subtrees_together_are_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nodeagent.discovery import scan

    monkeypatch.setattr(scan, "MAX_PER_SUBTREE", 5)
    monkeypatch.setattr(scan, "MAX_DELEGATED", 12)
    users = [f"user.slice/user-{n}.slice/user@{n}.service" for n in (1000, 1001, 1002)]
    for user in users:
        for i in range(6):
            (tmp_path / user / f"s{i}.slice").mkdir(parents=True)
    registry = Registry(CgroupTree(str(tmp_path)), "nodeagent.slice", watch=True)
    registry.resync()
    below = [p for p in registry.watched() if p.startswith(tuple(users))]
    assert len(below) == 12
    assert registry.problems == {
        users[0]: "more than 5 cgroups: the rest of this user's subtree is not looked at",
        users[1]: "more than 5 cgroups: the rest of this user's subtree is not looked at",
        users[2]: "users' subtrees hold more than 12 cgroups in all:"
        " the rest of this user's subtree is not looked at",
    }
