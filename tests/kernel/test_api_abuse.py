"""API abuse against a real daemon: strangers are refused, hostile clients harm nobody.

The daemon (`nodeagent run`, a 0.2 s tick) serves its API on a socket whose group is a gid
no user has. Callers are the real unprivileged uid 65534 (nobody), through setpriv and
curl (the venv's Python lives under /root, which nobody may enter), with or without that
group. Hostile clients, one that connects and sends nothing, one that drips its request,
oversized and malformed requests, are held open while the loop's ticks are counted and
others call the API: the loop goes on, and the API answers others within the CLI's own
deadline, however many hostile connections are open.

Waits are keyed to progress (ticks counted in the daemon's log, connections cut) with
ceilings generous enough for a busy host under TCG. Root's calls have the CLI's own deadline,
since that is what is shown; a member's call said to be answered at once has a few seconds,
measured against another member's call made uncontended on this VM just before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import Daemon, rel, wait_for

from nodeagent.api import client
from nodeagent.api.server import ApiServer
from nodeagent.errors import NodeagentError

GROUP = 4242  # the socket's group: a gid that no user on the node has
NOBODY = 65534
PATIENCE = 300  # seconds: the ceiling of every wait for progress
POLICY = """\
version: 1
agent:
  interval: 200ms
  managed_root: {managed}
  state_file: {tmp}/state.json
  socket: {socket}
  socket_group: "{group}"
tenants:
  a: {{shares: 1}}
rules:
  - {{name: jobs, match: {{path: "{managed}/*"}}, tenant: a, limits: {{cpu_max: 1}}}}
"""
# The rule claims the sandbox's cgroups only: with `match: {}` this module's daemon claimed,
# and tried to cap, the containers that the other pytest-xdist worker's dockerd runs at the
# same time (a full run: `docker/<id>: no cpu.max: its controller is not enabled`).


@dataclass
class Served:
    daemon: Daemon
    socket: Path
    job: str

    def ticks(self) -> int:
        """Ticks the daemon has logged (it runs with --log-level debug)."""
        return self.daemon.log.read_text(errors="replace").count('"event": "tick"')

    def ticked(self, more: int) -> bool:
        """Whether `more` ticks come, within PATIENCE."""
        before = self.ticks()
        return wait_for(lambda: self.ticks() >= before + more, timeout=PATIENCE, step=0.2)

    def events(self) -> list[dict[str, object]]:
        lines = self.daemon.log.read_text(errors="replace").splitlines()
        return [json.loads(line) if line.startswith("{") else {"raw": line} for line in lines]


@pytest.fixture
def served(cgroup_sandbox: Path, tmp_path: Path) -> Iterator[Served]:
    run = Path(tempfile.mkdtemp(prefix="nodeagent-abuse-", dir="/run"))
    run.chmod(0o755)  # nobody may reach the daemon's own directory below it, which it makes
    sock = run / "api" / "nodeagent.sock"
    managed = cgroup_sandbox / "managed"
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(managed=rel(managed), tmp=tmp_path, socket=sock, group=GROUP))
    daemon = Daemon(policy, tmp_path / "daemon.log", "--log-level", "debug")
    served = Served(daemon, sock, rel(managed / "job-1"))
    try:
        assert wait_for(lambda: _answers(sock), timeout=PATIENCE), daemon.log.read_text()
        (managed / "job-1").mkdir()
        assert wait_for(lambda: _lists(served), timeout=PATIENCE), daemon.log.read_text()
        yield served
    finally:
        daemon.stop()
        shutil.rmtree(run, ignore_errors=True)
    # nothing failed in the daemon (api.handler_failed, tick.failed, ...), no traceback
    failed = [e for e in served.events() if "raw" in e or str(e.get("event")).endswith("failed")]
    assert not failed, failed[:5]


def _answers(sock: Path) -> bool:
    with contextlib.suppress(Exception):
        client.get(str(sock), "/v1/status")
        return True
    return False


def _lists(served: Served) -> bool:
    try:
        rows = client.get(str(served.socket), "/v1/allocations")
    except NodeagentError:
        return False  # a slow answer on a busy host: ask again
    assert isinstance(rows, dict)
    return any(r["cgroup"] == served.job for r in rows["allocations"])


def as_nobody(
    sock: Path, groups: list[int], path: str = "/v1/allocations", deadline: float = 30
) -> tuple[int, str]:
    """GET `path` as uid 65534 with `groups`, given `deadline` seconds in all: (the HTTP
    status, or 0 when no HTTP answer came; what curl printed)."""
    argv = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY)]
    argv += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    argv += ["curl", "-sS", "--max-time", f"{deadline:g}", "--unix-socket", str(sock)]
    argv += ["-w", "\n%{http_code}", f"http://localhost{path}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    body, _, code = done.stdout.rpartition("\n")
    return int(code or 0), body + done.stderr


def test_a_stranger_is_refused_and_a_member_of_the_socket_group_served(served: Served) -> None:
    status, out = as_nobody(served.socket, [])
    assert status == 0, out  # the kernel refused: the directory is 0750 and the socket 0660
    status, out = as_nobody(served.socket, [GROUP])
    assert status == 200, out
    assert served.job in {r["cgroup"] for r in json.loads(out)["allocations"]}

    # the socket's mode loosened by hand: the daemon's own check still refuses the stranger
    served.socket.parent.chmod(0o755)
    served.socket.chmod(0o666)
    status, out = as_nobody(served.socket, [])
    assert (status, json.loads(out)) == (
        403,
        {"error": f"permission denied: uid {NOBODY} is not root or in group {GROUP}"},
    )
    denied = [e for e in served.events() if e.get("event") == "api.denied"]
    assert [(e["uid"], e["path"]) for e in denied] == [(NOBODY, "/v1/allocations")]


# Requests that are too large, each with the answer it must get (a JSON error; never a 500).
OVERSIZED: dict[str, tuple[bytes, int | None]] = {
    "a 1 MiB request line": (b"GET /" + b"a" * (1 << 20) + b" HTTP/1.0\r\n\r\n", 414),
    "a 1 MiB header line": (
        b"GET /v1/allocations HTTP/1.0\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
        431,
    ),
    "1000 headers": (b"GET /v1/allocations HTTP/1.0\r\n" + b"X-A: b\r\n" * 1000 + b"\r\n", 431),
    "a 1 GB body announced": (
        b"POST /v1/jobs HTTP/1.0\r\nContent-Length: 1000000000\r\n\r\n" + b"{" * 4096,
        413,
    ),
}
# A request line that is not HTTP/1.x gets its error as http.server answers HTTP/0.9: the
# JSON body alone, without a status line (status None here).
MALFORMED: dict[str, tuple[bytes, int | None]] = {
    "binary": (b"\x00\xff\xfe\x80\r\n\r\n", None),
    "a method alone": (b"GET\r\n\r\n", None),
    "HTTP/9.9": (b"GET /v1/allocations HTTP/9.9\r\n\r\n", None),
    "an unknown method": (b"BREW /v1/allocations HTTP/1.0\r\n\r\n", 501),
    "a bad percent escape": (b"GET /v1/explain?cgroup=%ff%zz&& HTTP/1.0\r\n\r\n", 404),
    "a body that is not JSON": (
        b"POST /v1/jobs HTTP/1.0\r\nContent-Length: 9\r\n\r\nnot json!",
        400,
    ),
    "a negative length": (b"POST /v1/jobs HTTP/1.0\r\nContent-Length: -1\r\n\r\n", 400),
    "chunked": (b"POST /v1/jobs HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
}


def exchange(sock: Path, request: bytes) -> tuple[int | None, dict[str, object]]:
    """Connect as root, send `request` and read the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock))
        return answer(s, request)


