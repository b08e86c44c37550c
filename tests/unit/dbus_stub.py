"""A recording stand-in for systemd's D-Bus manager, for the unit tests (labelled: a stub).

It listens on a Unix socket, takes jeepney's EXTERNAL authentication, records every method
call (object path, member, body) and answers each with what `answer` says: a reply body, a
D-Bus error, or raw bytes (a malformed message). The real bus and the real systemd are in
tests/kernel/test_systemd_*.py.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from jeepney import HeaderFields, Message, MessageType, Parser, new_error, new_method_return

UNIT_PATH = "/org/freedesktop/systemd1/unit/"


@dataclass(frozen=True, slots=True)
class Call:
    path: str
    member: str
    body: tuple[object, ...]
    serial: int
    """The call's serial, which a reply names (to craft a malformed reply to it)."""


@dataclass(frozen=True, slots=True)
class Reply:
    signature: str
    body: tuple[object, ...]


@dataclass(frozen=True, slots=True)
class Error:
    name: str
    text: str


Answer = Reply | Error | bytes
"""What the stub sends back: a method return, a D-Bus error, or these bytes as they are."""


def unit_path(unit: str) -> str:
    """systemd's object path of a unit (its bus_label_escape: every byte not [A-Za-z0-9] as _xx)."""
    return UNIT_PATH + "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in unit)


class Manager:
    """systemd's side as the tests need it: units with their cgroups, and what is asked.

    `units` maps unit name to its ControlGroup. GetUnitByControlGroup answers with the unit
    whose cgroup is the longest prefix of the path, as systemd does (manager_get_unit_by_path).
    `override`, when set, answers a call first (to send a malformed message, say).
    """

    def __init__(self, units: dict[str, str]) -> None:
        self.units = units
        self.calls: list[Call] = []
        self.override: Callable[[Call], Answer | None] | None = None

    def members(self) -> list[str]:
        return [c.member for c in self.calls if c.member != "Hello"]

    def writes(self) -> list[Call]:
        """The calls that change something: properties, freezing and thawing."""
        changing = {"SetUnitProperties", "FreezeUnit", "ThawUnit"}
        return [c for c in self.calls if c.member in changing]

    def __call__(self, call: Call) -> Answer:
        if self.override is not None and (given := self.override(call)) is not None:
            return given
        if call.member == "Hello":
            return Reply("s", (":1.42",))
        by_path = {unit_path(u): u for u in self.units}
        if call.member == "GetUnitByControlGroup":
            (cgroup,) = call.body
            assert isinstance(cgroup, str)
            best = max(
                (u for u, cg in self.units.items() if _contains(cg, cgroup)),
                key=lambda u: len(self.units[u]),
                default=None,
            )
            if best is None:
                return Error("org.freedesktop.systemd1.NoSuchUnit", f"No unit for {cgroup}.")
            return Reply("o", (unit_path(best),))
        if call.member == "GetUnit":
            (name,) = call.body
            if name not in self.units:
                return Error("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not found.")
            return Reply("o", (unit_path(str(name)),))
        if call.member == "Get" and call.path in by_path:
            unit = by_path[call.path]
            _interface, prop = call.body
            if prop == "Id":
                return Reply("v", (("s", unit),))
            if prop == "ControlGroup":
                return Reply("v", (("s", self.units[unit]),))
            return Reply("v", (("t", 100),))
        if call.member in {"SetUnitProperties", "FreezeUnit", "ThawUnit"}:
            name = call.body[0]
            if name not in self.units:
                return Error("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not found.")
            return Reply("", ())
        return Error("org.freedesktop.DBus.Error.UnknownMethod", f"no {call.member} here")


def _contains(unit_cgroup: str, cgroup: str) -> bool:
    return unit_cgroup == "/" or cgroup == unit_cgroup or cgroup.startswith(unit_cgroup + "/")


def _serve(conn: socket.socket, answer: Callable[[Call], Answer], calls: list[Call]) -> None:
    data = b""

    def line() -> bytes:
        nonlocal data
        while b"\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionResetError("the client left")
            data += chunk
        first, data = data.split(b"\r\n", 1)
        return first

    if b"AUTH EXTERNAL" not in line():  # a null byte, then AUTH EXTERNAL <hex uid>
        return
    conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
    if line() != b"BEGIN":
        return
    parser = Parser()
    parser.add_data(data)
    serial = 1 << 20
    while True:
        while (msg := parser.get_next_message()) is not None:
            if msg.header.message_type is not MessageType.method_call:
                continue
            call = Call(
                str(msg.header.fields.get(HeaderFields.path)),
                str(msg.header.fields.get(HeaderFields.member)),
                tuple(msg.body),
                msg.header.serial,
            )
            calls.append(call)
            given = answer(call)
            serial += 1
            conn.sendall(_encode(msg, given, serial))
        chunk = conn.recv(65536)
        if not chunk:
            return
        parser.add_data(chunk)


def _encode(msg: Message, given: Answer, serial: int) -> bytes:
    if isinstance(given, bytes):
        return given
    answer = (
        new_error(msg, given.name, "s", (given.text,))
        if isinstance(given, Error)
        else new_method_return(msg, given.signature, given.body)
    )
    data: bytes = answer.serialise(serial=serial)  # jeepney has no annotations
    return data


@contextmanager
def serving(path: str, answer: Manager) -> Iterator[list[socket.socket]]:
    """Serve `answer` on a Unix socket at `path` until the block ends; yields the connections
    accepted so far (so a test can see how many were made)."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    server.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        with suppress(OSError):
            _serve(conn, answer, answer.calls)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except TimeoutError:
                continue
            accepted.append(conn)
            t = threading.Thread(target=serve, args=(conn,), daemon=True)
            t.start()
            threads.append(t)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield accepted
    finally:
        stop.set()
        acceptor.join()
        for conn in accepted:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for t in threads:
            t.join(timeout=5)
        server.close()
