"""Walk the cgroup tree and classify what it finds.

The walk descends only where a layout can place a workload (slices, QoS tiers, pods, the
runtimes' parents, the way to the managed root) and stops at a workload (a container's, a
service's or a job's own children are its business). It also returns the directories it
walked, which are where new workloads can appear and so where inotify watches go.

Below a user manager (user.slice/user-N.slice/user@N.service, Delegate=yes) user N makes
cgroups at will, so what the walk looks at there is capped: MAX_PER_SUBTREE cgroups in each
such subtree, MAX_DELEGATED in all of them together; the rest is neither classified, walked
nor watched, and the subtree is named in the problems. The walk is breadth first, so a cap
cuts the deepest cgroups, away from where rootless containers sit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.discovery.layouts import classify, delegated_root, may_hold
from nodeagent.errors import NodeagentError, one_line
from nodeagent.identity import Kind, WorkloadIdentity

MAX_DEPTH = 8
MAX_PER_SUBTREE: Final = 1024
"""Cgroups looked at below one user manager: each costs a classification per resync, and
an inotify watch where workloads may sit below it (slices: a user's, rootless pods')."""
MAX_DELEGATED: Final = 8192
"""The same, for all users' subtrees together."""


class Budget:
    """The cgroups below user managers that the walks have looked at; root's own tree is
    not counted. Each is counted once, until it is given back (removed)."""

    def __init__(self) -> None:
        self._taken: dict[str, set[str]] = {}
        self.total = 0

    def take(self, path: str, problems: dict[str, str]) -> bool:
        """Count the cgroup at `path`; False, with its subtree and why in `problems`, when
        that subtree's share or the users' total is spent."""
        subtree = delegated_root(path)
        if subtree is None:
            return True
        taken = self._taken.setdefault(subtree, set())
        if path in taken:
            return True
        if len(taken) >= MAX_PER_SUBTREE:
            why = f"more than {MAX_PER_SUBTREE} cgroups"
        elif self.total >= MAX_DELEGATED:
            why = f"users' subtrees hold more than {MAX_DELEGATED} cgroups in all"
        else:
            taken.add(path)
            self.total += 1
            return True
        problems[subtree] = f"{why}: the rest of this user's subtree is not looked at"
        return False

    def give_back(self, path: str) -> None:
        """The cgroup at `path` was removed."""
        subtree = delegated_root(path)
        taken = self._taken.get(subtree) if subtree is not None else None
        if taken is not None and path in taken:
            taken.discard(path)
            self.total -= 1


@dataclass
class ScanResult:
    workloads: dict[str, WorkloadIdentity] = field(default_factory=dict)
    parents: list[str] = field(default_factory=list)
    """Cgroups below which workloads may appear: the places to watch."""
    problems: dict[str, str] = field(default_factory=dict)
    """What was skipped, with why: directories that could not be read (permissions),
    symlinks met, and user subtrees over their cap."""
    budget: Budget = field(default_factory=Budget)
    """What the walk looked at below user managers; later walks charge the same one."""


def descends(identity: WorkloadIdentity | None, path: str, managed_root: str) -> bool:
    """Whether workloads may sit below `path`: where a layout places them (not below a
    workload, except a pod's containers), and on the way to the managed root, even through
    the agent's own service (Delegate=yes)."""
    if path == managed_root or managed_root.startswith(path + "/"):
        return True
    if identity is None:
        return may_hold(path)
    return identity.kind is Kind.POD


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def scan(
    tree: CgroupTree, managed_root: str, start: str = "", into: ScanResult | None = None
) -> ScanResult:
    """Scan below `start` (the root by default; a caller passing `start` has counted it),
    adding to `into` when given and charging its budget."""
    result = into if into is not None else ScanResult()
    queue = deque([(start, start.count("/") + 1 if start else 0)])
    while queue:
        path, depth = queue.popleft()
        try:
            with tree.open(path) as d:
                children, links = d.listing()
        except CgroupVanished:
            continue
        except NodeagentError as e:  # one unreadable directory must not hide the rest
            result.problems[path] = one_line(e)
            continue
        for name in links:
            result.problems[join(path, name)] = "a symlink (cgroupfs has none): not followed"
        result.parents.append(path)
        for name in sorted(children):
            child = join(path, name)
            if not result.budget.take(child, result.problems):
                break  # the rest of this directory lies in the same spent subtree
            identity = classify(child, managed_root)
            if identity is not None:
                result.workloads[child] = identity
            if depth < MAX_DEPTH and descends(identity, child, managed_root):
                queue.append((child, depth + 1))
    return result