def answer(
    s: socket.socket, request: bytes, timeout: float = 60
) -> tuple[int | None, dict[str, object]]:
    """Send `request` whole on `s` (as far as the server reads it) and read the answer, all
    of it within `timeout` seconds."""
    s.settimeout(timeout)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(request)  # the server may answer and close before reading it all
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/"):
        return None, json.loads(data)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


class Hostile:
    """Connections that hold the API's threads: idle ones, and one that drips a request a
    byte at a time. `cut` says which of them the daemon has closed."""

    def __init__(self, sock: Path, idle: int) -> None:
        self.idle = [self._connect(sock) for _ in range(idle)]
        self.drip = self._connect(sock)
        self.drip_cut = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dripping, daemon=True)
        self._thread.start()

    @staticmethod
    def _connect(sock: Path) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(sock))
        return s

    def _dripping(self) -> None:
        request = b"GET /v1/allocations HTTP/1.0\r\n" + b"X-Slow: " + b"z" * 1000
        for byte in request:
            if self._stop.wait(0.2):
                return
            try:
                self.drip.send(bytes([byte]))
            except OSError:
                self.drip_cut.set()
                return

    def idle_cut(self) -> int:
        """How many idle connections the daemon has closed (it sent nothing, then EOF)."""
        cut = 0
        for s in self.idle:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                cut += s.recv(1) == b""
        return cut

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in [*self.idle, self.drip]:
            s.close()


