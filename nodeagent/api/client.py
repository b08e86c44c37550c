"""The CLI's side of the local API: one GET per call, every failure a one-line NodeagentError."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from urllib.parse import urlencode

from nodeagent.errors import DaemonUnreachable, NodeagentError

DEFAULT_SOCKET = "/run/nodeagent/nodeagent.sock"


class _UnixConnection(http.client.HTTPConnection):
    """HTTPConnection that dials a Unix socket; the host name only fills the Host header."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


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
    target = path if not params else f"{path}?{urlencode(params)}"
    conn = _UnixConnection(socket_path, timeout)
    try:
        conn.request("GET", target, headers={"Accept": "application/json"})
        response = conn.getresponse()
        status, raw = response.status, response.read()
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

    try:
        body: object = json.loads(raw) if raw else None
    except ValueError:
        raise NodeagentError(
            f"the nodeagent daemon on {socket_path} sent a malformed answer (HTTP {status})"
        ) from None
    if status == 200:
        return body
    message = body.get("error") if isinstance(body, dict) else None
    if not isinstance(message, str):
        message = raw.decode("utf-8", "replace").strip() or "no details"
    if status == 403:
        raise _denied(socket_path)
    if status == 404:
        raise NodeagentError(message)
    raise NodeagentError(f"nodeagent API error {status} on {path}: {message}")
