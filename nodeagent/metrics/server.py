"""Serve the metrics over HTTP at `agent.metrics.listen`, from one background thread.

Paths: `/metrics` (the Prometheus text format, or OpenMetrics when asked), `/healthz` (200
while ticks come, 503 once none has for nodeagent.staleness' window), anything else 404. GET
and HEAD.

Any local user can connect to a loopback port, so the endpoint is built to cost the daemon
little whoever connects. One thread serves every connection without blocking (a selector),
so a connection costs a descriptor and a buffer, never a thread. At most `max_connections`
are open at once. A newcomer beyond that takes the place of the oldest connection that has
gone `idle_grace` without sending its request (a scraper sends it at once); while there is
none, newcomers wait in the kernel's listen queue, costing the daemon nothing. So idle
connections never lock a scrape out and never touch the descriptors the loop needs. A
request has `request_timeout` seconds to arrive whole, an answer `answer_timeout` seconds
to leave.

Who holds a connection is known at accept for every local peer: over a Unix socket
(`unix:PATH`, mode 0660, group `socket_group`) from its peer credentials, over TCP from the
kernel's socket table (`LoopbackPeers`, for a peer on this host). Each local uid other than
root and the daemon's own holds at most `per_uid_connections` (a newcomer of its own makes
room among its own, or is closed), and a newcomer that needs room takes it from such a uid
before anyone else: so one local user's idle connections delay neither root's scrape nor
another user's. Remote peers, and root's, share the rest of the cap. Over a Unix socket a
peer outside root, the daemon's user and the group is answered 403, whatever the mode.

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
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus

import structlog
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from nodeagent.api.peer import LoopbackPeers, peer_allowed, read_peer
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
_ACCEPT_BATCH = 64
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0  # seconds, for an accept() short of resources
_DROPPED_LOG_EVERY = 300.0  # seconds between metrics.samples_dropped lines for one family
_NOT_FOUND = b"not found: try /metrics or /healthz\n"
_TEXT = "text/plain; charset=utf-8"


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    uid: int | None
    """The uid holding the other end, if it is not root or the daemon's and is known (a
    Unix socket, or TCP from this host); None otherwise."""
    since: float
    until: float
    denied: bool = False
    """A peer outside root, the daemon's user and the socket's group: answered 403."""
    request: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None
    """What is left to send, once the request is in."""


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


Encoder = Callable[[Collector], bytes]


class MetricsServer:
    """Started by `start()`; told of every tick through `observe()`; `close()` undoes it.

    The limits below are read when a connection comes."""

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
        self.listen = listen
        self.collector = collector
        self.stale_after = stale_after
        self._listener = listener
        self._token = token
        self._group_gid = group_gid
        self._identity = identity
        self._unix = listener.family == socket.AF_UNIX
        self._peers = None if self._unix else LoopbackPeers.open()
        if not self._unix and self._peers is None:
            log.warning(
                "metrics.peer_uids_unknown",
                listen=listen,
                why="no AF_NETLINK socket (sock_diag): local users share one connection cap",
            )
        self._own_uid = os.geteuid()
        self._sources: tuple[Collector, ...] = (collector, ProcessCollector(registry=None))
        self._started = time.monotonic()
        self._last_tick: float | None = None
        self._cache: dict[str, tuple[float, bytes]] = {}
        self._dropped_logged: dict[str, float] = {}
        self._conns: list[_Conn] = []  # in the order they came
        self._closing = False
        self._failures, self._paused_until = 0, 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._listening = False
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="nodeagent-metrics", daemon=True)
        self._thread.start()

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
        return 0 if self._unix else int(self._listener.getsockname()[1])

    def observe(self, record: TickRecord | None) -> None:
        """Count one tick (its record, or None when it failed) for the scrape and the health."""
        self.collector.observe(record)
        if record is not None:
            self._last_tick = time.monotonic()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for conn in self._conns:
            conn.sock.close()
        self._conns.clear()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._peers is not None:
            self._peers.close()
        if self._unix:
            unlink_if_ours(self.listen.removeprefix("unix:"), self._identity)

    # --- the loop --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing:
            try:
                self._step()
            except Exception:  # a bug: log it, and keep the endpoint up
                log.exception("metrics.loop_failed")
                time.sleep(0.1)

    def _step(self) -> None:
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
        full = len(self._conns) >= self.max_connections
        self._listen_for_more(not self._paused_until and (not full or self._spare(now)))
        wakes = [c.until for c in self._conns]
        if full:  # the oldest idle one may be closed to make room once it is old enough
            wakes += [c.since + self.idle_grace for c in self._conns if c.answer is None]
        if self._paused_until:
            wakes.append(self._paused_until)
        wake = min(wakes, default=now + 1.0)
        for key, events in self._selector.select(max(0.0, min(wake - now, 1.0))):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            elif key.fileobj is self._listener:
                self._accept_some()
            else:
                self._guarded(key.data, events)
        now = time.monotonic()
        for conn in [c for c in self._conns if c.until <= now]:
            self._drop(conn)  # its request or its answer took too long

    def _listen_for_more(self, listen: bool) -> None:
        """Take new connections in or leave them in the kernel's listen queue."""
        if listen and not self._listening:
            self._selector.register(self._listener, selectors.EVENT_READ)
        elif self._listening and not listen:
            self._selector.unregister(self._listener)
        self._listening = listen

    def _accept_some(self) -> None:
        try:
            self._accept()
        except OSError as exc:  # EMFILE and the like: stop accepting a while, longer each time
            if self._failures == 0:
                log.error("metrics.accept_failed", error=str(exc), action="backing off")
            self._failures += 1
            self._listen_for_more(False)
            backoff = min(_BACKOFF_FIRST * 2 ** (self._failures - 1), _BACKOFF_MAX)
            self._paused_until = time.monotonic() + backoff
            return
        if self._failures:
            log.info("metrics.accept_recovered", failures=self._failures)
            self._failures = 0

    def _guarded(self, conn: _Conn, events: int) -> None:
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

    # --- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            now = time.monotonic()
            if len(self._conns) >= self.max_connections and not self._spare(now):
                return  # the rest wait in the listen queue
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            sock.setblocking(False)
            uid: int | None = None
            denied = False
            if self._unix:
                try:
                    peer = read_peer(sock)
                except OSError:
                    sock.close()
                    continue
                uid = peer.uid
                denied = not peer_allowed(peer, self._own_uid, self._group_gid)
            elif self._peers is not None:
                uid = self._peers.uid(sock)  # None: a peer on another host
            if uid in (0, self._own_uid):
                uid = None
            self._admit(_Conn(sock, uid, now, now + self.request_timeout, denied), now)

    def _admit(self, conn: _Conn, now: float) -> None:
        """Take `conn` in, making room by closing the oldest connection that has waited
        `idle_grace` for its request: one of its own uid's when that uid is at its cap,
        else anyone's (another uid's before root's); with none to close, `conn` goes."""
        if conn.uid is not None:
            mine = [c for c in self._conns if c.uid == conn.uid]
            if len(mine) >= self.per_uid_connections and not self._make_room(mine, now):
                conn.sock.close()
                return
        if len(self._conns) >= self.max_connections and not self._make_room(self._conns, now):
            conn.sock.close()
            return
        self._conns.append(conn)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _spare(self, now: float) -> bool:
        """Whether some connection could be closed to make room now."""
        return any(self._idle(c, now) for c in self._conns)

    def _idle(self, conn: _Conn, now: float) -> bool:
        return conn.answer is None and now - conn.since >= self.idle_grace

    def _make_room(self, among: list[_Conn], now: float) -> bool:
        idle = [c for c in among if self._idle(c, now)]
        for victim in sorted(idle, key=lambda c: c.uid is None):  # stable: oldest first
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
        while conn.answer is None and conn in self._conns and _readable(conn.sock):
            self._guarded(conn, selectors.EVENT_READ)

    def _drop(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)
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
                self._answer(conn, _response(431, b"request header fields too large\n"))
            return
        if conn.denied:
            self._answer(conn, _response(403, f"permission denied: {self._who(conn)}\n".encode()))
            return
        self._answer(conn, self._respond(bytes(conn.request[:end])))

    def _who(self, conn: _Conn) -> str:
        group = "" if self._group_gid is None else f" or in group {self._group_gid}"
        return f"uid {conn.uid} is not root{group}"

    def _answer(self, conn: _Conn, response: bytes) -> None:
        conn.answer = memoryview(response)
        conn.until = time.monotonic() + self.answer_timeout
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Conn) -> None:
        assert conn.answer is not None
        with contextlib.suppress(BlockingIOError):
            sent = conn.sock.send(conn.answer)
            conn.answer = conn.answer[sent:]
        if not conn.answer:
            _drain(conn.sock)
            self._drop(conn)

    # --- requests --------------------------------------------------------------------------

    def _respond(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response(400, b"bad request line\n")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                return _response(400, b"bad header line\n")
            headers.setdefault(name.strip().lower(), value.strip())
        if method not in ("GET", "HEAD"):
            return _response(405, b"use GET or HEAD\n", [("Allow", "GET, HEAD")])
        head_only = method == "HEAD"
        path = target.partition("?")[0]
        if path == "/healthz":
            status, text = self._health()
            return _response(status, text.encode(), head_only=head_only)
        if path != "/metrics":
            return _response(404, _NOT_FOUND, head_only=head_only)
        if not self._authorized(headers.get("authorization", "")):
            challenge = [("WWW-Authenticate", 'Bearer realm="nodeagent"')]
            return _response(401, b"a bearer token is needed\n", challenge, head_only)
        content_type, body = self._scrape(headers.get("accept", ""))
        return _response(200, body, content_type=content_type, head_only=head_only)

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


def _response(
    status: int,
    body: bytes,
    headers: Iterable[tuple[str, str]] = (),
    head_only: bool = False,
    content_type: str = _TEXT,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def _readable(sock: socket.socket) -> bool:
    """Whether a recv() would not block: data, an end or an error waits."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def _drain(sock: socket.socket) -> None:
    """Read what the client sent beyond its request, so that closing does not reset the
    connection before it has read the answer."""
    with contextlib.suppress(OSError):
        sock.recv(65536)


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
