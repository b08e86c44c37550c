"""A listening Unix socket whose mode and group are fixed before anyone can connect.

Shared by the API and the metrics endpoint (`agent.metrics.listen: unix:PATH`). Between
bind() and listen() every connect() is refused, so setting the mode and group there leaves
no window with looser permissions. A socket left by a dead daemon is replaced; a live one,
or a path that is not a socket, is refused in one line.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat

import structlog

from nodeagent.errors import NodeagentError

log = structlog.get_logger("nodeagent.api")

SOCKET_MODE = 0o660
DIR_MODE = 0o750

Identity = tuple[int, int]
"""(st_dev, st_ino) of the socket file this process bound."""


def resolve_group(name: str, what: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise NodeagentError(f"unknown group {name!r} for {what}") from None


def listen_unix(path: str, gid: int | None, what: str) -> tuple[socket.socket, Identity]:
    """Bind `path` mode 0660 (group `gid` when given) and listen, non-blocking."""
    _ensure_parent(os.path.dirname(os.path.abspath(path)) or "/", gid, what)
    _clear_stale(path, what)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
    except OSError as exc:
        listener.close()
        raise NodeagentError(f"cannot bind {what} {path}: {exc.strerror or exc}") from exc
    try:
        st = os.stat(path)
        os.chmod(path, SOCKET_MODE)
        if gid is not None:
            os.chown(path, -1, gid)
        # The kernel caps this at net.core.somaxconn: a burst of callers queues there.
        listener.listen(socket.SOMAXCONN)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise NodeagentError(f"cannot set up {what} {path}: {exc.strerror or exc}") from exc
    return listener, (st.st_dev, st.st_ino)


def unlink_if_ours(path: str, identity: Identity | None) -> None:
    """Remove the socket file unless someone else has replaced it since."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _ensure_parent(parent: str, gid: int | None, what: str) -> None:
    """Create the socket's directory 0750 if missing; an existing one is the operator's choice.

    A directory we create also gets the socket's group, else group members could not reach
    the socket through it.
    """
    if os.path.isdir(parent):
        _give_the_unit_directory_the_group(parent, gid, what)
        return
    try:
        os.makedirs(parent, exist_ok=True)
        os.chmod(parent, DIR_MODE)
        if gid is not None:
            os.chown(parent, -1, gid)
    except OSError as exc:
        raise NodeagentError(
            f"cannot create {what} directory {parent}: {exc.strerror or exc}"
        ) from exc


def _give_the_unit_directory_the_group(parent: str, gid: int | None, what: str) -> None:
    """systemd makes a unit's `RuntimeDirectory=` (the shipped unit's /run/nodeagent) in the
    service's own group, root's, mode 0750: the socket group's members could not reach the
    socket through it. That directory is made for this service alone (systemd names it in
    $RUNTIME_DIRECTORY), so it gets the socket's group; any other is the operator's choice."""
    ours = os.environ.get("RUNTIME_DIRECTORY", "").split(":")
    if gid is None or os.path.abspath(parent) not in {os.path.abspath(d) for d in ours if d}:
        return
    try:
        if os.stat(parent).st_gid != gid:
            os.chown(parent, -1, gid)
            log.info("api.directory_group", directory=parent, gid=gid, why=f"{what}'s group")
    except OSError as exc:
        raise NodeagentError(
            f"cannot give {what} directory {parent} its group: {exc.strerror or exc}"
        ) from exc


def _clear_stale(path: str, what: str) -> None:
    """Remove a socket left by a dead daemon; refuse to touch a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise NodeagentError(f"refusing to bind {what}: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: stale
        except OSError as exc:
            raise NodeagentError(
                f"cannot tell whether {path} is in use ({exc.strerror or exc}); "
                "remove it if no nodeagent is running"
            ) from exc
        else:
            raise NodeagentError(f"another nodeagent is already serving on {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    log.info("api.stale_socket_removed", socket=path)
