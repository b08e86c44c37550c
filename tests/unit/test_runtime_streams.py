"""A runtime's event stream read on the loop's thread (issue 34, item 7): one `lines()` call
does a bounded slice of work however much the runtime has sent, the rest comes at the next
calls, decoding is linear in the bytes, and a stream that keeps every call busy is closed.

The runtime is a STAND-IN: a Unix socket server that answers the GET's status line and
headers as dockerd does; the body is then served by `Waiting`, a STAND-IN for that socket
holding the whole answer already (as when the loop was busy elsewhere while the runtime
wrote), so that what one call may read does not depend on how the scheduler interleaves a
writer thread with the reader (a kernel socket buffer holds ~200 kB where it is not raised).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

from nodeagent.meta import BadAnswer
from nodeagent.runtimes.unixhttp import Stream

LINE = b'{"Action":"create","id":"' + b"a" * 64 + b'"}\n'
ONE_CALL_MOST = 1 << 20
"""What one call may read, generously: the stream's slice is 64 KiB; the issue's call read
all 1.8 MB of 300,000 one-byte chunks (27 s)."""


class Waiting:
    """STAND-IN for a runtime's socket whose whole answer is waiting: `recv` hands it out as
    the kernel would, then says EAGAIN (or end of file, with `closes`)."""

    def __init__(self, data: bytes, *, closes: bool = False) -> None:
        self.data = memoryview(data)
        self.taken = 0
        self.closes = closes

    def recv(self, n: int, flags: int = 0) -> bytes:
        if self.taken >= len(self.data):
            if self.closes:
                return b""
            raise BlockingIOError
        out = bytes(self.data[self.taken : self.taken + n])
        if not flags & socket.MSG_PEEK:
            self.taken += len(out)
        return out

    def fileno(self) -> int:
        return -1

    def close(self) -> None:
        pass


class Endless(Waiting):
    """STAND-IN for a runtime that always has more valid chunks waiting (a flood)."""

    def recv(self, n: int, flags: int = 0) -> bytes:
        at = self.taken % 6  # where the last call cut the pattern
        if not flags & socket.MSG_PEEK:
            self.taken += n
        return (b"1\r\nx\r\n" * (n // 6 + 2))[at : at + n]


def one_byte_chunks(body: bytes) -> bytes:
    """`body` as a chunked HTTP body of one-byte chunks (6 bytes on the wire each)."""
    return b"".join(b"1\r\n%c\r\n" % b for b in body)


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Stream]:
    with opening(tmp_path / "docker.sock") as stream:
        yield stream


@contextmanager
def opening(where: Path) -> Iterator[Stream]:
    """A Stream opened on a stand-in runtime's socket that answered 200, chunked."""
    path = str(where)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    held: list[socket.socket] = []

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        held.append(conn)

    t = threading.Thread(target=serve)
    t.start()
    stream = Stream(path, "/events", 5.0)
    t.join(timeout=5)
    assert held, "the stand-in runtime did not answer the GET's head"
    stream.sock.close()
    # a clock that stands still: slices end by their bytes here, and a slow host (the VM)
    # does not read as a stream that keeps the loop busy; the busy tests move it themselves
    stream.clock = lambda: 0.0
    yield stream
    held[0].close()
    server.close()


def serve(stream: Stream, source: Waiting) -> Waiting:
    stream.sock = source  # type: ignore[assignment]
    return source


def drain(stream: Stream) -> tuple[list[bytes], list[int]]:
    """Every line, calling `lines()` as the loop does while the fd is readable; and the bytes
    each call took from the socket."""
    source = stream.sock
    assert isinstance(source, Waiting)
    got: list[bytes] = []
    per_call: list[int] = []
    while source.taken < len(source.data) or not per_call:
        before = source.taken
        got += stream.lines()
        per_call.append(source.taken - before)
        assert len(per_call) < 10_000, "lines() makes no progress"
    return got, per_call


