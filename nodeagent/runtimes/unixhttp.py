"""HTTP/1.1 GET over a Unix socket, with one deadline for the whole exchange (stdlib only).

The Docker and podman APIs are HTTP on a Unix socket. http.client's timeouts are per operation,
so a server that trickles a byte at a time could hold a caller for ever; here every connect,
send and receive gets what is left of one deadline, and a body larger than `limit` is refused
before it is parsed. A server that accepts and never answers costs exactly the deadline.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass

from nodeagent.meta import MAX_ANSWER_BYTES, BadAnswer, Unavailable

_HEAD_LIMIT = 64 * 1024


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes

    def json(self) -> object:
        try:
            return json.loads(self.body)  # bytes: invalid UTF-8 raises UnicodeDecodeError
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            reason = "not valid UTF-8" if isinstance(e, UnicodeDecodeError) else "not JSON"
            raise BadAnswer(f"the answer is {reason}") from None


def get(path: str, target: str, timeout: float, limit: int = MAX_ANSWER_BYTES) -> Response:
    """GET `target` from the HTTP server on the Unix socket `path`, in `timeout` seconds in all.

    Raises Unavailable when the server cannot be reached or does not answer in time (or drops
    the connection mid-answer), BadAnswer when the answer is not HTTP or is larger than `limit`.
    """
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _within(sock, deadline)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise Unavailable(f"no socket at {path}") from None
        except OSError as e:
            raise Unavailable(_why(e, path, timeout)) from None
        request = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        try:
            _within(sock, deadline)
            sock.sendall(request.encode("ascii"))
            return _read(sock, deadline, limit, path, timeout)
        except OSError as e:
            raise Unavailable(_why(e, path, timeout)) from None
    finally:
        sock.close()


def _within(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _why(e: OSError, path: str, timeout: float) -> str:
    if isinstance(e, TimeoutError):
        return f"{path} did not answer in {timeout * 1000:.0f} ms"
    return f"{path}: {e.strerror or type(e).__name__}"


class _Reader:
    """Bytes from the socket, each receive within what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: float, limit: int) -> None:
        self.sock, self.deadline, self.limit = sock, deadline, limit
        self.buf = b""
        self.eof = False
        self.total = 0

    def fill(self) -> bool:
        if self.eof:
            return False
        _within(self.sock, self.deadline)
        chunk = self.sock.recv(65536)
        if not chunk:
            self.eof = True
            return False
        self.total += len(chunk)
        if self.total > self.limit + _HEAD_LIMIT:
            raise BadAnswer(f"the answer is larger than {self.limit} bytes")
        self.buf += chunk
        return True

    def until(self, marker: bytes, cap: int) -> bytes:
        while marker not in self.buf:
            if len(self.buf) > cap:
                raise BadAnswer("the answer's headers are too long")
            if not self.fill():
                raise ConnectionResetError("the connection closed mid-answer")
        head, _, self.buf = self.buf.partition(marker)
        return head

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise ConnectionResetError("the connection closed mid-answer")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self.fill():
            pass
        out, self.buf = self.buf, b""
        return out


def _read(sock: socket.socket, deadline: float, limit: int, path: str, timeout: float) -> Response:
    reader = _Reader(sock, deadline, limit)
    head = reader.until(b"\r\n\r\n", _HEAD_LIMIT).decode("latin-1")
    lines = head.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"{path} does not speak HTTP")
    status = int(parts[1])
    headers = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line = reader.until(b"\r\n", 1024).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise BadAnswer(f"{path} sent a bad chunk size") from None
            if size == 0:
                break
            if len(body) + size > limit:
                raise BadAnswer(f"the answer is larger than {limit} bytes")
            body += reader.exactly(size)
            reader.exactly(2)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise BadAnswer(f"{path} sent a bad Content-Length") from None
        if length > limit or length < 0:
            raise BadAnswer(f"the answer is {length} bytes, more than {limit}")
        body = reader.exactly(length)
    else:
        body = reader.rest()
    return Response(status, body)
