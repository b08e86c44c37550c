"""A server's process out of file descriptors while a client waits to be accepted: how
often the server's accept loop tries meanwhile (it must back off, then recover)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from typing import Any

import pytest


def accept_tries_while_out_of_fds(
    monkeypatch: pytest.MonkeyPatch, sock: socket.socket, address: Any
) -> int:
    """Connect `sock` (made while descriptors last) to `address` once this process has none
    left, so that the server's accept() fails with EMFILE; 1.5 s later give them back. The
    accept() calls made in that time."""
    accepts = [0]
    real_accept = socket.socket.accept

    def counting_accept(self: socket.socket) -> tuple[socket.socket, Any]:
        accepts[0] += 1
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", counting_accept)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        sock.connect(address)
        time.sleep(1.5)
        return accepts[0]
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
