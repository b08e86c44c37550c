"""The set of known workloads, kept current by inotify and a periodic full resync.

inotify on the cgroup directories gives a new cgroup its policy within one
loop wake-up instead of one resync period; the resync is the safety net for
anything inotify can miss (queue overflow, a watch that raced a mkdir).
"""

from __future__ import annotations

import contextlib
import errno

import structlog
from inotify_simple import INotify, flags

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.discovery.layouts import classify
from nodeagent.discovery.scan import Budget, ScanResult, descends, join, scan
from nodeagent.identity import WorkloadIdentity

log = structlog.get_logger("nodeagent.discovery")

_MASK = flags.CREATE | flags.DELETE | flags.DELETE_SELF | flags.ONLYDIR | flags.DONT_FOLLOW


class Registry:
    def __init__(self, tree: CgroupTree, managed_root: str, watch: bool = True) -> None:
        self.tree = tree
        self.managed_root = managed_root
        self.workloads: dict[str, WorkloadIdentity] = {}
        self.problems: dict[str, str] = {}
        """What the last scan skipped (directories it could not read, symlinks), with why;
        logged once each, shown by `workloads`."""
        self._logged: dict[str, str] = {}
        self.new: list[str] = []
        """Workloads inotify reported since the daemon last took them (its fast path)."""
        self.gone: list[str] = []
        """Directories removed (inotify) and workloads a scan no longer found, since the loop
        last took them: what the agent recorded of them (originals) goes with them."""
        self.resynced = False
        """A resync replaced the set since the daemon last looked (an event queue overflow)."""
        self._inotify = INotify() if watch else None
        self._wd_path: dict[int, str] = {}
        self._path_wd: dict[str, int] = {}
        self._unwatched: set[str] = set()  # watches that failed, logged once each
        self._budget = Budget()
        """The cgroups below user managers looked at since the last resync (scan.Budget)."""

    def fileno(self) -> int | None:
        return None if self._inotify is None else self._inotify.fileno()

    def resync(self) -> None:
        """Full scan: replaces the known set, and watches every place workloads can appear."""
        result = scan(self.tree, self.managed_root)
        self.gone.extend(p for p in self.workloads if p not in result.workloads)
        self.workloads = result.workloads
        self.problems = result.problems
        self._log_problems()
        live = set(result.parents)
        for path in [p for p in self._path_wd if p not in live]:
            self._unwatch(path)
        self._budget = result.budget
        for path in result.parents:
            self._watch(path)

    def poll(self) -> bool:
        """Apply pending inotify events without blocking; True when the workload set changed."""
        if self._inotify is None:
            return False
        changed = False
        for event in self._inotify.read(timeout=0):
            if event.mask & flags.Q_OVERFLOW:
                # events were lost, deletions and IN_IGNORED among them: start watching afresh
                self._reset_watches()
                self.resync()
                self.resynced = True
                return True
            parent = self._wd_path.get(event.wd)
            if parent is None:
                continue
            if event.mask & flags.IGNORED:
                self._forget(event.wd)
            elif event.mask & flags.CREATE and event.mask & flags.ISDIR:
                changed |= self._created(join(parent, event.name))
            elif event.mask & flags.DELETE and event.mask & flags.ISDIR:
                changed |= self._deleted(join(parent, event.name))
        return changed

    def _created(self, path: str) -> bool:
        if not self._budget.take(path, self.problems):
            self._log_problems()
            return False
        identity = classify(path, self.managed_root)
        before = len(self.workloads)
        if identity is not None:
            self.workloads[path] = identity
            self.new.append(path)
        if descends(identity, path, self.managed_root):
            # Watch first, then scan: a child made between the two is seen by one of them.
            self._watch(path)
            result = scan(
                self.tree, self.managed_root, start=path, into=ScanResult(budget=self._budget)
            )
            self.workloads.update(result.workloads)
            self.new.extend(result.workloads)
            self.problems.update(result.problems)
            for parent in result.parents:
                self._watch(parent)
            self._log_problems()
        return len(self.workloads) != before

    def _log_problems(self) -> None:
        """A skipped directory hides whatever is below it from the policy: say so once,
        and again should it come back after it was fixed."""
        for path, why in self.problems.items():
            if self._logged.get(path) != why:
                log.warning("discovery.skipped", cgroup=path, reason=why)
        self._logged = dict(self.problems)

    def _deleted(self, path: str) -> bool:
        self._budget.give_back(path)  # what was below it went first, each with its event
        self.gone.append(path)
        gone = [p for p in self.workloads if p == path or p.startswith(path + "/")]
        for p in gone:
            del self.workloads[p]
        for p in [p for p in self._path_wd if p == path or p.startswith(path + "/")]:
            self._unwatch(p)
        return bool(gone)

    def _reset_watches(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = INotify()
        self._wd_path.clear()
        self._path_wd.clear()

    def _watch(self, path: str) -> None:
        if self._inotify is None or path in self._path_wd:
            return
        try:
            wd = self._inotify.add_watch(self.tree.path_of(path), _MASK)
        except OSError as e:
            if e.errno != errno.ENOENT and path not in self._unwatched:
                # ENOENT: it vanished, and its deletion event says so.
                # ENOSPC (fs.inotify.max_user_watches) and the like: changes below this
                # directory are seen at the next resync only, and the sensor drops what it
                # finds gone meanwhile.
                log.warning(
                    "watch.failed",
                    cgroup=path,
                    error=e.strerror,
                    action="relying on the periodic resync for this directory",
                )
                self._unwatched.add(path)
            return
        self._unwatched.discard(path)
        self._wd_path[wd] = path
        self._path_wd[path] = wd

    def _unwatch(self, path: str) -> None:
        wd = self._path_wd.pop(path, None)
        if wd is None or self._inotify is None:
            return
        self._wd_path.pop(wd, None)
        with contextlib.suppress(OSError):  # the kernel already dropped it with the directory
            self._inotify.rm_watch(wd)

    def _forget(self, wd: int) -> None:
        path = self._wd_path.pop(wd, None)
        if path is not None:
            self._path_wd.pop(path, None)

    def track(self, path: str) -> None:
        """Add a workload made by the agent itself now, before inotify reports it."""
        identity = classify(path, self.managed_root)
        if identity is not None:
            self.workloads[path] = identity

    def forget(self, path: str) -> None:
        """Drop a workload that the sensor found gone, in case inotify missed its removal."""
        self.workloads.pop(path, None)

    def watched(self) -> set[str]:
        """The cgroups with an inotify watch."""
        return set(self._path_wd)

    def identities(self) -> list[WorkloadIdentity]:
        return list(self.workloads.values())
