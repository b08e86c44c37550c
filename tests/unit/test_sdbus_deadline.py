"""A D-Bus call to systemd, on the loop's thread, has one deadline on the whole of it
(issue 34: every call on the loop's thread): a peer that trickles its authentication
answer a byte at a time, or sends other messages without end, costs the deadline only.

The peer is a STAND-IN for systemd's private socket (a hostile or wedged one; the real
systemd is in tests/kernel/test_systemd_dbus.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from jeepney import HeaderFields, MessageType
from jeepney.low_level import Endianness, Header, Message

from nodeagent.errors import NodeagentError
from nodeagent.sdbus import Systemd

TIMEOUT = 0.5
CEILING = 10.0
"""How long the test waits for the call to give up (twenty deadlines: a loaded host)."""
SCOPE = "docker-" + "ab" * 32 + ".scope"


def _other_reply() -> bytes:
    """A method return to a call nobody made: dropped by the caller, which waits on."""
    fields = {HeaderFields.reply_serial: 999_999, HeaderFields.signature: "s"}
    header = Header(Endianness.little, MessageType.method_return, 0, 1, 0, 7, fields)
    data: bytes = Message(header, ("x",)).serialise()
    return data


def _trickle_ok(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(4096)  # the null byte and AUTH EXTERNAL
    for b in b"OK 0123456789abcdef0123456789abcdef\r\n":
        conn.sendall(bytes([b]))
        if stop.wait(TIMEOUT / 2):  # each byte well within a per-read timeout
            return


def _flood(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(4096)
    conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
    conn.recv(4096)  # BEGIN, then the call
    other = _other_reply() * 64
    while not stop.is_set():
        conn.sendall(other)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Callable[[Callable[..., None]], str]]:
    """Start a stand-in peer on a socket that runs `behaviour` on each connection."""
    stop = threading.Event()
    servers: list[socket.socket] = []

    def start(behaviour: Callable[[socket.socket, threading.Event], None]) -> str:
        path = str(tmp_path / "private")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen()
        servers.append(server)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn = server.accept()[0]
                except OSError:
                    return
                try:
                    behaviour(conn, stop)
                except OSError:
                    pass  # the caller gave up and closed it
                finally:
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return path

    yield start
    stop.set()
    for server in servers:
        server.close()


def gives_up(path: str, tmp_path: Path) -> tuple[float, str]:
    """Seconds until a call over the stand-in gave up, and what it said."""
    systemd = Systemd(f"unix:path={tmp_path}/no-bus", path, timeout=TIMEOUT)
    said: list[str] = []

    def call() -> None:
        try:
            systemd.unit_property(SCOPE, "CPUWeight")
        except NodeagentError as e:
            said.append(str(e))

    t0 = time.monotonic()
    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(CEILING)
    took = time.monotonic() - t0
    assert not worker.is_alive(), f"the call was still waiting after {took:.1f} s"
    assert said, "the call did not fail"
    return took, said[0]


def test_a_peer_that_trickles_its_authentication_costs_one_deadline(
    peer: Callable[[Callable[..., None]], str], tmp_path: Path
) -> None:
    took, said = gives_up(peer(_trickle_ok), tmp_path)
    assert "private socket" in said and "no answer in time" in said, said
    assert took < 4 * TIMEOUT + 1, f"{took:.1f} s for a deadline of {TIMEOUT} s"


def test_a_peer_that_sends_other_messages_without_end_costs_one_deadline(
    peer: Callable[[Callable[..., None]], str], tmp_path: Path
) -> None:
    took, said = gives_up(peer(_flood), tmp_path)
    assert "no answer from systemd on systemd's private socket" in said, said
    assert took < 4 * TIMEOUT + 1, f"{took:.1f} s for a deadline of {TIMEOUT} s"
