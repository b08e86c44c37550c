"""Walk the cgroup tree and classify what it finds.

The walk descends through slices, QoS tiers and pods, where workloads live,
and stops at a workload (a container's, a service's or a job's own children
are its business). It also returns the directories it walked, which are where
new workloads can appear and so where inotify watches go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodeagent.cgroupfs.tree import CgroupTree, CgroupVanished
from nodeagent.discovery.layouts import classify
from nodeagent.errors import NodeagentError, one_line
from nodeagent.identity import Kind, WorkloadIdentity

MAX_DEPTH = 8


@dataclass
class ScanResult:
    workloads: dict[str, WorkloadIdentity] = field(default_factory=dict)
    parents: list[str] = field(default_factory=list)
    """Cgroups below which workloads may appear: the places to watch."""
    problems: dict[str, str] = field(default_factory=dict)
    """Directories that could not be read (permissions) and symlinks met, with why; skipped."""


def descends(identity: WorkloadIdentity | None, path: str, managed_root: str) -> bool:
    """Whether workloads may sit below `path`: not below a workload, except a pod's
    containers and the managed root below the agent's own service (Delegate=yes)."""
    return identity is None or identity.kind is Kind.POD or managed_root.startswith(path + "/")


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def scan(
    tree: CgroupTree, managed_root: str, start: str = "", into: ScanResult | None = None
) -> ScanResult:
    """Scan below `start` (the root by default), adding to `into` when given."""
    result = into if into is not None else ScanResult()
    stack = [(start, start.count("/") + 1 if start else 0)]
    while stack:
        path, depth = stack.pop()
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
        for name in sorted(children, reverse=True):
            child = join(path, name)
            identity = classify(child, managed_root)
            if identity is not None:
                result.workloads[child] = identity
            if descends(identity, child, managed_root) and depth < MAX_DEPTH:
                stack.append((child, depth + 1))
    return result
