"""The local API over a real Unix socket: routing, errors, socket hygiene and peer credentials."""

from __future__ import annotations

import contextlib
import datetime as dt
import grp
import json
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from descriptors import accept_tries_while_out_of_fds
from peers import as_user, held_as
from waits import asleep_on, counted, wait_for

from nodeagent.api import client, httpcore
from nodeagent.api.peer import LoopbackPeers, Peer, peer_allowed, read_peer
from nodeagent.api.server import ApiServer, Handler, Request, Routes
from nodeagent.api.wire import MAX_BODY
from nodeagent.errors import (
    BadRequest,
    Conflict,
    DaemonUnreachable,
    Forbidden,
    NodeagentError,
    NotFound,
    Refused,
)

NOBODY = 65534
NOGROUP = grp.getgrnam("nogroup").gr_gid
OTHER_GID = 4321  # a gid nobody's credentials never carry

needs_root = pytest.mark.usefixtures("needs_root")  # fails, never skips, unless root


@pytest.fixture
def serve(sockdir: Path) -> Iterator[Callable[..., ApiServer]]:
    started: list[ApiServer] = []

    def start(routes: Routes, group: str | None = None, path: Path | None = None) -> ApiServer:
        server = ApiServer(str(path or sockdir / "api.sock"), routes, group=group)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def echo(request: Request) -> object:
    return {"params": dict(request.query), "when": dt.date(2024, 1, 2)}


