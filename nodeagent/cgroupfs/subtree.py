"""Prepare the subtree nodeagent owns: create it and enable cpu and memory down to it.

cgroup v2 only lets a cgroup hand controllers to its children through
cgroup.subtree_control, and (below the root) only while it holds no processes
itself: the no-internal-processes rule. So each ancestor, top-down, enables the
controllers, and a busy ancestor is reported by name instead of failing later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.tree import CgroupTree, CgroupWriteError, split_path
from nodeagent.errors import NodeagentError

AuditFn = Callable[[str, str, str | None, str, str], None]


def ensure_managed_root(
    tree: CgroupTree,
    managed_root: str,
    controllers: Sequence[str],
    audit: AuditFn,
) -> None:
    parts = split_path(managed_root)
    for depth in range(len(parts) + 1):
        path = "/".join(parts[:depth])
        if depth and tree.mkdir(path):
            audit(tree.path_of(path), "mkdir", None, "cgroup", "create the managed subtree")
        with tree.open(path) as d:
            enabled = parse.controllers(d.read("cgroup.subtree_control"))
            missing = [c for c in controllers if c not in enabled]
            if not missing:
                continue
            value = " ".join(f"+{c}" for c in missing)
            try:
                d.write("cgroup.subtree_control", value)
            except CgroupWriteError as e:
                procs = d.read("cgroup.procs").split()
                hint = (
                    f"; it holds processes {' '.join(procs[:5])}: move them into a leaf cgroup"
                    " (no-internal-processes rule)"
                    if procs and depth
                    else ""
                )
                raise NodeagentError(f"{e}{hint}") from e
            audit(
                tree.path_of(path) + "/cgroup.subtree_control",
                "cgroup.subtree_control",
                " ".join(sorted(enabled)),
                value,
                f"enable {', '.join(missing)} for the managed subtree {managed_root}",
            )
