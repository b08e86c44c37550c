"""Read a small file that must be a regular file, without ever blocking on one that is not;
and replace a file atomically.

The policy and the state file are named by the operator. A FIFO there would block open()
until a writer comes (a daemon wedged in its SIGHUP reload), /dev/zero never ends, and a
directory or a socket cannot be read at all. stat() refuses those before anything is opened;
the open is non-blocking and the opened descriptor is checked again with fstat(), so a FIFO
swapped in between cannot block either.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from nodeagent.errors import NodeagentError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class UnusableFile(NodeagentError):
    """The path names something other than a regular file, or no path at all; the message
    says what it is."""


def _check(mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    raise UnusableFile(f"it is {kind}, not a regular file")


def read_regular_file(path: str, limit: int) -> bytes:
    """At most `limit` + 1 bytes of the regular file at `path` (more than `limit` means the
    file is too large). Raises UnusableFile, or OSError as stat, open and read do."""
    if "\0" in path:
        raise UnusableFile("the path contains a NUL byte")
    _check(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check(os.fstat(fd).st_mode)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_atomically(path: str, text: str, *, prefix: str = ".nodeagent-") -> None:
    """Replace the file at `path` with `text` whole: a temp file in the same directory
    (hidden, so that directory's readers skip it), fsynced, renamed over the old one, and
    the directory fsynced, so that a crash leaves the old file or the new one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
