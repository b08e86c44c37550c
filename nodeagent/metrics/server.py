"""Serve the metrics over HTTP at `agent.metrics.listen`, from one background thread.

Paths: `/metrics` (the Prometheus text format, or OpenMetrics when asked), `/healthz` (200
while ticks come, 503 once none has for nodeagent.staleness' window), anything else 404. GET
and HEAD.

Any local user can connect to a loopback port, so the endpoint is built to cost the daemon
little whoever connects. It is a thin user of the HTTP core (nodeagent.api.httpcore), whose
one thread accepts, learns who is on the other end and serves every connection here without
blocking (a selector), so a connection costs a descriptor and a buffer, never a thread. At
most `max_connections` are open at once. A newcomer beyond that takes the place of the
oldest connection that has gone `idle_grace` without sending its request (a scraper sends
it at once); while there is none, newcomers wait in the kernel's listen queue, costing the
daemon nothing. So idle connections never lock a scrape out and never touch the descriptors
the loop needs. A request has `request_timeout` seconds to arrive whole, an answer
`answer_timeout` seconds to leave.

Connections are counted by the core's per-peer scheme (`httpcore.Pool`, the API's too): a
peer is the uid holding the other end, from its peer credentials over a Unix socket
(`unix:PATH`, mode 0660, group `socket_group`) or the kernel's socket table over TCP from
this host. Each local uid other than root and the daemon's own holds at most
`per_uid_connections` (a newcomer of its own makes room among its own, or is closed), and
a newcomer that needs room takes it from such a uid before anyone else: so one local
user's idle connections delay neither root's scrape nor another user's. Remote peers, and
root's, share the rest of the cap. Over a Unix socket a peer outside root, the daemon's
user and the group is answered 403, whatever the mode.

A scrape is rendered from the latest tick at most once per `cache_seconds`, whoever asks,
so a flood of requests costs sends, not renders (and the workloads' series, nearly all of
it, once per tick: the collector keeps them, with their text). Each family is encoded on
its own, a workload family by writing its own lines (checked against the encoder's): a
sample that cannot be encoded (a label that is not text) is dropped and logged, and costs
the scrape nothing else. With `bearer_token_file`, /metrics wants `Authorization: Bearer
<token>` (401 otherwise); /healthz stays open, as probes expect.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import os
import selectors
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from nodeagent.api.httpcore import Caller, HttpCore, Pool, drained, readable, response
from nodeagent.api.unixsocket import Identity, listen_unix, resolve_group, unlink_if_ours
from nodeagent.errors import NodeagentError
from nodeagent.metrics.collector import TickCollector
from nodeagent.metrics.families import Rendered
from nodeagent.policyfile.listen import parse_listen, unix_path
from nodeagent.regular_file import read_regular_file
from nodeagent.report import TickRecord
from nodeagent.staleness import STALE_MIN

log = structlog.get_logger("nodeagent.metrics")

TOKEN_MAX = 4096  # bytes
_DROPPED_LOG_EVERY = 300.0  # seconds between metrics.samples_dropped lines for one family
_NOT_FOUND = b"not found: try /metrics or /healthz\n"
_TEXT = "text/plain; charset=utf-8"


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    caller: Caller
    since: float
    until: float
    request: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None
    """What is left to send, once the request is in."""


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


Encoder = Callable[[Collector], bytes]


class MetricsServer(HttpCore):
    """Started by `start()`; told of every tick through `observe()`; `close()` undoes it.

    The limits below are read when the server starts, the timeouts when a connection
    comes."""

    max_connections = 64
    """Connections open at once, whoever holds them."""
    per_uid_connections = 8
    """Connections one local uid other than root and the daemon's holds at once."""
    request_timeout = 5.0
    """Seconds a client has to send its request line and headers."""
    answer_timeout = 10.0
    """Seconds a client has to take the whole answer."""
    idle_grace = 0.5
    """Seconds after which a connection still without its request may be closed to make
    room for a newcomer (a scraper sends its request at once)."""
    cache_seconds = 1.0
    """A render is served again for this long."""
    max_request = 8192
    """Bytes of request line and headers; more is answered 431."""

    def __init__(
        self,
        listen: str,
        collector: TickCollector,
        listener: socket.socket,
        *,
        token: bytes | None,
        stale_after: Callable[[], float],
        group_gid: int | None = None,
        identity: Identity | None = None,
    ) -> None:
        super().__init__("metrics", own_uid=os.geteuid(), group_gid=group_gid)
        self.listen = listen
        self.collector = collector
        self.stale_after = stale_after
        self._token = token
        self._identity = identity
        self._unix = listener.family == socket.AF_UNIX
        self._sources: tuple[Collector, ...] = (collector, ProcessCollector(registry=None))
        self._started = time.monotonic()
        self._last_tick: float | None = None
        self._cache: dict[str, tuple[float, bytes]] = {}
        self._dropped_logged: dict[str, float] = {}
        self._conns: list[_Conn] = []  # in the order they came
        self._pool = Pool(self.max_connections, 0, self.per_uid_connections)
        self.serve(listener)

    @classmethod
    def start(
        cls,
        listen: str,
        collector: TickCollector,
        *,
        bearer_token_file: str | None = None,
        socket_group: str | None = None,
        stale_after: Callable[[], float] = lambda: STALE_MIN,
    ) -> MetricsServer:
        """Bind and serve; a port in use, an address this host lacks or an unreadable token
        file is a one-line error."""
        token = None if bearer_token_file is None else _read_token(bearer_token_file)
        path = unix_path(listen)
        if path is None:
            return cls(listen, collector, _listen_tcp(listen), token=token, stale_after=stale_after)
        try:
            gid = (
                None if socket_group is None else resolve_group(socket_group, "the metrics socket")
            )
            listener, identity = listen_unix(path, gid, "the metrics socket")
        except NodeagentError as e:
            raise NodeagentError(f"agent.metrics.listen {listen}: {e}") from None
        return cls(
            listen,
            collector,
            listener,
            token=token,
            stale_after=stale_after,
            group_gid=gid,
            identity=identity,
        )

    @property
    def port(self) -> int:
        """The TCP port (0 on a Unix socket)."""
        return 0 if self._unix else int(self.address[1])

    def observe(self, record: TickRecord | None) -> None:
        """Count one tick (its record, or None when it failed) for the scrape and the health."""
        self.collector.observe(record)
        if record is not None:
            self._last_tick = time.monotonic()

    def close(self) -> None:
        self.stop()
        for conn in self._conns:
            conn.sock.close()
        self._conns.clear()
        if self._unix:
            unlink_if_ours(self.listen.removeprefix("unix:"), self._identity)

    # --- what the core asks ----------------------------------------------------------------

    def room(self, now: float) -> bool:
        return not self._pool.full or self._spare(now)

    def wakes(self, now: float) -> list[float]:
        wakes = [c.until for c in self._conns]
        if self._pool.full:  # the oldest idle one may be closed to make room
            wakes += [c.since + self.idle_grace for c in self._conns if c.answer is None]
        return wakes

    def due(self, now: float) -> None:
        for conn in [c for c in self._conns if c.until <= now]:
            self._drop(conn)  # its request or its answer took too long

    def ready(self, data: Any, events: int) -> None:
        conn = data
        assert isinstance(conn, _Conn)
        try:
            if events & selectors.EVENT_READ and conn.answer is None:
                self._read(conn)
            elif events & selectors.EVENT_WRITE and conn.answer is not None:
                self._send(conn)
        except OSError:
            self._drop(conn)
        except Exception:
            log.exception("metrics.handler_failed")
            self._drop(conn)

    def admit(self, sock: socket.socket, caller: Caller) -> None:
        """Take the connection in, making room by closing the oldest connection that has
        waited `idle_grace` for its request: one of its own peer's when that peer holds all
        it may, else anyone's (another peer's before root's); with none to close, it goes."""
        now = time.monotonic()
        uid, uncapped = caller.uid, caller.uncapped
        while not self._pool.fits(uid, uncapped):
            capped = self._pool.capped(uid, uncapped)
            among = [c for c in self._conns if c.caller.uid == uid] if capped else self._conns
            if not self._make_room(among, now):
                sock.close()
                return
        self._pool.take(uid, uncapped)
        conn = _Conn(sock, caller, now, now + self.request_timeout)
        self._conns.append(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)

    # --- connections -----------------------------------------------------------------------

    def _spare(self, now: float) -> bool:
        """Whether some connection could be closed to make room now."""
        return any(self._idle(c, now) for c in self._conns)

    def _idle(self, conn: _Conn, now: float) -> bool:
        return conn.answer is None and now - conn.since >= self.idle_grace

    def _make_room(self, among: list[_Conn], now: float) -> bool:
        idle = [c for c in among if self._idle(c, now)]
        for victim in sorted(idle, key=lambda c: c.caller.uncapped):  # stable: oldest first
            self._catch_up(victim)
            if victim.answer is None and victim in self._conns:
                self._drop(victim)
                return True
            if victim not in self._conns:  # it hung up, or its answer left whole
                return True
        return False

    def _catch_up(self, conn: _Conn) -> None:
        """Read what `conn` sent that this loop has not yet seen: under load the loop can fall
        `idle_grace` behind a scraper whose request sits whole in the kernel, which is no
        idle connection (a flood's churn once cut root's scrape so)."""
        while conn.answer is None and conn in self._conns and readable(conn.sock):
            self.ready(conn, selectors.EVENT_READ)

    def _drop(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.remove(conn)
        self._pool.give(conn.caller.uid, conn.caller.uncapped)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(4096)
        if not data:
            self._drop(conn)
            return
        conn.request += data
        end = conn.request.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.request) > self.max_request:
                self._answer(conn, _text(431, b"request header fields too large\n"))
            return
        if not conn.caller.allowed:
            self._answer(conn, _text(403, f"permission denied: {self._who(conn)}\n".encode()))
            return
        self._answer(conn, self._respond(bytes(conn.request[:end])))

    def _who(self, conn: _Conn) -> str:
        group = "" if self.group_gid is None else f" or in group {self.group_gid}"
        return f"uid {conn.caller.uid} is not root{group}"

    def _answer(self, conn: _Conn, response: bytes) -> None:
        conn.answer = memoryview(response)
        conn.until = time.monotonic() + self.answer_timeout
        self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        assert conn.answer is not None
        with contextlib.suppress(BlockingIOError):
            sent = conn.sock.send(conn.answer)
            conn.answer = conn.answer[sent:]
        if not conn.answer:
            drained(conn.sock)
            self._drop(conn)

    # --- requests --------------------------------------------------------------------------

    def _respond(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _text(400, b"bad request line\n")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return _text(400, b"bad header line\n")
            headers.setdefault(name.strip().lower(), value.strip())
        if method not in ("GET", "HEAD"):
            return _text(405, b"use GET or HEAD\n", [("Allow", "GET, HEAD")])
        head_only = method == "HEAD"
        path = target.partition("?")[0]
        if path == "/healthz":
            status, text = self._health()
            return _text(status, text.encode(), head_only=head_only)
        if path != "/metrics":
            return _text(404, _NOT_FOUND, head_only=head_only)
        if not self._authorized(headers.get("authorization", "")):
            challenge = [("WWW-Authenticate", 'Bearer realm="nodeagent"')]
            return _text(401, b"a bearer token is needed\n", challenge, head_only)
        content_type, body = self._scrape(headers.get("accept", ""))
        return _text(200, body, content_type=content_type, head_only=head_only)

    def _authorized(self, authorization: str) -> bool:
        if self._token is None:
            return True
        scheme, _, credentials = authorization.partition(" ")
        given = credentials.strip().encode("latin-1")
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self._token)

    def _health(self) -> tuple[int, str]:
        now, window = time.monotonic(), self.stale_after()
        last = self._last_tick
        age = now - (self._started if last is None else last)
        if age <= window:
            return 200, "ok\n" if last is not None else "starting: no tick yet\n"
        return 503, f"stale: no tick for {age:.1f}s (the limit is {window:g}s)\n"

    def _scrape(self, accept: str) -> tuple[str, bytes]:
        encoder, content_type = choose_encoder(accept)
        now = time.monotonic()
        cached = self._cache.get(content_type)
        if cached is not None and now - cached[0] < self.cache_seconds:
            return content_type, cached[1]
        body = self._render(encoder)
        self._cache[content_type] = (time.monotonic(), body)
        return content_type, body

    def _render(self, encoder: Encoder) -> bytes:
        tail = encoder(_Families([]))  # OpenMetrics ends with "# EOF"; that goes last, once
        parts: list[bytes] = []
        for source in self._sources:
            try:
                families = list(source.collect())
            except Exception as exc:  # its series are missing; the others are served
                log.error("metrics.collect_failed", source=type(source).__name__, error=str(exc))
                continue
            parts.extend(self._encode(encoder, f, tail) for f in families)
        parts.append(tail)
        return b"".join(parts)

    def _encode(self, encoder: Encoder, family: Metric, tail: bytes) -> bytes:
        """One family; a sample that cannot be encoded is left out, and logged."""
        if isinstance(family, Rendered):
            with contextlib.suppress(Exception):
                written = _rendered(encoder, family, tail)
                if written is not None:
                    return written
        with contextlib.suppress(Exception):
            return encoder(_Families([family])).removesuffix(tail)
        kept = [s for s in family.samples if _encodes(encoder, _with(family, [s]))]
        now = time.monotonic()
        if now - self._dropped_logged.get(family.name, -_DROPPED_LOG_EVERY) >= _DROPPED_LOG_EVERY:
            self._dropped_logged[family.name] = now
            dropped = len(family.samples) - len(kept)
            log.warning("metrics.samples_dropped", family=family.name, dropped=dropped)
        with contextlib.suppress(Exception):
            return encoder(_Families([_with(family, kept)])).removesuffix(tail)
        return b""


