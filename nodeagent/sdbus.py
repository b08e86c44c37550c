"""systemd's D-Bus API for the cgroups that systemd owns: the one module that speaks D-Bus.

Why: systemd re-applies every cgroup attribute of a unit from the unit's own properties whenever
any property of that unit changes and on every ``systemctl daemon-reload`` (src/core/cgroup.c,
``cgroup_context_apply``), so a value written only to the file is lost then. Like runc's systemd
cgroup manager (which the kubelet uses), nodeagent sets the unit's properties first, as runtime
properties (``SetUnitProperties`` with runtime=true: a drop-in under /run, gone at reboot), and
then writes the file with the exact value systemd itself writes for them
(:func:`systemd_value`), so the file and the property agree and the loop has nothing to redo.

Connection: one, kept for the daemon's life. The system bus first; when it is down, systemd's
private socket ``/run/systemd/private``, as systemctl does (root only; it speaks D-Bus peer to
peer: no bus daemon, no ``Hello``, which is why this module drives jeepney's message layer itself
rather than its ``DBusConnection``, which always says ``Hello``). A call that finds the connection
dead (the bus or systemd restarted) reconnects and is retried once: every call here is safe
to retry (lookups, properties, freezing and thawing: at worst a freeze still in progress
answers busy, a failed write the next tick makes again).
A bus that answers but has no systemd on it (a restart in progress) sends the call to the
private socket. Every call has a deadline.

Every failure is a :class:`SystemdBusError`: one line naming the unit and the bus; a bus that
cannot be reached at all is a :class:`NoBus` ("no D-Bus: ..."). A message that does not parse,
or a reply of another signature than the method's, closes the connection (what is left of it in
the buffer cannot be trusted) and the next call opens a new one.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from jeepney import DBusAddress, HeaderFields, MessageType, Parser, new_method_call
from jeepney.auth import BEGIN, AuthenticationError, Authenticator
from jeepney.bus import get_bus

from nodeagent.cgroupfs.unitprops import (
    RESOURCE_PROPERTIES,
    UINT64_MAX,
)
from nodeagent.errors import NodeagentError

SYSTEM_BUS_ADDRESS = "unix:path=/run/dbus/system_bus_socket"
PRIVATE_SOCKET = "/run/systemd/private"
CALL_TIMEOUT_S = 10.0
MAX_MESSAGE = 1 << 27
"""The D-Bus specification's limit on one message (128 MiB): a header claiming more is bad."""

_SYSTEMD = "org.freedesktop.systemd1"
_MANAGER = DBusAddress("/org/freedesktop/systemd1", _SYSTEMD, "org.freedesktop.systemd1.Manager")
_DBUS = DBusAddress("/org/freedesktop/DBus", "org.freedesktop.DBus", "org.freedesktop.DBus")
_UNIT_INTERFACE = "org.freedesktop.systemd1.Unit"
_UNIT_TYPES = {
    "service": "Service",
    "scope": "Scope",
    "slice": "Slice",
    "socket": "Socket",
    "mount": "Mount",
    "swap": "Swap",
}
# The properties that live on a unit's type interface (Scope, Service, ...), not on Unit.
_TYPE_PROPERTIES = RESOURCE_PROPERTIES | {"ControlGroup", "Slice", "Delegate"}
# What the bus answers while systemd is not connected to it (the bus just restarted), besides
# failures to activate it (org.freedesktop.DBus.Error.Spawn.*).
_SYSTEMD_NOT_ON_BUS = frozenset(
    {"org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner"}
)


def _systemd_not_on_bus(error: str) -> bool:
    return error in _SYSTEMD_NOT_ON_BUS or error.startswith("org.freedesktop.DBus.Error.Spawn.")


class SystemdBusError(NodeagentError):
    """A D-Bus call to systemd failed; the message names the unit and the bus."""


class NoBus(SystemdBusError):
    """Neither the system bus nor systemd's private socket could be reached."""


class NotTheUnit(NodeagentError):
    """systemd answered, and no unit has this cgroup as its own: writing through the unit it
    names would change another cgroup (the unit's), so nothing is written for it."""

    def __init__(self, cgroup: str, unit: str, unit_cgroup: str) -> None:
        super().__init__(
            f"cgroup {cgroup} is not a unit's own cgroup: systemd has it inside unit {unit}, "
            f"whose cgroup is {unit_cgroup or 'none'}; nothing is written through systemd for it"
        )
        self.cgroup, self.unit, self.unit_cgroup = cgroup, unit, unit_cgroup


# -- the connection --------------------------------------------------------------------------------


class _CallFailed(Exception):
    """systemd (or the bus) answered a call with a D-Bus error."""

    def __init__(self, name: str, message: str) -> None:
        text = " ".join(message.split())  # one line, whatever the peer sent
        super().__init__(f"{name}: {text}" if text else name)
        self.name = name


class _BadMessage(Exception):
    """The peer sent bytes that are not a D-Bus message, or not the reply the method has."""


