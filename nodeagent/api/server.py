"""The API server: stdlib HTTP/1.0 on a Unix stream socket, one thread per connection.

Two independent gates guard it. The socket file is 0660 (owner root, group `group`), so the
kernel refuses strangers at connect(); and every request, whatever its method, is checked
again by its peer credentials, so a socket whose mode was loosened by hand still answers only
root, the daemon's own user and members of `group`. Routes get those credentials too, so a
write endpoint can check, say, that a pid belongs to its caller.

No caller can take the API away from the others. Every connection is accepted at once and
its peer credentials read before any byte of its request; it is then served, made to wait,
or told no (429) by who holds the slots (`slots.Pool`): at most `max_connections` are
served at once, of which `reserved_connections` are kept for root and the daemon's own
user, and any other uid is served on at most `per_uid_connections` at once, with up to
`per_uid_waiting` more waiting their turn in the daemon (the waiting room has the same
shape). A waiting connection that gets no slot within `timeout` is told the daemon is busy
(503). A served one has `header_timeout` seconds for its request line and headers, the
whole request `timeout` seconds, and its answer `timeout` seconds to leave. A refused
connection is answered at once and then kept, briefly and a bounded number per uid, until
its client has sent its request and hung up: closed earlier, a client still sending gets
EPIPE instead of its answer. An accept() that fails for want of file descriptors backs off
instead of spinning, so the reconcile loop keeps the descriptors it needs.
"""

from __future__ import annotations

import contextlib
import io
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, cast

import structlog

from nodeagent.api.peer import Peer, peer_allowed, read_peer
from nodeagent.api.slots import Pool
from nodeagent.api.unixsocket import Identity, listen_unix, resolve_group, unlink_if_ours
from nodeagent.api.wire import (
    MAX_BODY,
    Deadline,
    DeadlineIO,
    decode_object,
    decode_path,
    decode_query,
    encode,
)
from nodeagent.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NodeagentError,
    NotFound,
    Refused,
    TryLater,
)

log = structlog.get_logger("nodeagent.api")

METHODS = ("GET", "POST", "DELETE")
"""The methods a route may declare, in the order an Allow header lists them."""
_WITH_BODY = frozenset({"POST", "DELETE"})
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0  # seconds, for an accept() short of resources
_ACCEPT_BATCH = 64  # connections taken in per wake-up before the waiting room is looked at
_REFUSAL_LOG_EVERY = 10.0  # seconds: one api.refused line per uid and reason, then a count
_LINGER = 2.0  # seconds a refused connection is kept open to take in what its client sends
_LINGER_MAX, _LINGER_PER_UID = 32, 8  # refused connections kept so, in all and per uid


@dataclass(frozen=True, slots=True)
class Request:
    """What a route is given: the query, the JSON body (POST and DELETE; empty for a GET)
    and the credentials of the calling process."""

    method: str
    path: str
    query: Mapping[str, str]
    peer: Peer
    body: Mapping[str, Any] = field(default_factory=dict)


Handler = Callable[[Request], object]
"""Serves one method of one path: returns its answer (a model of nodeagent.api.answers, or
JSON-serialisable data), or raises Refused."""

Routes = Mapping[str, Mapping[str, Handler]]
"""Path -> method ("GET", "POST" or "DELETE") -> handler."""


STATUS: tuple[tuple[type[Refused], int], ...] = (
    (BadRequest, 400),
    (Forbidden, 403),
    (NotFound, 404),
    (Conflict, 409),
    (TryLater, 503),
)
"""The HTTP status each kind of refusal is answered with (any other refusal: 400)."""


