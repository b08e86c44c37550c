"""The API server: stdlib HTTP/1.0 on a Unix stream socket, one thread per connection.

Two independent gates guard it. The socket file is 0660 (owner root, group `group`), so the
kernel refuses strangers at connect(); and every request, whatever its method, is checked
again by its peer credentials, so a socket whose mode was loosened by hand still answers only
root, the daemon's own user and members of `group`. Routes get those credentials too, so a
write endpoint can check, say, that a pid belongs to its caller.

A busy or hostile client cannot take the daemon down with it: at most `max_connections`
are served at once and the rest wait in the kernel's listen queue (they cost the daemon no
file descriptor there); each request must arrive, and each answer leave, within `timeout`
seconds in total; an accept() that fails for want of file descriptors backs off instead of
spinning, so the reconcile loop keeps the descriptors it needs.
"""

from __future__ import annotations

import contextlib
import grp
import io
import os
import selectors
import socket
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, ClassVar, cast

import structlog

from nodeagent.api.peer import Peer, peer_allowed, read_peer
from nodeagent.api.wire import (
    MAX_BODY,
    Deadline,
    DeadlineIO,
    decode_object,
    decode_path,
    decode_query,
    encode,
)
from nodeagent.errors import NodeagentError

log = structlog.get_logger("nodeagent.api")

SOCKET_MODE = 0o660
DIR_MODE = 0o750
METHODS = ("GET", "POST", "DELETE")
"""The methods a route may declare, in the order an Allow header lists them."""
_WITH_BODY = frozenset({"POST", "DELETE"})
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 2.0  # seconds, for an accept() short of resources


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
"""Serves one method of one path: returns a JSON-serialisable object, or raises ApiError."""

Routes = Mapping[str, Mapping[str, Handler]]
"""Path -> method ("GET", "POST" or "DELETE") -> handler."""


class ApiError(NodeagentError):
    """Raised by a route to answer `status` with {"error": message}; use a subclass."""

    status: ClassVar[int] = 400


class ApiBadRequest(ApiError):
    """The request is well-formed HTTP and JSON but makes no sense (400)."""

    status = 400


class ApiForbidden(ApiError):
    """The caller may use the API but not do this (403), e.g. act on another user's pid."""

    status = 403


class ApiNotFound(ApiError):
    """The thing asked for does not exist (404)."""

    status = 404