def raw_request(path: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Speak HTTP by hand so that headers and exact bodies can be asserted."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # all sent: a short body ends here
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
    server = serve({"/v1/echo": {"GET": echo}})
    got = client.get(server.socket_path, "/v1/echo", {"name": "a b", "n": "1"})
    assert got == {"params": {"name": "a b", "n": "1"}, "when": "2024-01-02"}


def test_response_is_compact_sorted_json(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": lambda _: {"b": 1, "a": [1, 2]}}})
    status, headers, body = raw_request(server.socket_path, b"GET /v1/echo HTTP/1.0\r\n\r\n")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert body == b'{"a": [1, 2], "b": 1}'
    assert headers["Content-Length"] == str(len(body))


def test_a_large_answer_arrives_whole(serve: Callable[..., ApiServer]) -> None:
    # Far more than one read's worth: the client must keep its socket until the last byte.
    big = {"rows": [{"cgroup": f"system.slice/unit-{i}.service"} for i in range(50_000)]}
    server = serve({"/v1/big": {"GET": lambda _: big}})
    assert client.get(server.socket_path, "/v1/big") == big


def test_unknown_path_is_404(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    status, _, body = raw_request(server.socket_path, b"GET /v1/nope HTTP/1.0\r\n\r\n")
    assert status == 404
    assert json.loads(body) == {"error": "no such endpoint: /v1/nope"}
    with pytest.raises(NodeagentError, match=r"^no such endpoint: /v1/nope$"):
        client.get(server.socket_path, "/v1/nope")


def test_route_not_found_is_404_with_its_message(serve: Callable[..., ApiServer]) -> None:
    def missing(request: Request) -> object:
        raise NotFound(f"no workload named {request.query['name']!r}")

    server = serve({"/v1/workload": {"GET": missing}})
    with pytest.raises(NodeagentError, match=r"^no workload named 'web'$") as info:
        client.get(server.socket_path, "/v1/workload", {"name": "web"})
    assert not isinstance(info.value, DaemonUnreachable)


def test_route_crash_is_one_line_500(serve: Callable[..., ApiServer]) -> None:
    def broken(_: Request) -> object:
        raise RuntimeError("disk on fire\nsecond line")

    server = serve({"/v1/broken": {"GET": broken}})
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
    server = serve({"/v1/echo": {"GET": echo}})
    request = b"POST /v1/echo HTTP/1.0\r\nContent-Length: 0\r\n\r\n"
    status, headers, body = raw_request(server.socket_path, request)
    assert status == 405
    assert headers["Allow"] == "GET"
    assert json.loads(body) == {"error": "method POST not allowed; use GET"}


def test_malformed_request_gets_json_error(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    status, headers, body = raw_request(server.socket_path, b"GET /v1/e cho HTTP/1.0\r\n\r\n")
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": "Bad request syntax ('GET /v1/e cho HTTP/1.0')"}


def test_repeated_query_parameter_is_400(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
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
    server = serve({"/v1/echo": {"GET": echo}})
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
    server = serve({"/v1/echo": {"GET": echo}})
    st = os.stat(server.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getegid()


@needs_root
def test_missing_parent_is_created_0750_with_the_group(
    serve: Callable[..., ApiServer], sockdir: Path
) -> None:
    path = sockdir / "run" / "nodeagent" / "api.sock"
    serve({"/v1/echo": {"GET": echo}}, group="nogroup", path=path)
    parent = os.stat(path.parent)
    assert stat.S_IMODE(parent.st_mode) == 0o750
    assert parent.st_gid == NOGROUP
    sock = os.stat(path)
    assert stat.S_IMODE(sock.st_mode) == 0o660
    assert sock.st_gid == NOGROUP


def test_existing_parent_is_left_alone(serve: Callable[..., ApiServer], sockdir: Path) -> None:
    serve({"/v1/echo": {"GET": echo}})
    assert stat.S_IMODE(os.stat(sockdir).st_mode) == 0o755


@needs_root
def test_the_units_runtime_directory_gets_the_socket_group(
    serve: Callable[..., ApiServer], sockdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped unit's RuntimeDirectory= is root:root 0750 when the agent starts: without
    the socket's group on it, the group's members could not reach the socket (a real systemd
    in tests/kernel/test_service.py). Another existing directory keeps its group."""
    unit_dir, other = sockdir / "unit", sockdir / "other"
    for d in (unit_dir, other):
        d.mkdir(mode=0o750)
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"/run/elsewhere:{unit_dir}")
    serve({"/v1/echo": {"GET": echo}}, group="nogroup", path=unit_dir / "api.sock")
    assert os.stat(unit_dir).st_gid == NOGROUP
    assert stat.S_IMODE(os.stat(unit_dir).st_mode) == 0o750
    serve({"/v1/echo": {"GET": echo}}, group="nogroup", path=other / "api.sock")
    assert os.stat(other).st_gid == os.getegid()


def test_numeric_group_is_accepted(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}}, group=str(NOGROUP))
    assert os.stat(server.socket_path).st_gid == NOGROUP


def test_unknown_group_is_refused(sockdir: Path) -> None:
    path = sockdir / "api.sock"
    server = ApiServer(str(path), {"/v1/echo": {"GET": echo}}, group="no-such-group-xyz")
    with pytest.raises(NodeagentError, match="unknown group 'no-such-group-xyz'"):
        server.start()
    assert not path.exists()


def test_second_server_on_a_live_socket_is_refused(serve: Callable[..., ApiServer]) -> None:
    first = serve({"/v1/echo": {"GET": echo}})
    second = ApiServer(first.socket_path, {"/v1/echo": {"GET": lambda _: "impostor"}})
    with pytest.raises(NodeagentError) as info:
        second.start()
    assert str(info.value) == f"another nodeagent is already serving on {first.socket_path}"
    # The first one is untouched and still answers.
    assert client.get(first.socket_path, "/v1/echo")["params"] == {}  # type: ignore[index]


def test_stale_socket_is_replaced(serve: Callable[..., ApiServer], sockdir: Path) -> None:
    path = sockdir / "api.sock"
    make_stale_socket(path)
    serve({"/v1/echo": {"GET": echo}}, path=path)
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
    server = ApiServer(str(path), {"/v1/echo": {"GET": echo}})
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
    server = serve({"/v1/echo": {"GET": echo}})
    path = Path(server.socket_path)
    path.unlink()
    make_stale_socket(path)  # someone else's socket now lives at the path
    replacement = os.stat(path).st_ino
    server.close()
    assert os.stat(path).st_ino == replacement


def test_start_twice_is_an_error(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    with pytest.raises(NodeagentError, match="already started"):
        server.start()


def test_context_manager_starts_and_cleans_up(sockdir: Path) -> None:
    path = str(sockdir / "api.sock")
    with ApiServer(path, {"/v1/echo": {"GET": echo}}):
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


@needs_root
@pytest.mark.parametrize(
    ("family", "listen", "connect"),
    [
        (socket.AF_INET, "127.0.0.1", "127.0.0.1"),
        (socket.AF_INET6, "::1", "::1"),
        (socket.AF_INET6, "::", "127.0.0.1"),  # dual stack: the peer shows as ::ffff:127.0.0.1
    ],
)
def test_loopback_peers_names_the_uid_at_the_other_end(
    family: socket.AddressFamily, listen: str, connect: str
) -> None:
    peers = LoopbackPeers.open()
    assert peers is not None
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        listener.bind((listen, 0))
        listener.listen()
        port = listener.getsockname()[1]
        with held_as(NOBODY, NOGROUP, (connect, port), 1) as held:
            assert held == 1
            conn, _ = listener.accept()
            with conn:
                assert peers.uid(conn) == NOBODY
        mine = socket.create_connection((connect, port))
        conn, _ = listener.accept()
        with mine, conn:
            assert peers.uid(conn) == os.geteuid()
    peers.close()


@needs_root
def test_root_is_allowed_end_to_end(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    status, _, _ = raw_request(server.socket_path, b"GET /v1/echo HTTP/1.0\r\n\r\n")
    assert status == 200


@needs_root
def test_stranger_is_stopped_by_the_socket_mode(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    result = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert result == (
        f"NodeagentError: permission denied on {server.socket_path}: "
        "run as root or as a member of the socket's group"
    )


@needs_root
def test_stranger_gets_403_even_if_the_mode_was_loosened(
    serve: Callable[..., ApiServer],
) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    os.chmod(server.socket_path, 0o666)  # an operator's mistake; the peer check still holds
    result = as_user(NOBODY, NOGROUP, [], child_raw_get(server.socket_path))
    assert result == '403 {"error": "permission denied: uid 65534 is not root"}'
    # The client shows the daemon's reason for a 403 (routes give their own reasons).
    denied = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert denied == "ApiRefused: permission denied: uid 65534 is not root"


@needs_root
def test_stranger_outside_the_group_gets_403(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    os.chmod(server.socket_path, 0o666)
    result = as_user(NOBODY, OTHER_GID, [], child_raw_get(server.socket_path))
    assert result == (
        '403 {"error": "permission denied: uid 65534 is not root or in group nogroup"}'
    )


@needs_root
def test_group_member_by_primary_gid_is_allowed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    result = as_user(NOBODY, NOGROUP, [], child_client_get(server.socket_path))
    assert json.loads(result) == {"params": {"who": "child"}, "when": "2024-01-02"}


@needs_root
def test_group_member_by_supplementary_gid_is_allowed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    result = as_user(NOBODY, OTHER_GID, [NOGROUP], child_client_get(server.socket_path))
    assert json.loads(result) == {"params": {"who": "child"}, "when": "2024-01-02"}


# --- many groups (SO_PEERGROUPS beyond CPython's 1024-byte getsockopt buffer) -----------------


def connect_and_exit(path: str, groups: list[int]) -> None:
    """A child with `groups` connects to `path` and exits before anyone reads its credentials."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(groups)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(b"GET /v1/groups HTTP/1.0\r\n\r\n")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@needs_root
@pytest.mark.parametrize("count", [65, 300, 65536])
def test_read_peer_gets_every_group_of_a_peer_that_is_gone(sockdir: Path, count: int) -> None:
    # The peer has exited (its pid may be reused): only SO_PEERGROUPS can still tell.
    path = str(sockdir / "plain.sock")
    groups = list(range(100_000, 100_000 + count))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        connect_and_exit(path, groups)
        conn, _ = listener.accept()
        with conn:
            peer = read_peer(conn)
    assert peer.groups == frozenset(groups)


@needs_root
def test_member_by_its_300th_group_is_allowed(serve: Callable[..., ApiServer]) -> None:
    def groups(request: Request) -> object:
        return sorted(request.peer.groups)

    server = serve({"/v1/echo": {"GET": groups}}, group="nogroup")
    extra = list(range(100_000, 100_299))
    result = as_user(NOBODY, OTHER_GID, [*extra, NOGROUP], child_client_get(server.socket_path))
    assert json.loads(result) == sorted([*extra, NOGROUP])


# --- methods, query decoding -----------------------------------------------------------------


def test_head_is_405_like_post(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    status, headers, body = raw_request(server.socket_path, b"HEAD /v1/echo HTTP/1.0\r\n\r\n")
    assert status == 405
    assert headers["Allow"] == "GET"
    assert body == b""  # never a body in an answer to HEAD


@pytest.mark.parametrize("method", [b"PUT", b"PATCH", b"OPTIONS"])
def test_other_methods_are_405(serve: Callable[..., ApiServer], method: bytes) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    status, headers, _ = raw_request(server.socket_path, method + b" /v1/echo HTTP/1.0\r\n\r\n")
    assert (status, headers["Allow"]) == (405, "GET")


def test_raw_utf8_query_is_decoded_as_utf8(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    request = "GET /v1/echo?name=café&k=%C3%A9t%C3%A9+x HTTP/1.0\r\n\r\n".encode()
    status, _, body = raw_request(server.socket_path, request)
    assert status == 200
    assert json.loads(body)["params"] == {"name": "café", "k": "été x"}


def test_a_name_that_is_not_utf8_round_trips(serve: Callable[..., ApiServer]) -> None:
    # os.scandir gives b"job-\xff" as "job-\udcff"; the CLI must be able to ask for it.
    name = os.fsdecode(b"job-\xff\n")
    server = serve({"/v1/echo": {"GET": echo}})
    assert client.get(server.socket_path, "/v1/echo", {"cgroup": name})["params"] == {  # type: ignore[index]
        "cgroup": name
    }


# --- write endpoints -------------------------------------------------------------------------


def record(seen: list[Request]) -> Callable[[Request], object]:
    def route(request: Request) -> object:
        seen.append(request)
        return {"method": request.method, "body": dict(request.body)}

    return route


def post_raw(path: str, body: bytes, headers: bytes | None = None) -> tuple[int, dict[str, Any]]:
    if headers is None:
        headers = b"Content-Length: %d\r\n" % len(body)
    status, _, answer = raw_request(path, b"POST /v1/jobs HTTP/1.0\r\n" + headers + b"\r\n" + body)
    return status, json.loads(answer)


def test_post_and_delete_reach_their_routes_with_body_query_and_peer(
    serve: Callable[..., ApiServer],
) -> None:
    seen: list[Request] = []
    route = record(seen)
    server = serve({"/v1/jobs": {"GET": route, "POST": route, "DELETE": route}})
    job = {"name": "train", "work": 90.5, "argv": ["python", "train.py"], "limits": {"cpus": 2}}
    assert client.post(server.socket_path, "/v1/jobs", job, {"dry": "1"}) == {
        "method": "POST",
        "body": job,
    }
    assert client.delete(server.socket_path, "/v1/jobs", {"name": "train"}) == {
        "method": "DELETE",
        "body": {"name": "train"},
    }
    assert client.delete(server.socket_path, "/v1/jobs") == {"method": "DELETE", "body": {}}
    assert client.get(server.socket_path, "/v1/jobs") == {"method": "GET", "body": {}}
    assert seen[0].query == {"dry": "1"}
    assert [r.path for r in seen] == ["/v1/jobs"] * 4
    me = Peer(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid(), groups=frozenset(os.getgroups()))
    assert {r.peer for r in seen} == {me}


def test_a_route_declares_its_methods(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/jobs": {"POST": record([])}, "/v1/both": {"GET": echo, "POST": echo}})
    status, headers, body = raw_request(server.socket_path, b"GET /v1/jobs HTTP/1.0\r\n\r\n")
    assert (status, headers["Allow"]) == (405, "POST")
    assert json.loads(body) == {"error": "method GET not allowed; use POST"}
    request = b"DELETE /v1/both HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"
    status, headers, body = raw_request(server.socket_path, request)
    assert (status, headers["Allow"]) == (405, "GET, POST")
    assert json.loads(body) == {"error": "method DELETE not allowed; use GET or POST"}
    with pytest.raises(client.ApiRefused, match=r"^nodeagent API error 405 on /v1/jobs: ") as info:
        client.get(server.socket_path, "/v1/jobs")
    assert info.value.status == 405


@pytest.mark.parametrize("methods", [{"PUT": echo}, {"HEAD": echo}, {"get": echo}, {}])
def test_routes_with_other_methods_are_refused(methods: Mapping[str, Handler]) -> None:
    with pytest.raises(ValueError, match="methods must be among"):
        ApiServer("/nonexistent/api.sock", {"/v1/x": methods})


def test_body_at_the_limit_is_accepted(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/jobs": {"POST": record([])}})
    padding = MAX_BODY - len(b'{"x": ""}')
    body = b'{"x": "' + b"a" * padding + b'"}'
    assert len(body) == MAX_BODY
    status, answer = post_raw(server.socket_path, body)
    assert status == 200
    assert len(answer["body"]["x"]) == padding


@pytest.mark.parametrize(
    ("headers", "body", "status", "error"),
    [
        (b"", b"{}", 411, "a POST needs a Content-Length header"),
        (b"Transfer-Encoding: chunked\r\n", b"2\r\n{}\r\n0\r\n\r\n", 411, "a POST needs a "),
        (b"Content-Length: %d\r\n" % (MAX_BODY + 1), b"", 413, "over the 65536-byte limit"),
        (b"Content-Length: 99999999999999999999\r\n", b"", 413, "over the 65536-byte limit"),
        (b"Content-Length: -1\r\n", b"", 400, "bad Content-Length: -1"),
        (b"Content-Length: 2\r\nContent-Length: 3\r\n", b"{}", 400, "bad Content-Length: 2, 3"),
        (b"Content-Length: 5\r\n", b"{}", 400, "the body ended after 2 of 5 bytes"),
    ],
)
def test_body_framing_errors(
    serve: Callable[..., ApiServer], headers: bytes, body: bytes, status: int, error: str
) -> None:
    seen: list[Request] = []
    server = serve({"/v1/jobs": {"POST": record(seen)}})
    got, answer = post_raw(server.socket_path, body, headers)
    assert got == status
    assert error in answer["error"]
    assert seen == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", "bad JSON body: Expecting value: line 1 column 1 (char 0)"),
        (b"{", "bad JSON body: "),
        (b"[1, 2]", "the body must be a JSON object, not list"),
        (b'"job"', "the body must be a JSON object, not str"),
        (b"null", "the body must be a JSON object, not NoneType"),
        (b'{"a": NaN}', "bad JSON body: NaN is not allowed"),
        (b'{"a": 1, "a": 2}', "bad JSON body: key 'a' given more than once"),
        (b'{"a": "\xff"}', "bad JSON body: not UTF-8 (byte 7)"),
        (b'{"a": ' + b"[" * 20000 + b"]" * 20000 + b"}", "bad JSON body: nested too deeply"),
        (b'{"a": ' + b"9" * 5000 + b"}", "bad JSON body: Exceeds the limit (4300 digits)"),
    ],
)
def test_bad_bodies_are_400(serve: Callable[..., ApiServer], body: bytes, error: str) -> None:
    seen: list[Request] = []
    server = serve({"/v1/jobs": {"POST": record(seen)}})
    status, answer = post_raw(server.socket_path, body)
    assert status == 400
    assert answer["error"].startswith(error)
    assert seen == []


@pytest.mark.parametrize(
    ("error", "status"),
    [(BadRequest, 400), (Forbidden, 403), (NotFound, 404), (Conflict, 409)],
)
def test_typed_route_errors(
    serve: Callable[..., ApiServer], error: type[Refused], status: int
) -> None:
    def refuse(request: Request) -> object:
        raise error(f"job {request.body['name']!r} says no")

    server = serve({"/v1/jobs": {"POST": refuse, "DELETE": refuse}})
    got, answer = post_raw(server.socket_path, b'{"name": "train"}')
    assert (got, answer) == (status, {"error": "job 'train' says no"})
    for call in (client.post, client.delete):
        with pytest.raises(client.ApiRefused) as info:
            call(server.socket_path, "/v1/jobs", {"name": "train"})
        assert (str(info.value), info.value.status) == ("job 'train' says no", status)


def test_a_crashing_write_route_is_a_one_line_500(serve: Callable[..., ApiServer]) -> None:
    def broken(_: Request) -> object:
        raise KeyError("pid")

    server = serve({"/v1/jobs": {"POST": broken}})
    with pytest.raises(client.ApiRefused) as info:
        client.post(server.socket_path, "/v1/jobs", {})
    assert str(info.value) == "nodeagent API error 500 on /v1/jobs: internal error: KeyError: 'pid'"


def test_client_refuses_to_send_an_oversized_body(serve: Callable[..., ApiServer]) -> None:
    seen: list[Request] = []
    server = serve({"/v1/jobs": {"POST": record(seen)}})
    with pytest.raises(NodeagentError, match=r"^POST /v1/jobs: the request is \d+ bytes, over"):
        client.post(server.socket_path, "/v1/jobs", {"x": "a" * MAX_BODY})
    assert seen == []


@needs_root
def test_stranger_cannot_post_even_if_the_mode_was_loosened(
    serve: Callable[..., ApiServer],
) -> None:
    seen: list[Request] = []
    server = serve({"/v1/jobs": {"POST": record(seen)}})
    os.chmod(server.socket_path, 0o666)

    def action() -> str:
        return str(client.post(server.socket_path, "/v1/jobs", {"name": "x"}))

    result = as_user(NOBODY, NOGROUP, [], action)
    assert result == "ApiRefused: permission denied: uid 65534 is not root"
    assert seen == []


# --- bursts, caps and deadlines --------------------------------------------------------------


def in_threads(n: int, call: Callable[[], object]) -> list[object]:
    """Run `call` in n threads released at once; each result or the exception it raised."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_a_burst_of_64_calls_all_succeed(serve: Callable[..., ApiServer]) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    results = in_threads(64, lambda: client.get(server.socket_path, "/v1/echo", timeout=30))
    assert [r for r in results if not isinstance(r, dict)] == []


def test_the_listen_queue_holds_a_burst(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One connection served, the route stuck: 100 more must queue (in the daemon's waiting
    # room or the kernel's listen queue), not bounce.
    entered, release = threading.Event(), threading.Event()

    def stuck(_: Request) -> object:
        entered.set()
        release.wait(30)
        return "done"

    monkeypatch.setattr(ApiServer, "max_connections", 1)
    server = serve({"/v1/echo": {"GET": stuck}})
    first = threading.Thread(target=client.get, args=(server.socket_path, "/v1/echo"))
    first.start()
    assert entered.wait(10)
    queued = []
    try:
        for _ in range(100):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            queued.append(sock)
            sock.setblocking(False)  # fails with EAGAIN at once when the queue is full
            sock.connect(server.socket_path)
    finally:
        release.set()
        first.join()
        for sock in queued:
            sock.close()


def test_connections_beyond_the_cap_wait_their_turn(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    inside, most = [0], [0]
    lock, release = threading.Lock(), threading.Event()

    def stuck(_: Request) -> object:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        release.wait(30)
        with lock:
            inside[0] -= 1
        return "done"

    monkeypatch.setattr(ApiServer, "max_connections", 4)
    server = serve({"/v1/echo": {"GET": stuck}})
    done: list[object] = []
    worker = threading.Thread(
        target=lambda: done.extend(
            in_threads(10, lambda: client.get(server.socket_path, "/v1/echo", timeout=30))
        )
    )
    worker.start()
    wait_for(lambda: inside[0] == 4, 10, "4 calls inside the route")
    # all 10 taken in: the 6 beyond the cap wait (were it not held, they would be served)
    wait_for(lambda: len(server._queue) == 6, 10, "the other 6 calls waiting for a slot")
    assert most[0] == 4
    release.set()
    worker.join()
    assert done == ["done"] * 10


def test_emfile_on_accept_backs_off_and_recovers(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = serve({"/v1/echo": {"GET": echo}})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # made while descriptors last
    tries = accept_tries_while_out_of_fds(monkeypatch, sock, server.socket_path)
    # Backing off from 50 ms, doubling, makes 5 tries in 1.5 s; retrying at once made 156,298.
    assert 1 <= tries <= 20
    with sock:
        sock.settimeout(10)
        sock.sendall(b"GET /v1/echo HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.0 200 ")


def test_client_deadline_covers_the_whole_call(sockdir: Path) -> None:
    # A daemon that drips its answer a byte at a time must not hold the CLI past its timeout.
    path = str(sockdir / "api.sock")
    stop = threading.Event()

    def drip(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):  # until the client hangs up
            conn.sendall(b"HTTP/1.0 200 OK\r\n")
            while not stop.wait(0.05):
                conn.sendall(b"X")

    outcome: list[BaseException] = []

    def call() -> None:
        with pytest.raises(NodeagentError) as info:
            client.get(path, "/", timeout=0.5)
        outcome.append(info.value)

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen()
        dripper = threading.Thread(target=drip, args=(listener,))
        dripper.start()
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(timeout=10)
        stop.set()
        dripper.join()
    assert not caller.is_alive()
    assert str(outcome[0]).endswith("did not answer within 0.5s")


def test_client_waits_for_room_in_a_full_listen_queue(
    sockdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(sockdir / "api.sock")
    got: list[object] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(0)
        listener.settimeout(10)  # a caller that never comes through fails the accept below
        fillers = []
        with contextlib.suppress(BlockingIOError):
            while True:  # fill the queue, however long the kernel makes it
                fillers.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                fillers[-1].setblocking(False)
                fillers[-1].connect(path)
        connecting: list[int] = []  # the descriptor the caller connects
        real_connect = socket.socket.connect

        def connect(sock: socket.socket, address: Any) -> None:
            connecting.append(sock.fileno())
            real_connect(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)
        caller = threading.Thread(target=lambda: got.append(client.get(path, "/", timeout=30)))
        caller.start()

        def waits_in_connect() -> bool:
            assert caller.is_alive(), "the caller gave up instead of waiting for room"
            return bool(connecting) and asleep_on(f"self/task/{caller.native_id}", connecting[0])

        wait_for(waits_in_connect, 10, "the caller to wait in connect() on the full queue")
        while True:  # make room, and answer the caller when it comes through
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(0.5)
                with contextlib.suppress(TimeoutError):
                    if conn.recv(4096).startswith(b"GET / "):
                        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 4\r\n\r\ntrue")
                        break
        caller.join(timeout=10)
        for sock in fillers:
            sock.close()
    assert got == [True]


def test_server_deadline_covers_the_whole_request(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ApiServer, "timeout", 0.5)
    seen: list[Request] = []
    server = serve({"/v1/echo": {"GET": record(seen)}})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.socket_path)
        sock.sendall(b"GET /v1/echo HTTP/1.0\r\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(200):  # a header byte every 50 ms, for up to 10 s
                sock.sendall(b"X")
                time.sleep(0.05)  # no wait on anything: the slow client is what is tested
        sock.settimeout(10)
        try:
            answer = sock.recv(100)
        except ConnectionResetError:  # af_unix resets a peer whose sent bytes went unread
            answer = b""
        assert answer == b""  # the server hung up without answering
    assert seen == []


def test_close_ends_connections_accepted_before_it(serve: Callable[..., ApiServer]) -> None:
    seen: list[Request] = []
    server = serve({"/v1/echo": {"GET": record(seen)}})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(server.socket_path)
        sock.sendall(b"GET /v1/echo HTTP/1.0\r\n")
        wait_for(lambda: len(server._connections) == 1, 10, "the connection to be accepted")
        server.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"\r\n")
        sock.settimeout(10)
        try:
            answer = sock.recv(100)
        except ConnectionResetError:
            answer = b""
    assert answer == b""
    assert seen == []


# --- floods: who holds the connections (peer credentials at accept) ---------------------------


@pytest.fixture
def admitted(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many connections the server has taken in so far (served, made to wait or
    refused): what a flood test waits for before it looks at what the flood left."""
    return counted(monkeypatch, ApiServer, "admit")  # called by the accept loop alone


def timed_get(path: str) -> float:
    """Seconds a root call with the CLI's own deadline (5 s) took; raises if it failed."""
    t0 = time.monotonic()
    assert client.get(path, "/v1/echo", timeout=5.0)["params"] == {}  # type: ignore[index]
    return time.monotonic() - t0


@needs_root
def test_a_group_members_idle_connections_leave_root_answered(
    serve: Callable[..., ApiServer], admitted: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 12.18: 32 idle connections from one member took every slot for 10 s each.
    keep_their_slots(monkeypatch)
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    with held_as(NOBODY, NOGROUP, server.socket_path, 4 * 32) as held:
        assert held == 4 * 32
        wait_for(lambda: admitted() == held, 30, f"the daemon to take in all {held}")
        took = [timed_get(server.socket_path) for _ in range(5)]
    assert max(took) < 5.0


@needs_root
def test_one_members_flood_leaves_another_member_answered(
    serve: Callable[..., ApiServer], admitted: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_their_slots(monkeypatch)
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    with held_as(NOBODY, NOGROUP, server.socket_path, 4 * 32) as held:
        assert held == 4 * 32
        wait_for(lambda: admitted() == held, 30, f"the daemon to take in all {held}")
        other = as_user(4000, NOGROUP, [], child_client_get(server.socket_path))
    assert json.loads(other) == {"params": {"who": "child"}, "when": "2024-01-02"}


@needs_root
def test_a_uid_over_its_caps_is_told_at_once_before_it_sends_a_byte(
    serve: Callable[..., ApiServer], admitted: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_their_slots(monkeypatch)
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    caps = server.per_uid_connections + server.per_uid_waiting

    def one_too_many() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.socket_path)
            sock.settimeout(3)
            try:
                return sock.recv(4096).decode()
            except TimeoutError:
                return "no answer within 3 s"

    with held_as(NOBODY, NOGROUP, server.socket_path, caps) as held:
        assert held == caps
        wait_for(lambda: admitted() == caps, 30, f"the daemon to serve or queue all {caps}")
        answer = as_user(NOBODY, NOGROUP, [], one_too_many)
    head, _, body = answer.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.0 429 "), answer
    assert json.loads(body) == {
        "error": "too many connections from uid 65534: at most 8 served and 16 waiting at once"
    }


@needs_root
def test_a_refused_client_that_sends_its_request_late_still_reads_its_answer(
    serve: Callable[..., ApiServer], admitted: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # CI (stop 23): curl, refused before it had sent its request, got "Send failure: Broken
    # pipe" and no status: the daemon answered and closed at once.
    keep_their_slots(monkeypatch)
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    caps = server.per_uid_connections + server.per_uid_waiting

    def late_sender() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.socket_path)
            # the answer is there to read: refused, and its request not yet sent
            if not select.select([sock], [], [], 10)[0]:
                return "not refused within 10 s"
            sock.settimeout(3)
            try:
                sock.sendall(b"GET /v1/echo HTTP/1.0\r\n\r\n")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            except OSError as exc:
                return f"{type(exc).__name__}: {exc}"
            return answer.decode()

    with held_as(NOBODY, NOGROUP, server.socket_path, caps) as held:
        assert held == caps
        wait_for(lambda: admitted() == caps, 30, f"the daemon to serve or queue all {caps}")
        answer = as_user(NOBODY, NOGROUP, [], late_sender)
    assert answer.startswith("HTTP/1.0 429 "), answer


def keep_their_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle connections keep their slot, served or waiting, for the test's length (not the
    3 s a served one has for its headers, nor the 10 s a waiting one has for a slot), so
    that the next one is over the caps however slowly the test runs."""
    monkeypatch.setattr(ApiServer, "header_timeout", 60.0)
    monkeypatch.setattr(ApiServer, "timeout", 60.0)


@needs_root
def test_refused_connections_are_kept_only_until_their_clients_hang_up(
    serve: Callable[..., ApiServer], admitted: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Kept open for a late sender, but bounded: a uid that never hangs up holds a few.
    # Kept for a minute rather than 2 s, so that only the hang-up can end them here.
    monkeypatch.setattr(httpcore, "LINGER", 60.0)
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")
    caps = server.per_uid_connections + server.per_uid_waiting
    with held_as(NOBODY, NOGROUP, server.socket_path, caps + 50) as held:
        assert held == caps + 50
        wait_for(lambda: admitted() == held, 30, f"the daemon to take in all {held}")
        assert len(server._lingering) == 8  # of the 50 refused: not more
    wait_for(lambda: not server._lingering, 10, "the refused ones to close as their client left")


@needs_root
def test_a_members_burst_of_calls_all_succeed(serve: Callable[..., ApiServer]) -> None:
    # More calls at once than one uid is served: the rest wait their turn, none is refused.
    server = serve({"/v1/echo": {"GET": echo}}, group="nogroup")

    def burst() -> str:
        calls = in_threads(20, lambda: client.get(server.socket_path, "/v1/echo", timeout=30))
        return json.dumps([type(r).__name__ for r in calls if not isinstance(r, dict)])

    assert as_user(NOBODY, NOGROUP, [], burst) == "[]"


def test_the_request_line_and_headers_have_a_deadline_of_their_own(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A few seconds for the head, however long the whole exchange may take.
    monkeypatch.setattr(ApiServer, "header_timeout", 0.3, raising=False)
    monkeypatch.setattr(ApiServer, "timeout", 30.0)
    seen: list[Request] = []
    server = serve({"/v1/echo": {"GET": record(seen)}})
    for sent in (b"", b"GET /v1/echo HTTP/1.0\r\nX-Slow: "):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(server.socket_path)
            t0 = time.monotonic()
            sock.sendall(sent)
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(4096):
                    pass  # an answer may come (408), then the end
            assert time.monotonic() - t0 < 3.0, sent
    assert seen == []


@needs_root
def test_a_waiting_connection_that_gets_no_slot_in_time_is_told_so(
    serve: Callable[..., ApiServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered_r, entered_w = os.pipe()  # the route (here) tells the caller (a child) it is in

    def stuck(_: Request) -> object:
        os.write(entered_w, b"x")
        release.wait(30)
        return "done"

    monkeypatch.setattr(ApiServer, "per_uid_connections", 1, raising=False)
    monkeypatch.setattr(ApiServer, "timeout", 1.0)
    server = serve({"/v1/echo": {"GET": stuck}}, group="nogroup")

    def second_of_two() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.connect(server.socket_path)
            first.sendall(b"GET /v1/echo HTTP/1.0\r\n\r\n")
            if not select.select([entered_r], [], [], 10)[0]:
                return "the first call did not reach its route within 10 s"
            try:
                return client.get(server.socket_path, "/v1/echo", timeout=10)  # type: ignore[return-value]
            except NodeagentError as exc:
                return str(exc)

    try:
        answer = as_user(NOBODY, NOGROUP, [], second_of_two)
    finally:
        release.set()
        os.close(entered_r)
        os.close(entered_w)
    assert answer == (
        "nodeagent API error 503 on /v1/echo: the daemon is busy: no connection slot"
        " for uid 65534 within 1s"
    )
