"""Is there a usable cgroup v2 hierarchy, and if not, exactly what is missing?

Hosts booted with the hybrid layout mount v1 hierarchies at /sys/fs/cgroup and
bind cpu and memory to them, leaving a near-empty v2 tree at .../unified. The
agent must refuse such a host before it writes anything, with a message that
tells the operator which controller is held where.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from nodeagent.cgroupfs import parse
from nodeagent.errors import CgroupUnavailable

REQUIRED = ("cpu", "memory")
_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo escapes space, tab, newline and backslash


@dataclass(frozen=True, slots=True)
class Mount:
    point: str
    fstype: str
    options: frozenset[str]


@dataclass(frozen=True, slots=True)
class CgroupHost:
    root: str
    controllers: frozenset[str]


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        mounts.append(
            Mount(point, tail[0], frozenset(tail[2].split(",")) if len(tail) > 2 else frozenset())
        )
    return mounts


def _mount_of(path: str, mounts: Iterable[Mount]) -> Mount | None:
    best: Mount | None = None
    for m in mounts:
        inside = path == m.point or path.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except OSError:
        return None


def detect(root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> CgroupHost:
    """Return the v2 root and its controllers, or raise naming what is missing."""
    root = os.path.realpath(root)
    mountinfo = _read(os.path.join(proc_root, "self/mountinfo"))
    if mountinfo is None:
        raise CgroupUnavailable(f"cannot read {proc_root}/self/mountinfo to find the cgroup mounts")
    mounts = parse_mountinfo(mountinfo)
    mount = _mount_of(root, mounts)
    v1_holders = {
        ctrl: m.point
        for m in mounts
        if m.fstype == "cgroup"
        for ctrl in m.options
        if ctrl in REQUIRED
    }
    if mount is None or mount.fstype != "cgroup2":
        held = "; ".join(f"{c} is bound to cgroup v1 at {p}" for c, p in sorted(v1_holders.items()))
        others = [
            f"the v2 hierarchy at {m.point} offers only: {_offered(m.point) or 'no controllers'}"
            for m in mounts
            if m.fstype == "cgroup2"
        ]
        kind = mount.fstype if mount else "not mounted"
        detail = "; ".join(x for x in [held, *others] if x)
        raise CgroupUnavailable(
            f"{root} is not a cgroup v2 mount ({kind})"
            + (f": {detail}" if detail else "")
            + "; nodeagent needs cgroup v2 with cpu and memory: boot with"
            " systemd.unified_cgroup_hierarchy=1, or pass --cgroup-root at a cgroup2 mount"
        )
    text = _read(os.path.join(root, "cgroup.controllers"))
    available = parse.controllers(text or "")
    missing = [c for c in REQUIRED if c not in available]
    if missing:
        why = ", ".join(
            f"{c} (bound to cgroup v1 at {v1_holders[c]})" if c in v1_holders else c
            for c in missing
        )
        raise CgroupUnavailable(f"cgroup v2 at {root} lacks the controllers nodeagent needs: {why}")
    return CgroupHost(root, available)


def _offered(point: str) -> str:
    return " ".join(
        sorted(parse.controllers(_read(os.path.join(point, "cgroup.controllers")) or ""))
    )
