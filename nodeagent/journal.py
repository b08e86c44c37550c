"""journald, spoken to directly: whether stderr is its stream, and its native protocol.

Apart from the logging set-up (nodeagent.logs) so that `nodeagent validate`, which needs only
the first answer, does not import structlog (and asyncio with it): every CLI start pays for
what it imports, ExecStartPre= too.

The native protocol (systemd's "Native Journal Protocol"; what sd_journal_send(3) speaks) is
one datagram per entry on /run/systemd/journal/socket: `FIELD=value` lines, or, for a value
that holds a newline, the field's name, a newline, the value's length as a little-endian
64-bit integer, the value and a newline. An entry too large for a datagram goes as a sealed
memfd passed with SCM_RIGHTS, as sd_journal_sendv() does.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
import re
import socket
import struct
import sys
from collections.abc import Iterable

from nodeagent.errors import NodeagentError

SOCKET = "/run/systemd/journal/socket"
"""journald's socket for native entries (systemd-journald.service(8))."""

SEND_TIMEOUT = 1.0
"""Seconds one entry may wait for journald (its queue full, the journal being rotated)
before the caller is told, so that the loop never waits on its log for long."""

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_TOO_LARGE = (errno.EMSGSIZE, errno.ENOBUFS)
_NOT_A_NAME = re.compile(r"[^A-Z0-9_]")


def stderr_is_the_journal() -> bool:
    """Whether fd 2 is the stream systemd connected to journald: $JOURNAL_STREAM holds its
    device and inode (systemd.exec(5)); a child whose stderr was redirected inherits the
    variable but not the stream, and must not prefix."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured, closed)
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2}
"""syslog(3) priorities by level name; an unknown name is logged as info (6)."""


def prefixed(level: str, line: str) -> str:
    """`line` behind its `<N>` priority prefix (sd-daemon(3)): how journald files a line
    written to a stream at the level's priority."""
    return f"<{PRIORITY.get(level, 6)}>{line}"


FORMATS = ("auto", "journal", "json", "console")
"""The choices of --log-format; `auto` picks one of the others by where stderr goes."""


def choose_format(fmt: str = "auto") -> str:
    """journal, json or console: `fmt` itself, or for `auto` the one for where stderr goes.
    A journal that cannot be reached is an error when asked for by name, json for `auto`."""
    if fmt not in FORMATS:
        raise NodeagentError(f"unknown log format {fmt!r}; use {', '.join(FORMATS)}")
    if fmt == "journal" and not os.path.exists(SOCKET):
        raise NodeagentError(
            f"--log-format journal: no journald socket at {SOCKET}"
            " (use json, or auto, which picks json where there is no journal)"
        )
    if fmt != "auto":
        return fmt
    if stderr_is_the_journal() and os.path.exists(SOCKET):
        return "journal"
    return "console" if sys.stderr.isatty() else "json"


def field_name(key: str, prefix: str = "NODEAGENT_") -> str:
    """A journal field's name for one of our record's keys: `path` is NODEAGENT_PATH. Names
    are upper case letters, digits and underscores, at most 64 of them, and never start with
    "_" (those are journald's trusted fields); the prefix keeps ours apart from the fields
    journald and journalctl give a meaning to (MESSAGE, PRIORITY, UNIT, ERRNO, ...)."""
    return (prefix + _NOT_A_NAME.sub("_", key.upper()))[:64]


def encode(fields: Iterable[tuple[str, str]]) -> bytes:
    """One journal entry in the native protocol. Values are UTF-8, bytes that were not
    (a cgroup name's, kept by surrogateescape) as they were."""
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", "surrogateescape")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


class Journal:
    """A datagram socket to journald, opened once and shared by every thread (a datagram is
    sent whole or not at all). send() raises OSError when journald does not take the entry
    within SEND_TIMEOUT: the caller decides where it goes instead."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(SEND_TIMEOUT)

    def send(self, entry: bytes) -> None:
        try:
            self._sock.sendto(entry, self.path)
        except OSError as e:
            if e.errno not in _TOO_LARGE:
                raise
            self._send_as_memfd(entry)

    def _send_as_memfd(self, entry: bytes) -> None:
        """An entry larger than a datagram: written to a memfd, sealed so that journald can
        map it knowing it will not change, and passed as a descriptor."""
        fd = os.memfd_create("nodeagent-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(entry)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            self._sock.sendmsg([], rights, 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()
