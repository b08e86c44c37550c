"""The API server: stdlib HTTP/1.0 on a Unix stream socket, one thread per connection.

Two independent gates guard it. The socket file is 0660 (owner root, group `group`), so the
kernel refuses strangers at connect(); and every request, whatever its method, is checked
again by its peer credentials, so a socket whose mode was loosened by hand still answers only
root, the daemon's own user and members of `group`. Routes get those credentials too, so a
write endpoint can check, say, that a pid belongs to its caller.

No caller can take the API away from the others. The HTTP core (nodeagent.api.httpcore)
accepts every connection at once and reads its peer credentials before any byte of its
request; this server then serves it, makes it wait, or tells it no (429) by who holds the
slots (`httpcore.Pool`, the one per-peer scheme the metrics endpoint shares): at most
`max_connections` are served at once, of which `reserved_connections` are kept for root and
the daemon's own user, and any other uid is served on at most `per_uid_connections` at once,
with up to `per_uid_waiting` more waiting their turn in the daemon (the waiting room has the
same shape). A waiting connection that gets no slot within `timeout` is told the daemon is
busy (503). A served one gets a thread of its own, for a route may block: it has
`header_timeout` seconds for its request line and headers, the whole request `timeout`
seconds, and its answer `timeout` seconds to leave. The core keeps a refused connection,
briefly and a bounded number per uid, until its client has sent its request and hung up,
and backs off an accept() short of file descriptors.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, Generic, TypeVar, cast

import structlog
from pydantic import BaseModel

from nodeagent.api.bodies import parse
from nodeagent.api.httpcore import Caller, HttpCore, Pool, one_line, response
from nodeagent.api.peer import Peer, peer_allowed
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
_JSON = "application/json"


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

B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Checked(Generic[B]):
    """A handler whose request body is a `model`: `prepared` checks the body where it is
    called, and what it returns runs `then` with the checked body. A command's body is so
    checked at the API's edge, on the thread that read the request, and only a good one is
    posted to the loop (nodeagent.commands); called whole, it does both in turn."""

    model: type[B]
    then: Callable[[Request, B], object]

    def __call__(self, request: Request) -> object:
        return self.prepared(request)()

    def prepared(self, request: Request) -> Callable[[], object]:
        """BadRequest naming the body's first problem, or the rest of the handler."""
        return partial(self.then, request, parse(self.model, request.body))


def prepared(handler: Handler, request: Request) -> Callable[[], object]:
    """`handler` for `request`, its body checked now where it declares one (Checked)."""
    if isinstance(handler, Checked):
        return handler.prepared(request)
    return partial(handler, request)


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
            self._send_json(500, {"error": f"internal error: {one_line(exc)}"})
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
        self.send_header("Content-Type", _JSON)
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
    """A connection accepted, its caller known, waiting for a slot until `until`."""

    conn: socket.socket
    caller: Caller
    until: float


class ApiServer(HttpCore):
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
        self.routes = _check_routes(routes)
        super().__init__("api", own_uid=os.geteuid())
        self.socket_path = socket_path
        self.group = group
        self._started = False
        self._identity: Identity | None = None
        self._slots = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._serving = Pool(0, 0, 0)
        self._waiting = Pool(0, 0, 0)
        self._queue: deque[_Waiting] = deque()

    def start(self) -> None:
        if self._started or self.closing:
            raise NodeagentError(f"the API server on {self.socket_path} is already started")
        gid = None if self.group is None else resolve_group(self.group, "the API socket")
        listener, self._identity = listen_unix(self.socket_path, gid, "the API socket")
        self.group_gid = gid
        self._serving = Pool(
            self.max_connections, self.reserved_connections, self.per_uid_connections
        )
        self._waiting = Pool(self.max_waiting, self.reserved_waiting, self.per_uid_waiting)
        self._started = True
        self.serve(listener)
        log.info("api.listening", socket=self.socket_path, group=self.group)

    # --- admitting (in the core's thread) --------------------------------------------------

    def admit(self, conn: socket.socket, caller: Caller) -> None:
        """Serve `conn`, make it wait, or refuse it: by who is on the other end."""
        with self._slots:
            if self.closing:
                conn.close()
                return
            if self._serving.fits(caller.uid, caller.uncapped):
                self._serve_in_thread(conn, caller)
                return
            if self._waiting.fits(caller.uid, caller.uncapped):
                self._waiting.take(caller.uid, caller.uncapped)
                self._queue.append(_Waiting(conn, caller, time.monotonic() + self.timeout))
                return
        if caller.uncapped:
            why = f"{self.max_connections} served and {self.max_waiting} waiting"
            message = f"too many connections: {why} at once"
        else:
            why = f"at most {self.per_uid_connections} served and {self.per_uid_waiting} waiting"
            message = f"too many connections from uid {caller.uid}: {why} at once"
        self._refuse(conn, caller, 429, message)

    def wakes(self, now: float) -> list[float]:
        with self._slots:
            return [w.until for w in self._queue]

    def due(self, now: float) -> None:
        """Serve the waiting connections that now have a slot, in the order they came;
        tell those whose time ran out that the daemon is busy."""
        expired: list[_Waiting] = []
        with self._slots:
            left: deque[_Waiting] = deque()
            for w in self._queue:
                if self._serving.fits(w.caller.uid, w.caller.uncapped):
                    self._waiting.give(w.caller.uid, w.caller.uncapped)
                    self._serve_in_thread(w.conn, w.caller)
                elif now >= w.until:
                    self._waiting.give(w.caller.uid, w.caller.uncapped)
                    expired.append(w)
                else:
                    left.append(w)
            self._queue = left
        for w in expired:
            message = f"no connection slot for uid {w.caller.uid} within {self.timeout:g}s"
            self._refuse(w.conn, w.caller, 503, f"the daemon is busy: {message}")

    def _refuse(self, conn: socket.socket, caller: Caller, status: int, message: str) -> None:
        answer = response(status, encode({"error": message}), _JSON, version="HTTP/1.0")
        self.refuse(conn, caller, status, answer, message)

    # --- serving (a thread per connection) -------------------------------------------------

    def _serve_in_thread(self, conn: socket.socket, caller: Caller) -> None:
        """With the lock held: take a slot and start the connection's thread."""
        self._serving.take(caller.uid, caller.uncapped)
        self._connections.add(conn)
        try:
            threading.Thread(
                target=self._serve, args=(conn, caller), name="nodeagent-api-conn", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had: drop this one, keep accepting
            log.error("api.thread_failed", error=one_line(exc))
            conn.close()
            self._connections.discard(conn)
            self._serving.give(caller.uid, caller.uncapped)

    def _serve(self, conn: socket.socket, caller: Caller) -> None:
        try:
            _Handler(conn, caller.peer, cast(Any, self))
        except OSError as exc:
            # The client went away, or close() shut the connection down.
            log.debug("api.connection_lost", error=one_line(exc))
        except Exception:
            log.error("api.handler_failed", exc_info=True)
        finally:
            conn.close()
            with self._slots:
                self._connections.discard(conn)
                self._serving.give(caller.uid, caller.uncapped)
                self._slots.notify_all()
            self.wake()

    # --- closing --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, end every open connection unanswered, and remove the socket file
        (unless someone else has replaced it)."""
        if not self._started or self.closing:
            return
        with self._slots:
            self.closing = True
            self._slots.notify_all()
            connections = list(self._connections)
        self.stop()
        with self._slots:
            waiting, self._queue = list(self._queue), deque()
        for w in waiting:
            w.conn.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._slots:
            self._slots.wait_for(lambda: not self._connections, timeout=5)
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