def test_one_call_reads_a_slice_of_300000_one_byte_chunks_and_the_rest_follows(
    opened: Stream,
) -> None:
    body = LINE * (300_000 // len(LINE))
    source = serve(opened, Waiting(one_byte_chunks(body)))
    t0 = time.monotonic()
    first = opened.lines()
    took = time.monotonic() - t0
    assert source.taken <= ONE_CALL_MOST, (
        f"one call read {source.taken} of {len(source.data)} bytes in {took:.1f} s"
        " on the loop's thread"
    )
    assert source.taken > 0, "the call read nothing"
    rest, per_call = drain(opened)
    assert first + rest == [LINE[:-1]] * (len(body) // len(LINE)), "every line, in order"
    assert max(per_call) <= ONE_CALL_MOST
    assert not opened.ended


class Counting(bytearray):
    """A buffer that counts the bytes each operation the decoder uses copies, moves or
    scans: what its cost is, counted rather than timed (CPU time on a shared host says
    little). Appends are not counted: each byte on the wire is appended once."""

    work = 0

    def __getitem__(self, key: Any) -> Any:  # a slice is a copy
        got = super().__getitem__(key)
        Counting.work += len(got) if isinstance(key, slice) else 1
        return got

    def __delitem__(self, key: Any) -> None:  # deleting a head moves the rest down
        if isinstance(key, slice):
            Counting.work += len(self) - len(range(*key.indices(len(self))))
        super().__delitem__(key)

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:  # up to a match
        lo, hi, _ = slice(start, end).indices(len(self))
        at = super().find(sub, start, end)
        Counting.work += max((hi if at < 0 else at + len(sub)) - lo, 0)
        return at

    def rfind(self, sub: Any, start: Any = None, end: Any = None) -> int:  # back to a match
        lo, hi, _ = slice(start, end).indices(len(self))
        at = super().rfind(sub, start, end)
        Counting.work += max(hi - (lo if at < 0 else at), 0)
        return at


def decoding_work(chunks: int, where: Path) -> tuple[int, int]:
    """(bytes on the wire, bytes the decoder copied, moved or scanned) for a new stream to
    read and decode `chunks` one-byte chunks and the body's end, however many calls that
    takes."""
    body = (LINE * (chunks // len(LINE) + 1))[:chunks]
    with opening(where) as stream:
        source = serve(stream, Waiting(one_byte_chunks(body) + b"0\r\n\r\n", closes=True))
        stream._raw, stream._body = Counting(stream._raw), Counting(stream._body)
        Counting.work = got = 0
        while not stream.ended:
            got += sum(len(line) + 1 for line in stream.lines())
    assert source.taken == len(source.data) and got == chunks - chunks % len(LINE)
    return len(source.data), Counting.work


@pytest.mark.parametrize("chunks", [20_000, 200_000])
def test_decoding_is_linear_in_the_chunks(chunks: int, tmp_path: Path) -> None:
    """The decoder touches each byte on the wire a few times, however many chunks: a copy of
    the remainder per chunk (the issue's 27 s call) touched tens of thousands of times as
    many at 200,000."""
    wire, work = decoding_work(chunks, tmp_path / "docker.sock")
    assert work <= 8 * wire, f"{chunks} chunks: {work} bytes touched for {wire} on the wire"


def test_a_stream_that_keeps_every_call_busy_is_said_once_then_refused(opened: Stream) -> None:
    """A flood of valid chunks: each call reads its slice and returns; the first one said
    (a warning, once), and BadAnswer (the caller closes it, opened again RETRY_S later: see
    test_runtimes' broken stream) once the stream has kept the calls busy for BUSY_S."""
    from nodeagent.runtimes.unixhttp import BUSY_S

    now = [0.0]
    opened.clock = lambda: now[0]
    source = serve(opened, Endless(b""))
    with structlog.testing.capture_logs() as logs:
        for _ in range(20):
            before = source.taken
            opened.lines()
            assert source.taken - before <= ONE_CALL_MOST
            now[0] += BUSY_S / 20
        with pytest.raises(BadAnswer, match="kept the loop reading"):
            opened.lines()
    busy = [e for e in logs if e["event"] == "runtime.events_busy"]
    assert len(busy) == 1 and busy[0]["log_level"] == "warning", logs


def test_a_slice_that_ends_on_its_time_with_nothing_left_is_not_busy(opened: Stream) -> None:
    """A slow or loaded host (the VM under TCG, where a docker events test once failed on
    it): a call whose slice runs past SLICE_S while reading the last bytes waiting has read
    them all; nothing keeps the loop busy, and nothing is said."""
    from nodeagent.runtimes.unixhttp import SLICE_S

    now = [0.0]

    def slow() -> float:
        now[0] += SLICE_S  # every look at the clock finds the slice over
        return now[0]

    opened.clock = slow
    serve(opened, Waiting(one_byte_chunks(LINE * 3)))
    with structlog.testing.capture_logs() as logs:
        got = opened.lines()
    assert got == [LINE.rstrip(b"\n")] * 3, "one chunk read, whatever the clock says"
    assert [e for e in logs if e["event"] == "runtime.events_busy"] == []


def test_a_stream_that_drains_between_floods_is_not_refused(opened: Stream) -> None:
    """Busy means more waiting at the end of every call: a burst read over a few calls, then
    a call that drains it, starts the count again."""
    from nodeagent.runtimes.unixhttp import BUSY_S

    now = [0.0]
    opened.clock = lambda: now[0]
    for _ in range(3):
        serve(opened, Waiting(one_byte_chunks(LINE * 2_000)))
        got, _ = drain(opened)
        assert len(got) == 2_000
        now[0] += BUSY_S