def test_hostile_clients_block_neither_the_loop_nor_the_api(served: Served) -> None:
    """With a silent connection and a dripping one open, oversized and malformed requests
    each get their JSON error, ticks keep coming, and root and a group member are answered
    within the CLI's deadline; the daemon's whole-request deadline then ends both."""
    hostile = Hostile(served.socket, idle=1)
    try:
        rows = client.get(str(served.socket), "/v1/allocations")  # the CLI's 5 s deadline
        assert isinstance(rows, dict) and rows["allocations"]
        status, out = as_nobody(served.socket, [GROUP], deadline=5)
        assert status == 200, out
        assert served.ticked(5), "the loop stalled"

        requests = {**OVERSIZED, **MALFORMED}
        answers = {
            what: exchange(served.socket, request) for what, (request, _) in requests.items()
        }
        assert {w: status for w, (status, _) in answers.items()} == {
            w: status for w, (_, status) in requests.items()
        }, answers
        assert all(isinstance(body.get("error"), str) for _, body in answers.values())

        assert wait_for(lambda: hostile.idle_cut() == 1, timeout=PATIENCE)
        assert wait_for(hostile.drip_cut.is_set, timeout=PATIENCE)
    finally:
        hostile.close()
    assert served.daemon.proc.poll() is None, "the daemon exited"


def test_a_member_holding_all_its_slots_is_refused_at_once_and_costs_no_one_else(
    served: Served,
) -> None:
    """A socket-group member holds all its slots, 8 served and 16 waiting (docs/commands.md,
    "The API under load"): its next connection is told 429 at once, while another member
    and root are served, and the loop goes on: the member's connections cost it alone.

    "At once" is measured against another member's call made uncontended just before, on
    this VM now: a connection that waited for a slot would wait for one of the held ones to
    end, 10 s (the daemon's whole-request deadline) after they were served, or be told 503
    then. The calls are made from forked children (no exec: a curl under TCG on a busy host
    can take seconds to start), each timed from its connect() to its whole answer."""
    per_uid, waiting = ApiServer.per_uid_connections, ApiServer.per_uid_waiting
    status_request = b"GET /v1/status HTTP/1.0\r\n\r\n"

    def member_call(uid: int) -> tuple[int | None, dict[str, object], float]:
        ((s,), connected) = connections_of(uid, served.socket, 1)
        with s:
            status, body = answer(s, status_request)
        return status, body, time.monotonic() - connected

    reference = max(member_call(NOBODY - 1)[2] for _ in "ab")
    ceiling = 2 * reference + 1.0
    # below the time a waiting connection would take, or "at once" could not be told apart
    assert ceiling < ApiServer.timeout, f"uncontended calls took {reference:.1f} s"

    # a POST's head without its body, sent by the child as it connects: each of these holds
    # its slot (the whole-request deadline) or its place; the last one sends nothing
    held, connected = connections_of(NOBODY, served.socket, per_uid + waiting + 1, HEAD)
    *held, mine = held
    try:
        try:
            status, body = answer(mine, b"", timeout=ceiling)
        except TimeoutError:
            raise AssertionError(f"no answer in {ceiling:.1f} s: it waits for a slot") from None
        took = time.monotonic() - connected
        why = f"too many connections from uid {NOBODY}: at most {per_uid} served and {waiting}"
        assert (status, body) == (429, {"error": f"{why} waiting at once"})
        assert took < ceiling, f"the refusal took {took:.1f} s, uncontended calls {reference:.1f}"
        status, body, took = member_call(NOBODY - 1)
        assert (status, took < ceiling) == (200, True), (body, took, reference)
        rows = client.get(str(served.socket), "/v1/allocations")  # the CLI's 5 s deadline
        assert isinstance(rows, dict) and rows["allocations"]
        answered = [s for s in held if not silent(s)]
        assert not answered, (
            f"{len(answered)} of the held connections were answered within"
            f" {time.monotonic() - connected:.1f} s: the calls above did not all find them held"
        )
    finally:
        for s in [*held, mine]:
            s.close()
    assert served.ticked(2), "the loop stalled"


HEAD = b"POST /v1/jobs HTTP/1.0\r\nContent-Length: 2\r\n\r\n"
"""A request's head whose body never comes: served, it holds its slot 10 s."""


def connections_of(
    uid: int, sock: Path, count: int, head: bytes = b""
) -> tuple[list[socket.socket], float]:
    """`count` connections to `sock` made by `uid` (in GROUP), all but the last sending
    `head` at once, handed to this process over SCM_RIGHTS (the daemon read the peer's
    credentials when it accepted them: they stay `uid`'s); and when the last was made
    (time.monotonic(), which every process shares). Made one after another, they are
    accepted in that order."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            ours.close()
            os.setgroups([GROUP])
            os.setgid(uid)
            os.setuid(uid)
            made = []
            for n in range(count):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(sock))
                if head and n < count - 1:
                    s.sendall(head)
                made.append(s)
            at = repr(time.monotonic()).encode()
            socket.send_fds(theirs, [at], [s.fileno() for s in made])
        except BaseException as exc:
            theirs.sendall(f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(0)
    theirs.close()
    with ours:
        message, fds, _, _ = socket.recv_fds(ours, 4096, count)
    os.waitpid(pid, 0)
    assert len(fds) == count, f"uid {uid} could not connect {count} times: {message.decode()}"
    return [socket.socket(fileno=fd) for fd in fds], float(message)


def silent(s: socket.socket) -> bool:
    """Whether nothing came on `s` yet, not even its end."""
    try:
        s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False
