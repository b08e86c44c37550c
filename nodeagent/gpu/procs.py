"""Which cgroup a GPU process runs in: the '0::' line of /proc/<pid>/cgroup.

NVML reports host PIDs; this is how a process on a GPU is tied to a workload.
"""

from __future__ import annotations

import os


def cgroup_v2_path(text: str) -> str | None:
    """The cgroup v2 path in a /proc/<pid>/cgroup file, relative to the root ('' for the
    root itself); None when the file has no v2 line (a pure cgroup v1 host)."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip().strip("/")
    return None


def cgroup_of(pid: int, proc_root: str = "/proc") -> str | None:
    """The cgroup v2 path of a process, or None when it has exited or cannot be read."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup"), encoding="utf-8") as f:
            return cgroup_v2_path(f.read(65536))
    except (OSError, UnicodeDecodeError):
        return None
