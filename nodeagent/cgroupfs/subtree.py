"""Prepare the subtree nodeagent owns: create it and enable cpu and memory down to it, and
pids where the host offers it.

cgroup v2 only lets a cgroup hand controllers to its children through
cgroup.subtree_control, and (below the root) only while it holds no processes
itself: the no-internal-processes rule. So each ancestor, top-down, enables the
controllers, and a busy ancestor is reported by name instead of failing later.

pids is what a job's pids.max needs, in the managed root whose children the jobs are:
without it a job's process left its user slice's TasksMax behind for a managed root with
none. A host whose kernel or container does not offer it still runs the agent; a job that
needs a pids.max is then refused (its limits are not in place), said there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nodeagent.cgroupfs import parse
from nodeagent.cgroupfs.paths import split_path
from nodeagent.cgroupfs.tree import AuditFn, CgroupTree, CgroupVanished, CgroupWriteError
from nodeagent.errors import NodeagentError


def ensure_managed_root(
    tree: CgroupTree,
    managed_root: str,
    controllers: Sequence[str],
    audit: AuditFn,
    optional: Sequence[str] = (),
) -> None:
    """Make the managed root and enable `controllers` on the way down to it, and each of
    `optional` where the level offers it (its cgroup.controllers: what its parent enabled),
    so as deep as the host allows; a required one that cannot be enabled is an error."""
    parts = split_path(managed_root)
    for depth in range(len(parts) + 1):
        path = "/".join(parts[:depth])
        if depth and parts[depth - 1].endswith(UNIT_SUFFIXES):
            _require_unit(tree, path, managed_root)
        elif depth and tree.mkdir(path):
            audit(tree.path_of(path), "mkdir", None, "cgroup", "create the managed subtree")
        with tree.open(path) as d:
            enabled = parse.controllers(d.read("cgroup.subtree_control"))
            offered = parse.controllers(d.read_optional("cgroup.controllers") or "")
            wanted = [*controllers, *(c for c in optional if c in offered)]
            missing = [c for c in wanted if c not in enabled]
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


UNIT_SUFFIXES = (".service", ".scope")
"""Cgroups only systemd makes, for a running unit: the agent never makes one by hand."""


def _require_unit(tree: CgroupTree, path: str, managed_root: str) -> None:
    """A managed root below a unit (the packaged nodeagent-workloads.service) needs that
    unit running: a directory made in its place would be an unmanaged look-alike in
    systemd's tree that holds the jobs while systemd calls the unit dead (issue 36)."""
    try:
        with tree.open(path):
            return
    except CgroupVanished:
        pass
    unit = path.rsplit("/", 1)[-1]
    start = f"systemctl start {unit}; " if unit.endswith(".service") else ""
    raise NodeagentError(
        f"agent.managed_root {managed_root} is inside {tree.path_of(path)}, the cgroup of the"
        f" systemd unit {unit}, which is not running: {start}or, for an agent run by hand,"
        " set agent.managed_root to a cgroup of its own such as nodeagent.slice"
    )


def own_cgroup(proc_root: str = "/proc") -> str:
    """This process's cgroup v2 path, relative to the root ('' for the root itself)."""
    path = os.path.join(proc_root, "self/cgroup")
    try:  # read raw, in one call: the self-guard asks at every apply, the fast path's too
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 1 << 16).decode()
        finally:
            os.close(fd)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise NodeagentError(f"cannot read {path}: {why}") from e
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip().strip("/")
    raise NodeagentError(f"{path} has no cgroup v2 entry")


def leave_managed_path(tree: CgroupTree, managed_root: str, proc_root: str, audit: AuditFn) -> None:
    """Step out of the way when our own cgroup sits above the managed root.

    Under systemd with Delegate=yes the agent starts in its service's cgroup and
    manages a subtree below it; the no-internal-processes rule then forbids
    enabling controllers there while the agent itself lives in it. systemd's
    delegation guide asks the service to move itself into a leaf, so it does:
    into `<own cgroup>/agent`.
    """
    own = own_cgroup(proc_root)
    if not own or not managed_root.startswith(own + "/"):
        return
    leaf = own + "/agent"
    if tree.mkdir(leaf):
        audit(tree.path_of(leaf), "mkdir", None, "cgroup", "a leaf for the agent itself")
    with tree.open(leaf) as d:
        d.write("cgroup.procs", "0")
    audit(
        tree.path_of(leaf) + "/cgroup.procs",
        "cgroup.procs",
        own,
        leaf,
        f"leave {own} so controllers can be enabled below it for {managed_root}",
    )