def status_of(exc: Refused) -> int:
    return next((code for kind, code in STATUS if isinstance(exc, kind)), 400)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Handler(BaseHTTPRequestHandler):
    server_version = "nodeagent"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    peer: Peer | None = None

    @property
    def _api(self) -> ApiServer:
        return cast(ApiServer, self.server)

    def setup(self) -> None:
        # Instead of StreamRequestHandler's per-read timeout: deadlines for the request, a
        # short one for its line and headers within the one for all of it.
        api = self._api
        self.connection = self.request
        self.peer = cast(Peer, self.client_address)  # read at accept, before any byte
        self._request_deadline = Deadline(api.timeout)
        self._io = DeadlineIO(self.connection, Deadline(min(api.header_timeout, api.timeout)))
        self.rfile = io.BufferedReader(self._io)
        self.wfile = io.BufferedWriter(self._io)

    def parse_request(self) -> bool:
        # The check sits here so that it runs after the request line is read (we need to
        # answer in HTTP) but before any body is read or any route runs, whatever the method.
        if not super().parse_request():
            return False
        self._io.deadline = self._request_deadline  # the head is in: the body has the rest
        api = self._api
        peer = self.peer
        assert peer is not None
        if peer_allowed(peer, api.own_uid, api.group_gid):
            return True
        message = f"permission denied: uid {peer.uid} is not root"
        if api.group is not None:
            message += f" or in group {api.group}"
        log.warning(
            "api.denied",
            pid=peer.pid,
            uid=peer.uid,
            gid=peer.gid,
            method=self.command,
            path=self.path,
        )
        self._send_json(403, {"error": message})
        return False

    def _dispatch(self) -> None:
        # The request line was decoded as Latin-1, which gives its bytes back exactly.
        raw_path, _, raw_query = self.path.encode("latin-1").partition(b"?")
        path = decode_path(raw_path)
        methods = self._api.routes.get(path)
        if methods is None:
            self._send_json(404, {"error": f"no such endpoint: {path}"})
            return
        handler = methods.get(self.command)
        if handler is None:
            allowed = [m for m in METHODS if m in methods]
            error = f"method {self.command} not allowed; use {' or '.join(allowed)}"
            self._send_json(405, {"error": error}, allow=", ".join(allowed))
            return
        try:
            query = decode_query(raw_query)
        except ValueError as exc:
            self._send_json(400, {"error": str(exc)})
            return
        body = self._read_body() if self.command in _WITH_BODY else {}
        if body is None or self._api.closing:
            return
        assert self.peer is not None
        request = Request(self.command, path, query, self.peer, body)
        try:
            answer = encode(handler(request))
        except Refused as exc:
            self._send_json(status_of(exc), {"error": str(exc)})
            return
        except Exception as exc:
            log.error("api.route_failed", method=self.command, path=path, exc_info=True)
            self._send_json(500, {"error": f"internal error: {_one_line(exc)}"})
            return
        self._send_body(200, answer)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _dispatch

    def _read_body(self) -> dict[str, Any] | None:
        """The request's JSON object, or None once an error has been answered."""
        lengths = self.headers.get_all("Content-Length") or []
        if "Transfer-Encoding" in self.headers or not lengths:
            self._send_json(411, {"error": f"a {self.command} needs a Content-Length header"})
            return None
        text = lengths[0].strip()
        if len(set(lengths)) != 1 or not (text.isascii() and text.isdigit()):
            self._send_json(400, {"error": f"bad Content-Length: {', '.join(lengths)}"})
            return None
        if len(text) > len(str(MAX_BODY)) or int(text) > MAX_BODY:
            error = f"the body is {text} bytes, over the {MAX_BODY}-byte limit"
            self._send_json(413, {"error": error})
            return None
        length = int(text)
        raw = self.rfile.read(length)
        if len(raw) != length:
            self._send_json(400, {"error": f"the body ended after {len(raw)} of {length} bytes"})
            return None
        try:
            return decode_object(raw)
        except ValueError as exc:
            self._send_json(400, {"error": str(exc)})
            return None

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests get the same JSON error shape as everything else, not HTML."""
        self.close_connection = True
        default = self.responses.get(code, ("error", ""))[0]
        self._send_json(code, {"error": message or default})

    def _send_json(self, code: int, obj: object, allow: str | None = None) -> None:
        self._send_body(code, encode(obj), allow)

    def _send_body(self, code: int, body: bytes, allow: str | None = None) -> None:
        self._io.deadline = Deadline(self._api.timeout)  # the answer gets its own time to leave
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if allow is not None:
            self.send_header("Allow", allow)
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(body)

    def address_string(self) -> str:
        # client_address is '' on a Unix socket; the default would raise IndexError.
        return "unix" if self.peer is None else f"pid {self.peer.pid}"

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        peer = self.peer
        log.debug(
            "api.request",
            # A request that failed to parse has no command or path yet.
            method=getattr(self, "command", None),
            path=getattr(self, "path", None),
            status=int(code) if isinstance(code, int) else code,
            uid=None if peer is None else peer.uid,
            pid=None if peer is None else peer.pid,
        )

    def log_message(self, format: str, *args: Any) -> None:
        # Only protocol trouble (bad request lines, timeouts) still arrives here.
        log.debug("api.http", message=format % args)


def _check_routes(routes: Routes) -> dict[str, dict[str, Handler]]:
    for path, methods in routes.items():
        unknown = sorted(set(methods) - set(METHODS))
        if unknown or not methods:
            raise ValueError(f"route {path}: methods must be among {METHODS}, not {unknown}")
    return {path: dict(methods) for path, methods in routes.items()}


@dataclass(slots=True)
class _Waiting:
    """A connection accepted, its peer known, waiting for a slot until `until`."""

    conn: socket.socket
    peer: Peer
    privileged: bool
    until: float


class ApiServer:
    """The local API; `start()` binds and serves in a background thread, `close()` undoes it.

    The limits below are read at `start()`."""

    max_connections = 32
    """Connections served at once, by every caller together."""
    reserved_connections = 8
    """Of those, kept for root and the daemon's own user."""
    per_uid_connections = 8
    """Connections any other uid is served on at once."""
    max_waiting = 128
    """Connections accepted and waiting for a slot, by every caller together."""
    reserved_waiting = 32
    """Of those, kept for root and the daemon's own user."""
    per_uid_waiting = 16
    """Connections any other uid may have waiting; more are refused with 429."""
    header_timeout = 3.0
    """Seconds a client has, once served, to send its request line and headers."""
    timeout = 10.0
    """Seconds a client has to send its whole request, and to take the whole answer; also
    how long a connection may wait for a slot."""

    def __init__(self, socket_path: str, routes: Routes, group: str | None = None) -> None:
        self.socket_path = socket_path
        self.group = group
        self.group_gid: int | None = None
        self.own_uid = os.geteuid()
        self.routes = _check_routes(routes)
        self.closing = False
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._identity: Identity | None = None
        self._stop = threading.Event()
        self._slots = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._serving = Pool(0, 0, 0)
        self._waiting = Pool(0, 0, 0)
        self._queue: deque[_Waiting] = deque()
        self._refusals: dict[tuple[int, int], tuple[float, int]] = {}
        self._selector: selectors.BaseSelector | None = None
        self._lingering: dict[socket.socket, tuple[int, float]] = {}  # conn: (uid, until)

    def start(self) -> None:
        if self._listener is not None or self.closing:
            raise NodeagentError(f"the API server on {self.socket_path} is already started")
        gid = None if self.group is None else resolve_group(self.group, "the API socket")
        listener, self._identity = listen_unix(self.socket_path, gid, "the API socket")
        self.group_gid = gid
        self._serving = Pool(
            self.max_connections, self.reserved_connections, self.per_uid_connections
        )
        self._waiting = Pool(self.max_waiting, self.reserved_waiting, self.per_uid_waiting)
        self._wake_r, self._wake_w = socket.socketpair()  # pokes the accept loop
        self._wake_w.setblocking(False)
        self._wake_r.setblocking(False)
        self._listener = listener
        # Made here, not in the thread, so that it cannot fail for want of descriptors later.
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector = selector
        self._thread = threading.Thread(
            target=self._accept_loop, args=(listener, selector), name="nodeagent-api", daemon=True
        )
        self._thread.start()
        log.info("api.listening", socket=self.socket_path, group=self.group)

    # --- accepting ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, selector: selectors.BaseSelector) -> None:
        failures = 0
        with selector:
            while not self.closing:
                ready = {key.fileobj for key, _ in selector.select(self._until_next_expiry())}
                if self._wake_r in ready:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                if self.closing:
                    return
                self._linger(ready)
                self._admit_waiting()
                if listener not in ready:
                    continue
                for _ in range(_ACCEPT_BATCH):
                    try:
                        conn, _ = listener.accept()
                    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                        break  # none left, a signal, or a client that gave up
                    except OSError as exc:
                        # EMFILE, ENFILE, ENOBUFS, ENOMEM: the listener stays readable, so
                        # retrying at once would spin; wait, longer each time, and retry.
                        if failures == 0:
                            log.error(
                                "api.accept_failed", error=_one_line(exc), action="backing off"
                            )
                        failures += 1
                        if self._stop.wait(min(_BACKOFF_FIRST * 2 ** (failures - 1), _BACKOFF_MAX)):
                            return
                        break
                    if failures:
                        log.info("api.accept_recovered", failures=failures)
                        failures = 0
                    self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve `conn`, make it wait, or refuse it: by who is on the other end."""
        try:
            peer = read_peer(conn)
        except OSError as exc:
            log.warning("api.peercred_failed", error=_one_line(exc))
            conn.close()
            return
        privileged = peer.uid in (0, self.own_uid)
        with self._slots:
            if self.closing:
                conn.close()
                return
            if self._serving.fits(peer.uid, privileged):
                self._serve_in_thread(conn, peer, privileged)
                return
            if self._waiting.fits(peer.uid, privileged):
                self._waiting.take(peer.uid, privileged)
                until = time.monotonic() + self.timeout
                self._queue.append(_Waiting(conn, peer, privileged, until))
                return
        if privileged:
            why = f"{self.max_connections} served and {self.max_waiting} waiting"
            message = f"too many connections: {why} at once"
        else:
            why = f"at most {self.per_uid_connections} served and {self.per_uid_waiting} waiting"
            message = f"too many connections from uid {peer.uid}: {why} at once"
        self._refuse(conn, peer, 429, message)

    def _admit_waiting(self) -> None:
        """Serve the waiting connections that now have a slot, in the order they came;
        tell those whose time ran out that the daemon is busy."""
        now = time.monotonic()
        expired: list[_Waiting] = []
        with self._slots:
            left: deque[_Waiting] = deque()
            for w in self._queue:
                if self._serving.fits(w.peer.uid, w.privileged):
                    self._waiting.give(w.peer.uid, w.privileged)
                    self._serve_in_thread(w.conn, w.peer, w.privileged)
                elif now >= w.until:
                    self._waiting.give(w.peer.uid, w.privileged)
                    expired.append(w)
                else:
                    left.append(w)
            self._queue = left
        for w in expired:
            message = f"no connection slot for uid {w.peer.uid} within {self.timeout:g}s"
            self._refuse(w.conn, w.peer, 503, f"the daemon is busy: {message}")

    def _until_next_expiry(self) -> float | None:
        with self._slots:
            ends = [w.until for w in self._queue]
        ends += [until for _, until in self._lingering.values()]
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def _refuse(self, conn: socket.socket, peer: Peer, status: int, message: str) -> None:
        """Answer `status` without reading the request and end our side; never blocks. The
        connection lingers until its client hangs up (`_linger`)."""
        body = encode({"error": message})
        reason = BaseHTTPRequestHandler.responses.get(status, ("error", ""))[0]
        head = (
            f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.send(head.encode() + body)
            conn.shutdown(socket.SHUT_WR)
        self._log_refusal(peer, status, message)
        if self._drained(conn) or self._selector is None:
            conn.close()
            return
        # Closed now, a client that has not sent its request yet gets EPIPE when it does, and
        # one whose request we have not read gets a reset instead of the answer (af_unix):
        # keep it until it hangs up, within bounds, making room by closing the oldest of the
        # same uid, else the oldest of all.
        mine = [c for c, (uid, _) in self._lingering.items() if uid == peer.uid]
        if len(mine) >= _LINGER_PER_UID:
            self._stop_lingering(mine[0])
        elif len(self._lingering) >= _LINGER_MAX:
            self._stop_lingering(next(iter(self._lingering)))
        self._lingering[conn] = (peer.uid, time.monotonic() + _LINGER)
        self._selector.register(conn, selectors.EVENT_READ)

    @staticmethod
    def _drained(conn: socket.socket) -> bool:
        """Read and drop what the client has sent so far; whether it has hung up."""
        try:
            while True:
                if not conn.recv(MAX_BODY):
                    return True
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _linger(self, ready: set[Any]) -> None:
        """Close the refused connections whose client hung up, or whose time is up."""
        now = time.monotonic()
        for conn, (_, until) in list(self._lingering.items()):
            if now >= until or (conn in ready and self._drained(conn)):
                self._stop_lingering(conn)

    def _stop_lingering(self, conn: socket.socket) -> None:
        del self._lingering[conn]
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):  # closed with the loop
                self._selector.unregister(conn)
        conn.close()

    def _log_refusal(self, peer: Peer, status: int, message: str) -> None:
        """One api.refused line per uid and status every few seconds, with how many more."""
        now = time.monotonic()
        last, since = self._refusals.get((peer.uid, status), (-_REFUSAL_LOG_EVERY, 0))
        if now - last < _REFUSAL_LOG_EVERY:
            self._refusals[(peer.uid, status)] = (last, since + 1)
            return
        self._refusals[(peer.uid, status)] = (now, 0)
        log.warning(
            "api.refused", uid=peer.uid, pid=peer.pid, status=status, error=message, more=since
        )

    def _serve_in_thread(self, conn: socket.socket, peer: Peer, privileged: bool) -> None:
        """With the lock held: take a slot and start the connection's thread."""
        self._serving.take(peer.uid, privileged)
        self._connections.add(conn)
        try:
            threading.Thread(
                target=self._serve,
                args=(conn, peer, privileged),
                name="nodeagent-api-conn",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # no thread to be had: drop this one, keep accepting
            log.error("api.thread_failed", error=_one_line(exc))
            conn.close()
            self._connections.discard(conn)
            self._serving.give(peer.uid, privileged)

    def _serve(self, conn: socket.socket, peer: Peer, privileged: bool) -> None:
        try:
            _Handler(conn, peer, cast(Any, self))
        except OSError as exc:
            # The client went away, or close() shut the connection down.
            log.debug("api.connection_lost", error=_one_line(exc))
        except Exception:
            log.error("api.handler_failed", exc_info=True)
        finally:
            conn.close()
            with self._slots:
                self._connections.discard(conn)
                self._serving.give(peer.uid, privileged)
                self._slots.notify_all()
            with contextlib.suppress(OSError):  # full: the loop is awake already
                self._wake_w.send(b"x")

    # --- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, end every open connection unanswered, and remove the socket file
        (unless someone else has replaced it)."""
        listener, thread = self._listener, self._thread
        if listener is None:
            return
        self._listener = self._thread = None
        with self._slots:
            self.closing = True
            self._slots.notify_all()
            connections = list(self._connections)
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if thread is not None:
            thread.join(timeout=5)
        for conn in list(self._lingering):  # the accept loop has ended: no one else has them
            self._stop_lingering(conn)
        self._selector = None
        listener.close()
        with self._slots:
            waiting, self._queue = list(self._queue), deque()
        for w in waiting:
            w.conn.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._slots:
            self._slots.wait_for(lambda: not self._connections, timeout=5)
        self._wake_r.close()
        self._wake_w.close()
        unlink_if_ours(self.socket_path, self._identity)

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
