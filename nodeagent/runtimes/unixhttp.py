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
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from nodeagent.meta import MAX_ANSWER_BYTES, BadAnswer, Unavailable

_HEAD_LIMIT = 64 * 1024
log = structlog.get_logger("nodeagent.runtimes")


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
    sock = _asked(path, target, deadline, timeout)
    try:
        return _read(_Reader(sock, deadline, limit), path)
    except OSError as e:
        raise Unavailable(_why(e, path, timeout)) from None
    finally:
        sock.close()


def _asked(path: str, target: str, deadline: float, timeout: float) -> socket.socket:
    """A connection to `path` that has sent the GET of `target`, within the deadline."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _within(sock, deadline)
        try:
            sock.connect(path)
        except FileNotFoundError:
            raise Unavailable(f"no socket at {path}") from None
        request = f"GET {target} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        _within(sock, deadline)
        sock.sendall(request.encode("ascii"))
    except OSError as e:
        sock.close()
        raise Unavailable(_why(e, path, timeout)) from None
    except Unavailable:
        sock.close()
        raise
    return sock


SLICE_BYTES = 64 * 1024
"""Bytes one `Stream.lines()` reads at most: the loop's thread reads a stream when its fd is
readable, between ticks, so a runtime that has more waiting (a flood, a trickle of one-byte
chunks) is read a slice at a time and the rest at the loop's next wake; parsing costs in
proportion to what was read (issue 34: 300,000 one-byte chunks took 27 s in one call)."""
SLICE_S = 0.05
"""Seconds one `Stream.lines()` reads at most, whatever the bytes."""
BUSY_S = 10.0
"""A stream that still has more than its slice waiting, call after call, for this long keeps
the loop busy for no container's sake (dockerd's create events are a few kB a container):
`lines()` then raises BadAnswer, and the caller closes it and opens another later, as for a
stream that broke."""


class Stream:
    """A GET whose answer goes on (Docker's `/events` without `until`), read as it comes.

    Opened within one deadline (connect, send, the status line and headers); then the caller's
    loop reads it when its fd is readable, never blocking: `lines()` hands back the complete
    lines of the body that arrived (a chunked body decoded), and holds at most `limit` bytes
    of an unfinished one; `ended` once the server has closed it or ended its body. Each call
    reads at most SLICE_BYTES in SLICE_S (the rest waits for the next), and decodes with
    offsets into one buffer, compacted when half of it is read, so that its cost is linear in
    what it read. Raises Unavailable when the connection fails, BadAnswer when what it sends
    is not what HTTP or the limit allow, or when it has kept every call busy for BUSY_S: the
    caller then closes it."""

    def __init__(
        self,
        path: str,
        target: str,
        timeout: float,
        limit: int = MAX_ANSWER_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.limit, self.clock = path, limit, clock
        deadline = time.monotonic() + timeout
        self.sock = _asked(path, target, deadline, timeout)
        try:
            reader = _Reader(self.sock, deadline, limit)
            status, headers = _head(reader, path)
            if status != 200:
                raise BadAnswer(f"{path} answered HTTP {status}")
            self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        except OSError as e:
            self.sock.close()
            raise Unavailable(_why(e, path, timeout)) from None
        except BadAnswer:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self._raw = bytearray(reader.buf)
        self._at = 0
        """Where the undecoded bytes of `_raw` begin."""
        self._body = bytearray()
        self._scanned = 0
        """How much of `_body` is known to hold no newline."""
        self._busy_since: float | None = None
        self.ended = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def lines(self) -> list[bytes]:
        """The body's complete lines received since the last call (without their newline),
        of at most one slice read now."""
        start = self.clock()
        read = 0
        more = False
        while not self.ended:
            # a slice reads one chunk at least, whatever the clock says
            if read >= SLICE_BYTES or (read and self.clock() - start >= SLICE_S):
                more = self._waiting()
                break
            try:
                chunk = self.sock.recv(min(65536, SLICE_BYTES - read))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise Unavailable(f"{self.path}: {e.strerror or type(e).__name__}") from None
            self.ended = not chunk
            read += len(chunk)
            self._raw += chunk
            if len(self._raw) - self._at > self.limit:
                raise BadAnswer(f"{self.path} sent more than {self.limit} bytes unfinished")
        self._decode()
        lines = self._complete()
        self._busy(more, start)
        return lines

    def _waiting(self) -> bool:
        """Whether bytes wait beyond the slice just read: a slice that ends on its time
        with nothing left (a slow or loaded host, one late chunk) keeps nobody busy."""
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # the next call reads it and says what is wrong

    def _busy(self, more: bool, start: float) -> None:
        """Said once when a call leaves bytes waiting; BadAnswer once every call has for
        BUSY_S."""
        if not more:
            self._busy_since = None
        elif self._busy_since is None:
            self._busy_since = start
            log.warning("runtime.events_busy", socket=self.path,
                        action=f"read {SLICE_BYTES} bytes a wake; closed if still so"
                        f" after {BUSY_S:g} s")  # fmt: skip
        elif start - self._busy_since >= BUSY_S:
            raise BadAnswer(
                f"{self.path} kept the loop reading for {BUSY_S:g} s, more than a slice a wake"
            )

    def _complete(self) -> list[bytes]:
        """The complete lines decoded so far, taken out of the body (the newline is looked
        for only in what is new)."""
        body = self._body
        end = body.rfind(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(body)
            if len(body) > self.limit:
                raise BadAnswer(f"{self.path} sent a line longer than {self.limit} bytes")
            return []
        lines = bytes(body[:end]).split(b"\n")
        del body[: end + 1]
        self._scanned = 0
        if len(body) > self.limit:
            raise BadAnswer(f"{self.path} sent a line longer than {self.limit} bytes")
        return [line for line in lines if line.strip()]

    def _decode(self) -> None:
        """Move what `_raw` holds of the body into `_body`: each chunk is sliced once, at
        its offset; the decoded bytes are dropped from `_raw` once they are half of it."""
        raw, at = self._raw, self._at
        if not self.chunked:
            self._body += raw[at:]
            at = len(raw)
        while self.chunked:
            eol = raw.find(b"\r\n", at, at + 1026)
            if eol < 0:
                if len(raw) - at > 1024:
                    raise BadAnswer(f"{self.path} sent a bad chunk size")
                break
            try:
                size = int(raw[at:eol].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadAnswer(f"{self.path} sent a bad chunk size") from None
            if size < 0:
                raise BadAnswer(f"{self.path} sent a bad chunk size")
            if size == 0:
                self.ended = True
                break
            data = eol + 2
            if len(raw) - data < size + 2:
                break
            self._body += raw[data : data + size]
            at = data + size + 2
        if at * 2 >= len(raw):
            del raw[:at]
            at = 0
        self._at = at


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


def _head(reader: _Reader, path: str) -> tuple[int, dict[str, str]]:
    """The status and headers (names in lower case) of an answer."""
    head = reader.until(b"\r\n\r\n", _HEAD_LIMIT).decode("latin-1")
    lines = head.split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"{path} does not speak HTTP")
    headers = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _read(reader: _Reader, path: str) -> Response:
    limit = reader.limit
    status, headers = _head(reader, path)
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
