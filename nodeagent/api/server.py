"""The API server: stdlib HTTP on a Unix stream socket, one daemon thread per connection.

Two independent gates guard it. The socket file is 0660 (owner root, group `group`), so the
kernel refuses strangers at connect(); and every accepted connection is checked again by its
peer credentials, so a socket whose mode was loosened by hand still answers only root, the
daemon's own user and members of `group`. Later write endpoints rely on the second gate.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import socket
import socketserver
import stat
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

import structlog

from nodeagent.errors import NodeagentError

log = structlog.get_logger("nodeagent.api")

Route = Callable[[Mapping[str, str]], object]
"""A GET endpoint: takes the query parameters, returns a JSON-serialisable object."""

SOCKET_MODE = 0o660
DIR_MODE = 0o750

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Not exported by Python's socket module; 59 on every Linux architecture nodeagent targets.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_NGROUPS_MAX = 65536
_GID = struct.Struct("I")


class ApiNotFound(NodeagentError):
    """Raised by a route when the thing asked for does not exist; the client gets a 404."""


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of the process on the other end of a connection, as the kernel saw them
    at connect() time (so a later setuid in the client changes nothing)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]


def peer_allowed(peer: Peer, own_uid: int, group_gid: int | None) -> bool:
    """The access decision: root, the daemon's own user, or a member of the socket's group."""
    if peer.uid in (0, own_uid):
        return True
    if group_gid is None:
        return False
    return peer.gid == group_gid or group_gid in peer.groups


def read_peer(conn: socket.socket) -> Peer:
    """Read SO_PEERCRED (and the peer's supplementary groups) from a connected Unix socket."""
    pid, uid, gid = _PEERCRED.unpack(
        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return Peer(pid=pid, uid=uid, gid=gid, groups=_peer_groups(conn, pid))


def _peer_groups(conn: socket.socket, pid: int) -> frozenset[int]:
    """Supplementary groups of the peer.

    SO_PEERGROUPS (Linux 4.13+) is captured at connect() time, so it cannot be fooled by the
    client exiting and its pid being reused; /proc/<pid>/status is only the fallback.
    """
    for size in (64 * _GID.size, _NGROUPS_MAX * _GID.size):
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            break
        return frozenset(g for (g,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size]))
    return _proc_groups(pid)


def _proc_groups(pid: int) -> frozenset[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parse_query(query: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key in params:
            raise ValueError(f"query parameter {key!r} given more than once")
        params[key] = value
    return params


def encode(obj: object) -> bytes:
    """The wire format of every response body."""
    return json.dumps(obj, indent=None, sort_keys=True, default=str).encode()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # a stuck client must never keep the daemon from exiting
    allow_reuse_address = False

    def __init__(
        self,
        path: str,
        routes: Mapping[str, Route],
        group_name: str | None,
        group_gid: int | None,
    ) -> None:
        super().__init__(path, _Handler, bind_and_activate=False)
        self.routes = routes
        self.group_name = group_name
        self.group_gid = group_gid
        self.own_uid = os.geteuid()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A handler crash is logged, never printed to stderr by socketserver."""
        log.error("api.handler_failed", exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server_version = "nodeagent"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads
    timeout = 10  # seconds a client may take to send its request
    peer: Peer | None = None

    @property
    def _srv(self) -> _Server:
        return cast(_Server, self.server)

    def setup(self) -> None:
        super().setup()
        try:
            self.peer = read_peer(self.connection)
        except OSError as exc:
            log.warning("api.peercred_failed", error=_one_line(exc))
            self.peer = None

    def parse_request(self) -> bool:
        # The check sits here so that it runs after the request line is read (we need to
        # answer in HTTP) but before any do_* method, whatever the method is.
        if not super().parse_request():
            return False
        srv = self._srv
        peer = self.peer
        if peer is not None and peer_allowed(peer, srv.own_uid, srv.group_gid):
            return True
        uid = "unknown" if peer is None else str(peer.uid)
        message = f"permission denied: uid {uid} is not root"
        if srv.group_name is not None:
            message += f" or in group {srv.group_name}"
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

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        route = self._srv.routes.get(url.path)
        if route is None:
            self._send_json(404, {"error": f"no such endpoint: {url.path}"})
            return
        try:
            params = _parse_query(url.query)
        except ValueError as exc:
            self._send_json(400, {"error": str(exc)})
            return
        try:
            body = encode(route(params))
        except ApiNotFound as exc:
            self._send_json(404, {"error": str(exc)})
            return
        except Exception as exc:
            log.error("api.route_failed", path=url.path, exc_info=True)
            self._send_json(500, {"error": f"internal error: {_one_line(exc)}"})
            return
        self._send_body(200, body)

    def _not_allowed(self) -> None:
        self._send_json(405, {"error": f"method {self.command} not allowed; use GET"}, allow="GET")

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests get the same JSON error shape as everything else, not HTML."""
        self.close_connection = True
        default = self.responses.get(code, ("error", ""))[0]
        self._send_json(code, {"error": message or default})

    def _send_json(self, code: int, obj: object, allow: str | None = None) -> None:
        self._send_body(code, encode(obj), allow)

    def _send_body(self, code: int, body: bytes, allow: str | None = None) -> None:
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


class ApiServer:
    """The local API; `start()` binds and serves in a background thread, `close()` undoes it."""

    poll_interval = 0.5  # seconds; bounds how long close() waits for the serving thread

    def __init__(
        self, socket_path: str, routes: Mapping[str, Route], group: str | None = None
    ) -> None:
        self.socket_path = socket_path
        self.group = group
        self._routes = dict(routes)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._identity: tuple[int, int] | None = None

    def start(self) -> None:
        if self._server is not None:
            raise NodeagentError(f"the API server on {self.socket_path} is already started")
        path = self.socket_path
        gid = None if self.group is None else _resolve_group(self.group)
        _ensure_parent(os.path.dirname(os.path.abspath(path)) or "/", gid)
        _clear_stale(path)
        server = _Server(path, self._routes, self.group, gid)
        try:
            server.server_bind()
        except OSError as exc:
            server.server_close()
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
            server.server_activate()
        except OSError as exc:
            server.server_close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise NodeagentError(
                f"cannot set up the API socket {path}: {exc.strerror or exc}"
            ) from exc
        self._identity = (st.st_dev, st.st_ino)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": self.poll_interval},
            name="nodeagent-api",
            daemon=True,
        )
        self._thread.start()
        log.info("api.listening", socket=path, group=self.group)

    def close(self) -> None:
        """Stop serving and remove the socket file, unless someone else has replaced it."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
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