class _Connection:
    """One authenticated D-Bus connection; ``hello`` for a bus, not for a peer-to-peer socket."""

    def __init__(self, path: str, *, hello: bool, timeout: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._parser = Parser()
        self._serials = itertools.count(1)
        deadline = time.monotonic() + timeout  # on the whole: a peer may trickle its lines
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
            auth = Authenticator()  # EXTERNAL: the peer reads our uid from the socket
            for line in auth:
                self._sock.settimeout(_left(deadline))
                self._sock.sendall(line)
                auth.feed(self._receive())
            self._sock.settimeout(_left(deadline))
            self._sock.sendall(BEGIN)
            if hello:
                self.call(new_method_call(_DBUS, "Hello"), "s", _left(deadline))
        except BaseException:
            self._sock.close()
            raise

    def _receive(self) -> bytes:
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))
        return data

    def call(self, message: Any, returns: str, timeout: float) -> tuple[Any, ...]:
        """Send a method call, return its reply's body, of signature `returns` (other replies
        and signals are dropped)."""
        deadline = time.monotonic() + timeout
        serial = next(self._serials)
        self._sock.settimeout(timeout)
        self._sock.sendall(message.serialise(serial=serial))
        while True:
            reply = self._next_message()
            if reply is None:  # a peer sending other messages without end has the deadline too
                self._sock.settimeout(_left(deadline))
                self._parser.add_data(self._receive())
                continue
            if reply.header.fields.get(HeaderFields.reply_serial) != serial:
                continue
            if reply.header.message_type is MessageType.error:
                text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
                raise _CallFailed(str(reply.header.fields.get(HeaderFields.error_name)), text)
            signature = reply.header.fields.get(HeaderFields.signature, "")
            if signature != returns:
                raise _BadMessage(f"a reply of signature {signature!r}, not {returns!r}")
            return tuple(reply.body)

    def _next_message(self) -> Any:
        """The next whole message in the buffer, None until one is; _BadMessage for bytes that
        are not one (jeepney's parser raises whatever its unpacking meets: KeyError,
        ValueError, struct.error, IndexError, AssertionError, UnicodeDecodeError...)."""
        try:
            message = self._parser.get_next_message()
        except Exception as exc:
            text = " ".join(str(exc).split())
            kind = type(exc)
            name = (
                kind.__name__
                if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__name__}"
            )
            raise _BadMessage(f"{name}: {text}" if text else name) from exc
        size = self._parser.next_msg_size
        if message is None and size is not None and size > MAX_MESSAGE:
            raise _BadMessage(f"a message of {size} bytes, over D-Bus's limit of {MAX_MESSAGE}")
        return message

    def close(self) -> None:
        self._sock.close()


