"""Whether a daemon runs on a state file: the mark `nodeagent release` refuses on.

A running agent applies its policy again at its next tick and saves the originals it
remembers, so a release beside it would be undone. Asking the API socket does not tell:
a daemon run with `--no-api`, or `--socket` elsewhere, answers on no socket the policy
names. So the daemon's loop holds a shared flock on the state file's directory for as long
as it runs (the kernel drops it when the process ends, however it ends; the directory,
because the state file is replaced whole at each save, and a lock file would be left
behind), and release asks for that lock exclusively: refused while any agent holds it.
Shared, so that two agents over one state file (a test's restart) do not stop each other.
"""

from __future__ import annotations

import errno
import fcntl
import os

import structlog

log = structlog.get_logger("nodeagent")


def lock_path(state_file: str) -> str:
    """What is locked: the directory the state file is saved in."""
    return os.path.dirname(os.path.abspath(state_file))


def hold(state_file: str) -> int | None:
    """Mark the state file in use for as long as the returned descriptor stays open (None:
    the mark could not be made, which is logged; the daemon runs anyway)."""
    path = lock_path(state_file)
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)  # as the first save would
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        log.warning("state.lock_failed", directory=path, error=e.strerror or str(e),
                    action="running; `nodeagent release` cannot tell that it does")  # fmt: skip
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a release looks (open, try, close)
    return fd


def held(state_file: str) -> bool:
    """Whether an agent holds the state file's mark now."""
    try:
        fd = os.open(lock_path(state_file), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # no agent ever saved there
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing drops our own lock too
    return False
