"""A STAND-IN for the Docker Engine API, for the answers no real runtime gives: 10,000 labels,
a 1 MiB label value, invalid UTF-8, a socket that accepts and never answers, a connection
dropped mid-answer. It is not Docker: it serves only what nodeagent's adapter asks
(`GET /containers/{id}/json`, `GET /events`), each container's answer as the test sets it.
Used by the unit tests and by the real-kernel test of hostile answers (labelled there)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

HANG = "hang"
RESET = "reset"


@dataclass
class StandInDocker:
    path: str
    answers: dict[str, object] = field(default_factory=dict)
    """Per container id: a dict (sent as JSON), bytes (sent as they are), HANG or RESET."""
    hang_all: bool = False
    events: list[dict[str, object]] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            socket.socket(socket.AF_UNIX).connect(self.path)  # wakes accept()
        self.thread.join(timeout=5)
        self.sock.close()
        for held in self._held:
            held.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self._stop.is_set():
                conn.close()
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        if self.hang_all:
            self._held.append(conn)  # accepted, never answered
            return
        data = b""
        conn.settimeout(10)
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        target = data.split(b" ", 2)[1].decode() if data.count(b" ") >= 2 else "/"
        self.requests.append(target)
        if target.startswith("/events"):
            body = b"".join(json.dumps(e).encode() + b"\n" for e in self.events)
            self.events.clear()
            return self._send(conn, 200, body)
        cid = target.split("/")[2] if target.startswith("/containers/") else ""
        answer = self.answers.get(cid)
        if answer == HANG:
            self._held.append(conn)
            return None
        if answer == RESET:
            with contextlib.suppress(OSError):
                conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"Id": ')
            conn.close()
            return None
        if answer is None:
            return self._send(conn, 404, b'{"message": "No such container"}')
        if isinstance(answer, bytes):
            return self._send(conn, 200, answer)
        return self._send(conn, 200, json.dumps(answer, ensure_ascii=False).encode())

    @staticmethod
    def _send(conn: socket.socket, status: int, body: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        with contextlib.suppress(OSError):
            conn.sendall(head.encode() + body)
        conn.close()


def container(cid: str, name: str, image: str, labels: dict[str, str]) -> dict[str, object]:
    """An answer shaped as dockerd's own (the fields the adapter reads, and a few more)."""
    return {
        "Id": cid,
        "Name": "/" + name,
        "Image": "sha256:" + "0" * 64,
        "Config": {"Image": image, "Labels": labels, "Env": ["PATH=/bin"]},
        "State": {"Running": True},
    }


@contextlib.contextmanager
def standin(path: str) -> Iterator[StandInDocker]:
    server = StandInDocker(path)
    try:
        yield server
    finally:
        server.close()
