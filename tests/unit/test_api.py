"""The local API over a real Unix socket: routing, errors, socket hygiene and peer credentials."""

from __future__ import annotations

import datetime as dt
import grp
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from nodeagent.api import client
from nodeagent.api.server import (
    ApiNotFound,
    ApiServer,
    Peer,
    Route,
    _proc_groups,
    peer_allowed,
    read_peer,
)
from nodeagent.errors import DaemonUnreachable, NodeagentError

NOBODY = 65534
NOGROUP = grp.getgrnam("nogroup").gr_gid
OTHER_GID = 4321  # a gid nobody's credentials never carry

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chgrp and setuid")


@pytest.fixture(autouse=True)
def fast_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ApiServer, "poll_interval", 0.02)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    """A directory that an unprivileged child can traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="nodeagent-api-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def serve(sockdir: Path) -> Iterator[Callable[..., ApiServer]]:
    started: list[ApiServer] = []

    def start(
        routes: Mapping[str, Route], group: str | None = None, path: Path | None = None
    ) -> ApiServer:
        server = ApiServer(str(path or sockdir / "api.sock"), routes, group=group)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def echo(params: Mapping[str, str]) -> object:
    return {"params": dict(params), "when": dt.date(2024, 1, 2)}


def raw_request(path: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Speak HTTP by hand so that headers and exact bodies can be asserted."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


def make_stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed daemon leaves behind."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def as_user(uid: int, gid: int, groups: list[int], action: Callable[[], str]) -> str:
    """Run `action` in a forked child with the given credentials; return what it reports."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(read_end)
            try:
                os.setgroups(groups)
                os.setgid(gid)
                os.setuid(uid)
                result = action()
            except BaseException as exc:
                result = f"{type(exc).__name__}: {exc}"
            os.write(write_end, result.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read().decode()
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    return output


def child_raw_get(path: str) -> Callable[[], str]:
    def action() -> str:
        status, _, body = raw_request(path, b"GET /v1/echo HTTP/1.0\r\n\r\n")
        return f"{status} {body.decode()}"

    return action


def child_client_get(path: str) -> Callable[[], str]:
    def action() -> str:
        return json.dumps(client.get(path, "/v1/echo", {"who": "child"}), sort_keys=True)

    return action


# --- routing and responses ---------------------------------------------------------------


def test_route_receives_query_and_returns_json(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    got = client.get(server.socket_path, "/v1/echo", {"name": "a b", "n": "1"})
    assert got == {"params": {"name": "a b", "n": "1"}, "when": "2024-01-02"}


def test_response_is_compact_sorted_json(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": lambda _: {"b": 1, "a": [1, 2]}})
    status, headers, body = raw_request(server.socket_path, b"GET /v1/echo HTTP/1.0\r\n\r\n")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert body == b'{"a": [1, 2], "b": 1}'
    assert headers["Content-Length"] == str(len(body))


def test_unknown_path_is_404(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    status, _, body = raw_request(server.socket_path, b"GET /v1/nope HTTP/1.0\r\n\r\n")
    assert status == 404
    assert json.loads(body) == {"error": "no such endpoint: /v1/nope"}
    with pytest.raises(NodeagentError, match=r"^no such endpoint: /v1/nope$"):
        client.get(server.socket_path, "/v1/nope")


def test_route_not_found_is_404_with_its_message(serve: Callable[..., ApiServer]) -> None:
    def missing(params: Mapping[str, str]) -> object:
        raise ApiNotFound(f"no workload named {params['name']!r}")

    server = serve({"/v1/workload": missing})
    with pytest.raises(NodeagentError, match=r"^no workload named 'web'$") as info:
        client.get(server.socket_path, "/v1/workload", {"name": "web"})
    assert not isinstance(info.value, DaemonUnreachable)


def test_route_crash_is_one_line_500(serve: Callable[..., ApiServer]) -> None:
    def broken(_: Mapping[str, str]) -> object:
        raise RuntimeError("disk on fire\nsecond line")

    server = serve({"/v1/broken": broken})
    status, _, body = raw_request(server.socket_path, b"GET /v1/broken HTTP/1.0\r\n\r\n")
    assert status == 500
    assert json.loads(body) == {"error": "internal error: RuntimeError: disk on fire second line"}
    with pytest.raises(NodeagentError) as info:
        client.get(server.socket_path, "/v1/broken")
    assert str(info.value) == (
        "nodeagent API error 500 on /v1/broken: internal error: RuntimeError: disk on fire "
        "second line"
    )
    # The server survives a crashing route.
    status, _, _ = raw_request(server.socket_path, b"GET /v1/broken HTTP/1.0\r\n\r\n")
    assert status == 500


def test_only_get_is_allowed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    request = b"POST /v1/echo HTTP/1.0\r\nContent-Length: 0\r\n\r\n"
    status, headers, body = raw_request(server.socket_path, request)
    assert status == 405
    assert headers["Allow"] == "GET"
    assert json.loads(body) == {"error": "method POST not allowed; use GET"}


def test_malformed_request_gets_json_error(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    status, headers, body = raw_request(server.socket_path, b"GET /v1/e cho HTTP/1.0\r\n\r\n")
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": "Bad request syntax ('GET /v1/e cho HTTP/1.0')"}


def test_repeated_query_parameter_is_400(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    status, _, body = raw_request(server.socket_path, b"GET /v1/echo?a=1&a=2 HTTP/1.0\r\n\r\n")
    assert status == 400
    assert json.loads(body) == {"error": "query parameter 'a' given more than once"}


# --- client errors -----------------------------------------------------------------------


def test_client_without_daemon(sockdir: Path) -> None:
    path = str(sockdir / "api.sock")
    with pytest.raises(DaemonUnreachable) as info:
        client.get(path, "/v1/echo")
    assert str(info.value) == (
        f"no nodeagent daemon is running (nothing answers on {path}); "
        "start it with 'systemctl start nodeagent' or 'nodeagent run --config FILE'"
    )


def test_client_with_stale_socket(sockdir: Path) -> None:
    path = sockdir / "api.sock"
    make_stale_socket(path)
    with pytest.raises(DaemonUnreachable, match="no nodeagent daemon is running"):
        client.get(str(path), "/v1/echo")


def test_client_after_close(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    server.close()
    assert not os.path.lexists(server.socket_path)
    with pytest.raises(DaemonUnreachable):
        client.get(server.socket_path, "/v1/echo")


def test_client_times_out_on_a_silent_listener(sockdir: Path) -> None:
    path = str(sockdir / "api.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        with pytest.raises(NodeagentError, match=r"did not answer within 0\.2s$"):
            client.get(path, "/v1/echo", timeout=0.2)


# --- socket hygiene ----------------------------------------------------------------------


def test_socket_mode_is_0660_and_group_stays_root(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    st = os.stat(server.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getegid()


@needs_root
def test_missing_parent_is_created_0750_with_the_group(
    serve: Callable[..., ApiServer], sockdir: Path
) -> None:
    path = sockdir / "run" / "nodeagent" / "api.sock"
    serve({"/v1/echo": echo}, group="nogroup", path=path)
    parent = os.stat(path.parent)
    assert stat.S_IMODE(parent.st_mode) == 0o750
    assert parent.st_gid == NOGROUP
    sock = os.stat(path)
    assert stat.S_IMODE(sock.st_mode) == 0o660
    assert sock.st_gid == NOGROUP


def test_existing_parent_is_left_alone(serve: Callable[..., ApiServer], sockdir: Path) -> None:
    serve({"/v1/echo": echo})
    assert stat.S_IMODE(os.stat(sockdir).st_mode) == 0o755


def test_numeric_group_is_accepted(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo}, group=str(NOGROUP))
    assert os.stat(server.socket_path).st_gid == NOGROUP


def test_unknown_group_is_refused(sockdir: Path) -> None:
    path = sockdir / "api.sock"
    server = ApiServer(str(path), {"/v1/echo": echo}, group="no-such-group-xyz")
    with pytest.raises(NodeagentError, match="unknown group 'no-such-group-xyz'"):
        server.start()
    assert not path.exists()


def test_second_server_on_a_live_socket_is_refused(serve: Callable[..., ApiServer]) -> None:
    first = serve({"/v1/echo": echo})
    second = ApiServer(first.socket_path, {"/v1/echo": lambda _: "impostor"})
    with pytest.raises(NodeagentError) as info:
        second.start()
    assert str(info.value) == f"another nodeagent is already serving on {first.socket_path}"
    # The first one is untouched and still answers.
    assert client.get(first.socket_path, "/v1/echo")["params"] == {}  # type: ignore[index]


def test_stale_socket_is_replaced(serve: Callable[..., ApiServer], sockdir: Path) -> None:
    path = sockdir / "api.sock"
    make_stale_socket(path)
    serve({"/v1/echo": echo}, path=path)
    assert client.get(str(path), "/v1/echo", {"x": "1"}) == {
        "params": {"x": "1"},
        "when": "2024-01-02",
    }
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
def test_refuses_a_path_that_is_not_a_socket(sockdir: Path, kind: str) -> None:
    path = sockdir / "api.sock"
    if kind == "file":
        path.write_text("precious")
    elif kind == "dir":
        path.mkdir()
    else:
        make_stale_socket(sockdir / "real.sock")
        path.symlink_to(sockdir / "real.sock")
    server = ApiServer(str(path), {"/v1/echo": echo})
    with pytest.raises(NodeagentError) as info:
        server.start()
    assert str(info.value) == (
        f"refusing to bind the API socket: {path} exists and is not a socket"
    )
    assert os.path.lexists(path)
    if kind == "file":
        assert path.read_text() == "precious"


def test_close_leaves_a_replacement_socket_alone(
    serve: Callable[..., ApiServer], sockdir: Path
) -> None:
    server = serve({"/v1/echo": echo})
    path = Path(server.socket_path)
    path.unlink()
    make_stale_socket(path)  # someone else's socket now lives at the path
    replacement = os.stat(path).st_ino
    server.close()
    assert os.stat(path).st_ino == replacement


def test_start_twice_is_an_error(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    with pytest.raises(NodeagentError, match="already started"):
        server.start()


def test_context_manager_starts_and_cleans_up(sockdir: Path) -> None:
    path = str(sockdir / "api.sock")
    with ApiServer(path, {"/v1/echo": echo}):
        assert client.get(path, "/v1/echo")["when"] == "2024-01-02"  # type: ignore[index]
    assert not os.path.lexists(path)


# --- peer credentials --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "group_gid", "allowed"),
    [
        (Peer(pid=1, uid=0, gid=0, groups=frozenset()), None, True),  # root
        (Peer(pid=1, uid=1000, gid=1000, groups=frozenset()), None, True),  # daemon's own user
        (Peer(pid=1, uid=2000, gid=2000, groups=frozenset()), None, False),
        (Peer(pid=1, uid=2000, gid=2000, groups=frozenset({50})), None, False),  # no group
        (Peer(pid=1, uid=2000, gid=50, groups=frozenset()), 50, True),  # primary group
        (Peer(pid=1, uid=2000, gid=2000, groups=frozenset({7, 50})), 50, True),  # supplementary
        (Peer(pid=1, uid=2000, gid=2000, groups=frozenset({7})), 50, False),
        (Peer(pid=1, uid=0, gid=0, groups=frozenset()), 50, True),  # root needs no group
    ],
)
def test_peer_allowed(peer: Peer, group_gid: int | None, allowed: bool) -> None:
    assert peer_allowed(peer, own_uid=1000, group_gid=group_gid) is allowed


def test_read_peer_reports_this_process() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        peer = read_peer(left)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert peer.groups == frozenset(os.getgroups())


def test_proc_groups_fallback_matches_getgroups() -> None:
    assert _proc_groups(os.getpid()) == frozenset(os.getgroups())
    assert _proc_groups(2**22 + 12345) == frozenset()  # no such process: no groups


@needs_root
def test_root_is_allowed_end_to_end(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo}, group="nogroup")
    status, _, _ = raw_request(server.socket_path, b"GET /v1/echo HTTP/1.0\r\n\r\n")
    assert status == 200


@needs_root
def test_stranger_is_stopped_by_the_socket_mode(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo})
    result = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert result == (
        f"NodeagentError: permission denied on {server.socket_path}: "
        "run as root or as a member of the socket's group"
    )


@needs_root
def test_stranger_gets_403_even_if_the_mode_was_loosened(
    serve: Callable[..., ApiServer],
) -> None:
    server = serve({"/v1/echo": echo})
    os.chmod(server.socket_path, 0o666)  # an operator's mistake; the peer check still holds
    result = as_user(NOBODY, NOGROUP, [], child_raw_get(server.socket_path))
    assert result == '403 {"error": "permission denied: uid 65534 is not root"}'
    denied = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert denied.startswith(f"NodeagentError: permission denied on {server.socket_path}")


@needs_root
def test_stranger_outside_the_group_gets_403(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo}, group="nogroup")
    os.chmod(server.socket_path, 0o666)
    result = as_user(NOBODY, OTHER_GID, [], child_raw_get(server.socket_path))
    assert result == (
        '403 {"error": "permission denied: uid 65534 is not root or in group nogroup"}'
    )


@needs_root
def test_group_member_by_primary_gid_is_allowed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo}, group="nogroup")
    result = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert json.loads(result) == {"params": {"who": "child"}, "when": "2024-01-02"}


@needs_root
def test_group_member_by_supplementary_gid_is_allowed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": echo}, group="nogroup")
    result = as_user(NOBODY, OTHER_GID, [NOGROUP], child_client_get(server.socket_path))
    assert json.loads(result) == {"params": {"who": "child"}, "when": "2024-01-02"}
