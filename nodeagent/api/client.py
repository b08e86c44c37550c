"""The CLI's side of the local API: one request per call, every failure a one-line error.

`timeout` is a deadline for the whole call (connect, send, every byte of the answer), so a
daemon that is stuck, or drips its answer, cannot hold the CLI. The socket connects in
blocking mode: when the daemon's listen queue is momentarily full, connect() waits for room
(up to the deadline, through SO_SNDTIMEO) instead of failing at once as a non-blocking
connect() on a Unix socket does.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import socket
import struct
from collections.abc import Mapping
from typing import TypeVar, cast

from pydantic import BaseModel, ValidationError

from nodeagent.api.wire import MAX_BODY, Deadline, DeadlineIO, encode, encode_query
from nodeagent.errors import DaemonUnreachable, NodeagentError

MAX_ANSWER = 256 * 1024 * 1024
"""The largest answer (bytes) the client reads; more is a broken or hostile daemon."""
ROUTE_ERRORS = frozenset({400, 403, 404, 409})
"""Statuses whose message a route wrote for the user: shown as they are."""


class ApiRefused(NodeagentError):
    """The daemon answered, but not 200: `status` says why (409: a name is taken, ...)."""

    def __init__(self, message: str, status: int, lines: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.lines = lines or [message]
        """The message as the daemon wrote it, line by line (a refused reload's problems,
        one a line); the message itself is on one line."""


A = TypeVar("A", bound=BaseModel)
"""An answer's model (nodeagent.api.answers)."""


class _DeadlineSocket:
    """What http.client needs of a socket, with every read and write bounded by a deadline."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self._io = DeadlineIO(sock, deadline)

    def sendall(self, data: bytes) -> None:
        self._io.write(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self._io)

    def close(self) -> None:
        """Nothing: http.client closes its connection as soon as an HTTP/1.0 answer's headers
        are in, before the body is read; the real socket is closed once the call is over."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTPConnection that dials a Unix socket; the host name only fills the Host header."""

    def __init__(self, socket_path: str, deadline: Deadline) -> None:
        super().__init__("localhost")
        self.socket_path = socket_path
        self.deadline = deadline
        self.unix_socket: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # struct timeval; all zero would mean "wait for ever"
            seconds, usec = divmod(max(1, int(self.deadline.left() * 1e6)), 1_000_000)
            timeval = struct.pack("ll", seconds, usec)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            sock.connect(self.socket_path)
        except BlockingIOError:  # EAGAIN: the listen queue stayed full until SO_SNDTIMEO
            sock.close()
            raise TimeoutError("the daemon's listen queue is full") from None
        except BaseException:
            sock.close()
            raise
        self.unix_socket = sock
        self.sock = cast(socket.socket, _DeadlineSocket(sock, self.deadline))


def _unreachable(socket_path: str) -> DaemonUnreachable:
    return DaemonUnreachable(
        f"no nodeagent daemon is running (nothing answers on {socket_path}); "
        "start it with 'systemctl start nodeagent' or 'nodeagent run --config FILE'"
    )


def _denied(socket_path: str) -> NodeagentError:
    return NodeagentError(
        f"permission denied on {socket_path}: run as root or as a member of the socket's group"
    )


def get(
    socket_path: str,
    path: str,
    params: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> object:
    """GET `path` from the daemon and return the decoded JSON body of a 200 answer."""
    return _call(socket_path, "GET", path, params=params, body=None, timeout=timeout)


def post(
    socket_path: str,
    path: str,
    body: Mapping[str, object],
    params: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> object:
    """POST the JSON object `body` to `path`; the decoded JSON body of a 200 answer."""
    return _call(socket_path, "POST", path, params=params, body=body, timeout=timeout)


def delete(
    socket_path: str,
    path: str,
    body: Mapping[str, object] | None = None,
    params: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> object:
    """DELETE `path`, with the JSON object `body` (empty by default)."""
    return _call(socket_path, "DELETE", path, params=params, body=body or {}, timeout=timeout)


def get_as(
    model: type[A],
    socket_path: str,
    path: str,
    *,
    params: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> A:
    """`get`, its answer validated as `model` (see `fit`)."""
    return fit(model, socket_path, path, get(socket_path, path, params, timeout))


def post_as(
    model: type[A],
    socket_path: str,
    path: str,
    body: Mapping[str, object],
    *,
    params: Mapping[str, str] | None = None,
    timeout: float = 5.0,
) -> A:
    """`post`, its answer validated as `model` (see `fit`)."""
    return fit(model, socket_path, path, post(socket_path, path, body, params, timeout))


def fit(model: type[A], socket_path: str, path: str, answer: object) -> A:
    """A 200 answer as `model`; one NodeagentError naming the socket, the path and the first
    thing that does not fit when it is not one (a daemon of another version, or something
    else answering on the socket)."""
    try:
        return model.model_validate(answer)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "the answer"
        raise NodeagentError(
            " ".join(
                f"the nodeagent daemon on {socket_path} answered {path} with what this"
                f" nodeagent does not expect ({where}: {first['msg']}); is the daemon the"
                " same version as this CLI?".split()
            )
        ) from None


def _call(
    socket_path: str,
    method: str,
    path: str,
    *,
    params: Mapping[str, str] | None,
    body: Mapping[str, object] | None,
    timeout: float,
) -> object:
    target = path if not params else f"{path}?{encode_query(params)}"
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = encode(body)
        if len(data) > MAX_BODY:
            raise NodeagentError(
                f"{method} {path}: the request is {len(data)} bytes, over the API's"
                f" {MAX_BODY}-byte limit"
            )
        headers["Content-Type"] = "application/json"
    conn = _UnixConnection(socket_path, Deadline(timeout))
    try:
        # A daemon that answers early (a 403 before our body, say) and hangs up breaks our
        # send; its answer is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, target, body=data, headers=headers)
        response = conn.getresponse()
        status = response.status
        if (response.length or 0) > MAX_ANSWER:
            raise NodeagentError(
                f"the nodeagent daemon on {socket_path} sent an answer of {response.length}"
                " bytes, too large to be one"
            )
        raw = response.read(MAX_ANSWER)
    except (FileNotFoundError, ConnectionRefusedError):
        raise _unreachable(socket_path) from None
    except PermissionError:
        raise _denied(socket_path) from None
    except TimeoutError:
        raise NodeagentError(
            f"the nodeagent daemon on {socket_path} did not answer within {timeout:g}s"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        detail = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise NodeagentError(
            f"talking to the nodeagent daemon on {socket_path}: {detail}"
        ) from None
    finally:
        conn.close()
        if conn.unix_socket is not None:
            conn.unix_socket.close()

    try:
        answer: object = json.loads(raw) if raw else None
    except ValueError:
        raise NodeagentError(
            f"the nodeagent daemon on {socket_path} sent a malformed answer (HTTP {status})"
        ) from None
    if status == 200:
        return answer
    message = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(message, str):
        message = raw.decode("utf-8", "replace").strip() or "no details"
    lines = [shown for line in message.splitlines() if (shown := " ".join(line.split()))]
    message = " ".join(message.split())  # one line, whatever the daemon sent
    if status in ROUTE_ERRORS:
        raise ApiRefused(message, status, lines)
    raise ApiRefused(f"nodeagent API error {status} on {path}: {message}", status)
