"""Other users on the end of a socket: forked children that take on given credentials.

The children never return into pytest (they end with os._exit); what they report comes
back through a pipe. Root only: setuid needs it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Iterator


def as_user(uid: int, gid: int, groups: list[int], action: Callable[[], str]) -> str:
    """Run `action` in a forked child with the given credentials; return what it reports."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(read_end)
            try:
                os.setgroups(groups)
                os.setgid(gid)
                os.setuid(uid)
                result = action()
            except BaseException as exc:
                result = f"{type(exc).__name__}: {exc}"
            os.write(write_end, result.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read().decode()
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    return output


@contextlib.contextmanager
def held_as(uid: int, gid: int, target: str | tuple[str, int], count: int) -> Iterator[int]:
    """A child with these credentials holds `count` connections to `target` (a Unix
    socket's path, or a TCP address) open and sends nothing on them; yields how many the
    kernel took. They close when the block ends."""
    if isinstance(target, str):
        family = socket.AF_UNIX
    else:
        family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(ready_r)
            os.close(stop_w)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            held = []
            for _ in range(count):
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                if sock.connect_ex(target) not in (0, errno.EINPROGRESS):
                    sock.close()  # the listen queue is full
                    break
                held.append(sock)
            os.write(ready_w, str(len(held)).encode())
            os.read(stop_r, 1)  # until the parent closes its end
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(stop_r)
    try:
        yield int(os.read(ready_r, 16) or b"0")  # the child's count comes as one write
    finally:
        os.close(ready_r)
        os.close(stop_w)
        os.waitpid(pid, 0)