def _left(deadline: float) -> float:
    """What is left of `deadline`; TimeoutError once nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, _BadMessage):
        return f"a malformed message ({exc})"
    if isinstance(exc, (BrokenPipeError, ConnectionResetError)):  # which one is a race
        return "the peer closed the connection"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class Systemd:
    """systemd's manager over D-Bus: the system bus, else its private socket (see the module).

    Not thread-safe: one caller (the daemon's loop) at a time.
    """

    def __init__(
        self,
        bus_address: str = SYSTEM_BUS_ADDRESS,
        private_socket: str = PRIVATE_SOCKET,
        timeout: float = CALL_TIMEOUT_S,
    ) -> None:
        self.bus_address = bus_address
        self.private_socket = private_socket
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._on_bus = False
        self.via: str | None = None  # where the open connection goes, for messages and logs
        self.connects = 0  # connections opened so far: more than one means reconnects

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self.via = None, None

    def __enter__(self) -> Systemd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self, what: str, *, bus_problem: str | None = None) -> _Connection:
        """The open connection, else a new one: the bus unless `bus_problem`, else the socket."""
        if self._conn is not None:
            return self._conn
        try:
            bus_path = str(get_bus(self.bus_address))
        except (RuntimeError, ValueError, KeyError) as exc:
            raise NoBus(f"no D-Bus: cannot {what}: bad bus address {self.bus_address!r}") from exc
        bus_via = f"the system bus {bus_path}"
        candidates = [] if bus_problem else [(bus_path, True, bus_via)]
        candidates.append(
            (self.private_socket, False, f"systemd's private socket {self.private_socket}")
        )
        tried = [f"{bus_via}: {bus_problem}"] if bus_problem else []
        for path, hello, via in candidates:
            try:
                self._conn = _Connection(path, hello=hello, timeout=self.timeout)
            except (OSError, AuthenticationError, _CallFailed, _BadMessage) as exc:
                tried.append(f"{via}: {_reason(exc)}")
                continue
            self.via, self._on_bus = via, hello
            self.connects += 1
            return self._conn
        raise NoBus(f"no D-Bus: cannot {what}: {'; '.join(tried)}")

    def _call(self, what: str, message: Any, returns: str) -> tuple[Any, ...]:
        bus_problem = None
        for attempt in (1, 2):
            conn = self._connect(what, bus_problem=bus_problem)
            via = self.via
            try:
                return conn.call(message, returns, self.timeout)
            except _CallFailed as exc:
                if attempt == 1 and self._on_bus and _systemd_not_on_bus(exc.name):
                    # the bus is up but systemd is not on it (yet): the call never reached
                    # systemd; it goes to the private socket
                    self.close()
                    bus_problem = f"up, but systemd is not on it ({exc.name})"
                    continue
                raise SystemdBusError(f"cannot {what}: systemd on {via} answered {exc}") from exc
            except _BadMessage as exc:
                self.close()  # the rest of the buffer cannot be trusted: start afresh
                raise SystemdBusError(
                    f"cannot {what}: systemd on {via} sent {_reason(exc)}; connection closed"
                ) from exc
            except TimeoutError as exc:
                self.close()  # a late reply would be taken for the next call's
                raise SystemdBusError(
                    f"cannot {what}: no answer from systemd on {via} in {self.timeout:g} s"
                ) from exc
            except OSError as exc:
                self.close()
                if attempt == 2:
                    raise SystemdBusError(
                        f"cannot {what}: connection to systemd on {via} lost ({_reason(exc)})"
                    ) from exc
        raise AssertionError("unreachable")

    def _manager(
        self,
        what: str,
        method: str,
        signature: str,
        *args: Any,
        returns: str = "",
    ) -> tuple[Any, ...]:
        message = new_method_call(_MANAGER, method, signature, args)
        return self._call(what, message, returns)

    def _unit_path(self, what: str, method: str, arg: str) -> str:
        """The object path of a unit, by name (GetUnit) or by cgroup (GetUnitByControlGroup)."""
        (unit_path,) = self._manager(what, method, "s", arg, returns="o")
        return str(unit_path)

    def _get(self, what: str, unit_path: str, interface: str, name: str) -> Any:
        obj = DBusAddress(unit_path, _SYSTEMD, "org.freedesktop.DBus.Properties")
        message = new_method_call(obj, "Get", "ss", (interface, name))
        ((_signature, value),) = self._call(what, message, "v")
        return value

    # -- operations --------------------------------------------------------------------------------

    def unit_for_cgroup(self, cgroup: str) -> str:
        """The unit whose own cgroup is `cgroup` (systemd's path:
        ``/system.slice/docker-<id>.scope``), as systemd says, never read off the path.

        GetUnitByControlGroup names the unit the cgroup is in; it is the cgroup's unit only
        when that unit's ControlGroup is this very path. A cgroup below a unit (a user
        manager's delegated tree, a container's own children) or one merely named like a
        unit is :class:`NotTheUnit`: a write to the unit would land on another cgroup.
        """
        path = "/" + cgroup.strip("/")
        what = f"find the unit of cgroup {path}"
        unit_path = self._unit_path(what, "GetUnitByControlGroup", path)
        unit = str(self._get(what, unit_path, _UNIT_INTERFACE, "Id"))
        kind = _UNIT_TYPES.get(unit.rsplit(".", 1)[-1])
        own = (
            ""
            if kind is None
            else self._get(what, unit_path, _SYSTEMD + "." + kind, "ControlGroup")
        )
        if own != path:
            raise NotTheUnit(path, unit, str(own))
        return unit

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None:
        """Set resource properties (:data:`RESOURCE_PROPERTIES`, uint64; UINT64_MAX = infinity)."""
        props = list(properties.items())
        shown = " ".join(f"{k}={'infinity' if v == UINT64_MAX else v}" for k, v in props)
        what = f"set {shown} on {unit}"
        for name, value in props:
            if name not in RESOURCE_PROPERTIES:
                raise SystemdBusError(f"cannot {what}: {name} is not a property nodeagent sets")
            if type(value) is not int or not 0 <= value <= UINT64_MAX:
                raise SystemdBusError(f"cannot {what}: {name} must be an integer in 0..2^64-1")
        changes = [(name, ("t", value)) for name, value in props]
        self._manager(what, "SetUnitProperties", "sba(sv)", unit, runtime, changes)

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        """Freeze (or thaw) every process of a unit through systemd, which keeps its own
        record of the unit's freezer state (FreezeUnit/ThawUnit, systemd 246+)."""
        method = "FreezeUnit" if frozen else "ThawUnit"
        self._manager(f"{method} {unit}", method, "s", unit)

    def unit_property(self, unit: str, name: str) -> Any:
        """A loaded unit's property: cgroup ones from its type's interface, the rest from Unit."""
        what = f"read {name} of {unit}"
        unit_path = self._unit_path(what, "GetUnit", unit)
        interface = _UNIT_INTERFACE
        if name in _TYPE_PROPERTIES:
            kind = _UNIT_TYPES.get(unit.rsplit(".", 1)[-1])
            if kind is None:
                raise SystemdBusError(f"cannot {what}: not a unit name systemd gives cgroups")
            interface = f"org.freedesktop.systemd1.{kind}"
        return self._get(what, unit_path, interface, name)