def _rendered(encoder: Encoder, family: Rendered, tail: bytes) -> bytes | None:
    """A workload family's own lines under the encoder's header, when the encoder writes
    its first sample as they do (else None: the encoder writes it, an escaping that
    renames, say)."""
    first = family.first()
    body = family.body()
    if first is None or body is None:
        return None
    one, line = first
    head = encoder(_Families([family.empty()])).removesuffix(tail)
    if encoder(_Families([one])).removesuffix(tail) != head + line:
        return None
    return head + body


def _with(family: Metric, samples: list[Sample]) -> Metric:
    one = copy.copy(family)
    one.samples = samples
    return one


def _encodes(encoder: Encoder, family: Metric) -> bool:
    try:
        encoder(_Families([family]))
    except Exception:
        return False
    return True


def _text(
    status: int,
    body: bytes,
    headers: Iterable[tuple[str, str]] = (),
    head_only: bool = False,
    content_type: str = _TEXT,
) -> bytes:
    return response(status, body, content_type, headers, head_only=head_only)


def _read_token(path: str) -> bytes:
    try:
        raw = read_regular_file(path, TOKEN_MAX)
    except OSError as e:
        raise NodeagentError(f"agent.metrics.bearer_token_file {path}: {e.strerror or e}") from None
    except NodeagentError as e:
        raise NodeagentError(f"agent.metrics.bearer_token_file {path}: {e}") from None
    token = raw.strip()
    if len(raw) > TOKEN_MAX:
        why = f"over {TOKEN_MAX} bytes"
    elif not token:
        why = "empty"
    elif any(b < 0x21 or b > 0x7E for b in token):
        why = "not one printable ASCII word"
    else:
        return token
    raise NodeagentError(f"agent.metrics.bearer_token_file {path}: {why}")


def _listen_tcp(listen: str) -> socket.socket:
    host, port = parse_listen(listen)
    listener = None
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        if listener is not None:
            listener.close()
        why = e.strerror or str(e)
        raise NodeagentError(f"agent.metrics.listen {listen}: cannot listen: {why}") from None
    listener.setblocking(False)
    return listener