class ApiConflict(ApiError):
    """The request clashes with the current state (409), e.g. a name already taken."""

    status = 409


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
        # Instead of StreamRequestHandler's per-read timeout: one deadline for the request.
        self.connection = self.request
        self._io = DeadlineIO(self.connection, Deadline(self._api.timeout))
        self.rfile = io.BufferedReader(self._io)
        self.wfile = io.BufferedWriter(self._io)
        try:
            self.peer = read_peer(self.connection)
        except OSError as exc:
            log.warning("api.peercred_failed", error=_one_line(exc))

    def parse_request(self) -> bool:
        # The check sits here so that it runs after the request line is read (we need to
        # answer in HTTP) but before any body is read or any route runs, whatever the method.
        if not super().parse_request():
            return False
        api = self._api
        peer = self.peer
        if peer is not None and peer_allowed(peer, api.own_uid, api.group_gid):
            return True
        uid = "unknown" if peer is None else str(peer.uid)
        message = f"permission denied: uid {uid} is not root"
        if api.group is not None:
            message += f" or in group {api.group}"
        log.warning(
            "api.denied",
            pid=None if peer is None else peer.pid,
            uid=None if peer is None else peer.uid,
            gid=None if peer is None else peer.gid,
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
        assert self.peer is not None  # parse_request let the request through
        request = Request(self.command, path, query, self.peer, body)
        try:
            answer = encode(handler(request))
        except ApiError as exc:
            self._send_json(exc.status, {"error": str(exc)})
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


def _resolve_group(name: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise NodeagentError(f"unknown group {name!r} for the API socket") from None


def _ensure_parent(parent: str, gid: int | None) -> None:
    """Create the socket's directory 0750 if missing; an existing one is the operator's choice.

    A directory we create also gets the socket's group, else group members could not reach
    the socket through it.
    """
    if os.path.isdir(parent):
        return
    try:
        os.makedirs(parent, exist_ok=True)
        os.chmod(parent, DIR_MODE)
        if gid is not None:
            os.chown(parent, -1, gid)
    except OSError as exc:
        raise NodeagentError(
            f"cannot create the API socket directory {parent}: {exc.strerror or exc}"
        ) from exc


def _clear_stale(path: str) -> None:
    """Remove a socket left by a dead daemon; refuse to touch a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise NodeagentError(f"refusing to bind the API socket: {path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: stale
        except OSError as exc:
            raise NodeagentError(
                f"cannot tell whether {path} is in use ({exc.strerror or exc}); "
                "remove it if no nodeagent is running"
            ) from exc
        else:
            raise NodeagentError(f"another nodeagent is already serving on {path}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    log.info("api.stale_socket_removed", socket=path)


def _check_routes(routes: Routes) -> dict[str, dict[str, Handler]]:
    for path, methods in routes.items():
        unknown = sorted(set(methods) - set(METHODS))
        if unknown or not methods:
            raise ValueError(f"route {path}: methods must be among {METHODS}, not {unknown}")
    return {path: dict(methods) for path, methods in routes.items()}


class ApiServer:
    """The local API; `start()` binds and serves in a background thread, `close()` undoes it."""

    max_connections = 32
    """Connections served at once; more wait in the listen queue until one ends."""
    timeout = 10.0
    """Seconds a client has to send its whole request, and to take the whole answer."""

    def __init__(self, socket_path: str, routes: Routes, group: str | None = None) -> None:
        self.socket_path = socket_path
        self.group = group
        self.group_gid: int | None = None
        self.own_uid = os.geteuid()
        self.routes = _check_routes(routes)
        self.closing = False
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._identity: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._slots = threading.Condition()
        self._connections: set[socket.socket] = set()

    def start(self) -> None:
        if self._listener is not None or self.closing:
            raise NodeagentError(f"the API server on {self.socket_path} is already started")
        path = self.socket_path
        gid = None if self.group is None else _resolve_group(self.group)
        _ensure_parent(os.path.dirname(os.path.abspath(path)) or "/", gid)
        _clear_stale(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
        except OSError as exc:
            listener.close()
            raise NodeagentError(
                f"cannot bind the API socket {path}: {exc.strerror or exc}"
            ) from exc
        try:
            # Mode and group are fixed between bind() and listen(): until listen() every
            # connect() is refused, so there is no window with looser permissions.
            st = os.stat(path)
            os.chmod(path, SOCKET_MODE)
            if gid is not None:
                os.chown(path, -1, gid)
            # The kernel caps this at net.core.somaxconn: a burst of CLI calls queues there.
            listener.listen(socket.SOMAXCONN)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise NodeagentError(
                f"cannot set up the API socket {path}: {exc.strerror or exc}"
            ) from exc
        self.group_gid = gid
        self._identity = (st.st_dev, st.st_ino)
        self._wake_r, self._wake_w = socket.socketpair()  # close() pokes the accept loop
        self._listener = listener
        # Made here, not in the thread, so that it cannot fail for want of descriptors later.
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(
            target=self._accept_loop, args=(listener, selector), name="nodeagent-api", daemon=True
        )
        self._thread.start()
        log.info("api.listening", socket=path, group=self.group)

    # --- accepting ------------------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket, selector: selectors.BaseSelector) -> None:
        failures = 0
        with selector:
            while self._free_slot():
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_r in ready:
                    return
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue  # another wake-up, a signal, or a client that gave up
                except OSError as exc:
                    # EMFILE, ENFILE, ENOBUFS, ENOMEM: the listener stays readable, so
                    # retrying at once would spin; wait, longer each time, and retry.
                    if failures == 0:
                        log.error("api.accept_failed", error=_one_line(exc), action="backing off")
                    failures += 1
                    if self._stop.wait(min(_BACKOFF_FIRST * 2 ** (failures - 1), _BACKOFF_MAX)):
                        return
                    continue
                if failures:
                    log.info("api.accept_recovered", failures=failures)
                    failures = 0
                self._serve_in_thread(conn)

    def _free_slot(self) -> bool:
        """Wait until fewer than max_connections are served; False once closing."""
        with self._slots:
            self._slots.wait_for(
                lambda: self.closing or len(self._connections) < self.max_connections
            )
            return not self.closing

    def _serve_in_thread(self, conn: socket.socket) -> None:
        with self._slots:
            if self.closing:
                conn.close()
                return
            self._connections.add(conn)
        try:
            threading.Thread(
                target=self._serve, args=(conn,), name="nodeagent-api-conn", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had: drop this one, keep accepting
            log.error("api.thread_failed", error=_one_line(exc))
            self._forget(conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            _Handler(conn, "", cast(Any, self))
        except OSError as exc:
            # The client went away, or close() shut the connection down.
            log.debug("api.connection_lost", error=_one_line(exc))
        except Exception:
            log.error("api.handler_failed", exc_info=True)
        finally:
            self._forget(conn)

    def _forget(self, conn: socket.socket) -> None:
        conn.close()
        with self._slots:
            self._connections.discard(conn)
            self._slots.notify_all()

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
        self._wake_w.send(b"x")
        if thread is not None:
            thread.join(timeout=5)
        listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with self._slots:
            self._slots.wait_for(lambda: not self._connections, timeout=5)
        self._wake_r.close()
        self._wake_w.close()
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

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
