"""Notice that the policy file was replaced, for `agent.reload_on_change`.

A ConfigMap mounted as a volume is updated by the kubelet with an atomic swap of a
symlink (`..data`) to a new directory, so the file's path stays and its inode changes;
an editor's save or an `install` changes the inode or the mtime. Polling stat() once a
tick catches all of them at the cost of one system call, and needs no inotify watch
(which a symlink swap would leave pointing at the old directory).
"""

from __future__ import annotations

import os

Signature = tuple[int, int, int, int]


def signature(path: str) -> Signature | None:
    """The file as stat() sees it through symlinks: device, inode, mtime and size; None
    while it is missing or unreadable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class FileWatch:
    """Says once per change that the file at `path` is not the one last seen."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = signature(path)

    def changed(self) -> bool:
        """True when the file differs from the last call's (or the start's). A file that is
        gone is not a change: it is looked at again when it is back."""
        now = signature(self.path)
        if now is None or now == self._seen:
            return False
        self._seen = now
        return True
