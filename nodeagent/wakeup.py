"""How signals and other threads reach the daemon's loop without a lock.

A Python signal handler runs in the main thread between two bytecodes of whatever it
interrupted: inside `threading.Event.set()` (its condition's lock held), inside a logger's
`print` (structlog's per-file lock held). A handler that takes either lock again waits on
itself for good, and SIGTERM, whose handler would run in that same thread, is ignored from
then on. So the handlers here only set a plain attribute; the loop learns of it through a
socket pair its select() waits on: `signal.set_wakeup_fd` makes the interpreter's C-level
handler write the signal's number there the moment it arrives, before any Python code runs,
and another thread (a test stopping an agent it runs) writes one byte itself. The loop logs.
"""

from __future__ import annotations

import contextlib
import signal
import socket


class Wakeup:
    """The read end is what the loop's select() waits on; any byte on it means: look again."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        for end in (self._read, self._write):
            end.setblocking(False)  # a full buffer drops the byte: a wake-up is pending already

    def fileno(self) -> int:
        return self._read.fileno()

    def poke(self) -> None:
        with contextlib.suppress(OSError):
            self._write.send(b"\0")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            while self._read.recv(4096):
                pass

    def on_signals(self) -> None:
        """Have the interpreter write each signal's number here as it arrives (main thread
        only: the wake-up fd is the process's)."""
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)

    def close(self) -> None:
        self._read.close()
        self._write.close()


class Flag:
    """A flag for a signal handler or another thread to set and the loop to read: `set` is an
    attribute store and a non-blocking send, taking no lock, so it is safe in a handler
    whatever the main thread was doing. `threading.Event`'s interface, less `wait`."""

    def __init__(self, wakeup: Wakeup) -> None:
        self._wakeup = wakeup
        self._set = False

    def set(self) -> None:
        self._set = True
        self._wakeup.poke()

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False
