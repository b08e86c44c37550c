"""A STAND-IN for the Docker Engine API, for the answers no real runtime gives: 10,000 labels,
a 1 MiB label value, invalid UTF-8, a socket that accepts and never answers, a connection
dropped mid-answer. It is not Docker: it serves only what nodeagent's adapters ask (Docker's
container list filtered to one id, podman's `GET /containers/{id}/json`, `GET /events` polled
or streamed, both `_ping`s), each container's answer as the test sets it. As dockerd and
podman do, it holds an inspect of a container that is `starting` until the start is over;
Docker's list and the pings answer at once.
Used by the unit tests and by the real-kernel test of hostile answers (labelled there)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

HANG = "hang"
LIBPOD = "/v4.0.0/libpod"
"""podman's API: served alike (its inspect is shaped as Docker's, its `Name` without a slash)"""
RESET = "reset"


@dataclass
class StandInDocker:
    path: str
    answers: dict[str, object] = field(default_factory=dict)
    """Per container id: a dict (dockerd's inspect answer, sent as JSON; the list's entry is
    made from it as dockerd makes it), bytes (sent as they are), HANG or RESET."""
    starting: set[str] = field(default_factory=set)
    """Containers being started: their inspect is held (never answered here), as dockerd holds
    it until `runc start` is done."""
    hang_all: bool = False
    events: list[dict[str, object]] = field(default_factory=list)
    """Served to `GET /events` with `until` (a poll), then cleared."""
    requests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(64)
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._streams: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            socket.socket(socket.AF_UNIX).connect(self.path)  # wakes accept()
        self.thread.join(timeout=5)
        self.sock.close()
        for held in self._held + self._streams:
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
        if target.startswith("/events") and "until=" not in target:  # a stream, as dockerd's
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            self._streams.append(conn)  # before the head: the client may push once it has it
            with contextlib.suppress(OSError):
                conn.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            return None
        if target.startswith("/events"):
            body = b"".join(json.dumps(e).encode() + b"\n" for e in self.events)
            self.events.clear()
            return self._send(conn, 200, body)
        listed = urlsplit(target.removeprefix(LIBPOD))
        if listed.path == "/_ping":
            return self._send(conn, 200, b"OK")
        if listed.path == "/containers/json":  # dockerd's filter is a regexp found in the id
            pattern = json.loads(parse_qs(listed.query)["filters"][0])["id"][0]
            raw = [a for k, a in self.answers.items() if re.search(pattern, k)]
            answer = raw[0] if raw and not isinstance(raw[0], dict) else None
            if answer is None:
                answer = [listed_entry(a) for a in raw if isinstance(a, dict)]
        else:
            cid = listed.path.split("/")[2] if listed.path.startswith("/containers/") else ""
            answer = HANG if cid in self.starting else self.answers.get(cid)
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

    def push(self, data: dict[str, object] | bytes) -> None:
        """An event to each open `/events` stream, as dockerd sends one: a chunk holding a
        JSON object and a newline (bytes: sent as they are, unchunked)."""
        if isinstance(data, dict):
            line = json.dumps(data).encode() + b"\n"
            data = f"{len(line):x}\r\n".encode() + line + b"\r\n"
        for conn in self._streams:
            with contextlib.suppress(OSError):
                conn.sendall(data)

    def end_streams(self) -> None:
        """Close the open streams, as a dockerd that stops does."""
        for conn in self._streams:
            conn.close()
        self._streams.clear()

    @staticmethod
    def _send(conn: socket.socket, status: int, body: bytes) -> None:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        with contextlib.suppress(OSError):
            conn.sendall(head.encode() + body)
        conn.close()


def create_event(inspected: object) -> dict[str, object]:
    """dockerd's `create` event for a container, from its inspect answer, as moby makes it
    (`LogContainerEventWithAttributes`: the labels, then `image` and `name` written over them)."""
    assert isinstance(inspected, dict)
    config = inspected["Config"]
    assert isinstance(config, dict) and isinstance(inspected["Name"], str)
    attributes = dict(config["Labels"] or {})
    if config["Image"]:
        attributes["image"] = config["Image"]
    attributes["name"] = inspected["Name"].lstrip("/")
    cid = inspected["Id"]
    return {"status": "create", "id": cid, "from": config["Image"], "Type": "container",
            "Action": "create", "Actor": {"ID": cid, "Attributes": attributes},
            "scope": "local", "time": 1, "timeNano": 1}  # fmt: skip


def listed_entry(inspected: dict[str, object]) -> dict[str, object]:
    """The container list's entry for a container, from its inspect answer, as dockerd makes it
    (`Names` with the leading slash, `Image` as asked for, `Labels` from its Config)."""
    config = inspected["Config"]
    assert isinstance(config, dict)
    return {
        "Id": inspected["Id"],
        "Names": [inspected["Name"]],
        "Image": config["Image"],
        "ImageID": inspected["Image"],
        "Labels": config["Labels"],
        "State": "running",
    }


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
