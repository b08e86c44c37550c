"""Relative cgroup paths, checked: pure, so that what only validates a path (the policy
loader, discovery's layouts, the API's bodies) need not import the code that opens cgroups
(`tree`).
"""

from __future__ import annotations

from nodeagent.errors import UnsafePath


def split_path(path: str) -> tuple[str, ...]:
    """Components of a relative cgroup path; refuses anything that could escape the root."""
    if path in ("", "/"):
        return ()
    if path.startswith("/") or "\0" in path:
        raise UnsafePath(f"cgroup path {path!r} must be relative to the cgroup root")
    parts = tuple(path.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"cgroup path {path!r} has an empty, '.' or '..' component")
    return parts
