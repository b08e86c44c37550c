"""nodeagent.sdbus: the pure mapping to systemd properties, and failures without a usable bus.

The calls over a real bus to a real systemd are in tests/kernel/test_systemd_dbus.py.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dbus_stub import Call, Manager, serving
from hypothesis import given
from hypothesis import strategies as st
from jeepney import HeaderFields, MessageType
from jeepney.low_level import Endianness, Header, Message

from nodeagent.cgroupfs.unitprops import (
    UINT64_MAX,
    UnitPropertyError,
    cpu_max_from_properties,
    cpu_quota_properties,
    systemd_value,
    unit_properties,
)
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, MemoryLimit
from nodeagent.errors import NodeagentError
from nodeagent.sdbus import NoBus, Systemd, SystemdBusError

DOCKER_SCOPE = "docker-" + "ab" * 32 + ".scope"


def test_an_exact_quota_maps_to_its_per_second_quota() -> None:
    props = cpu_quota_properties(CpuMax(50_000, 100_000))
    assert props == {"CPUQuotaPerSecUSec": 500_000, "CPUQuotaPeriodUSec": 100_000}
    assert cpu_max_from_properties(500_000, 100_000) == CpuMax(50_000, 100_000)


def test_a_fractional_percent_is_rounded_up_to_10_ms_per_second_like_runc() -> None:
    # 12.345 % of a CPU: systemd 252 would keep only "CPUQuota=12%" across daemon-reload
    props = cpu_quota_properties(CpuMax(12_345, 100_000))
    assert props["CPUQuotaPerSecUSec"] == 130_000
    assert systemd_value(Attribute.CPU_MAX, CpuMax(12_345, 100_000)) == CpuMax(13_000, 100_000)


def test_no_quota_is_infinity_and_systemd_writes_the_default_period() -> None:
    assert cpu_quota_properties(CpuMax(None, 50_000))["CPUQuotaPerSecUSec"] == UINT64_MAX
    assert cpu_max_from_properties(UINT64_MAX, 50_000) == CpuMax(None, 100_000)


def test_systemd_lengthens_a_period_too_short_for_a_1_ms_quota() -> None:
    # 1 % with a 20 ms period would be a 200 µs quota: systemd stretches the period to 100 ms
    assert cpu_max_from_properties(10_000, 20_000) == CpuMax(1_000, 100_000)
    assert cpu_max_from_properties(10_000, UINT64_MAX) == CpuMax(1_000, 100_000)


def test_a_zero_quota_is_refused() -> None:
    with pytest.raises(UnitPropertyError, match="CPUQuotaPerSecUSec=0"):
        cpu_max_from_properties(0, 100_000)


# quotas up to the kernel's limit, less the round-up (at most 10 ms per second of a 1 s period)
limits = st.builds(
    CpuMax,
    st.one_of(st.none(), st.integers(1_000, 2**44 - 1 - 10_000)),
    st.integers(1_000, 1_000_000),
)


@given(limits)
def test_what_systemd_writes_is_never_tighter_and_maps_to_itself(limit: CpuMax) -> None:
    written = systemd_value(Attribute.CPU_MAX, limit)
    assert isinstance(written, CpuMax)
    if limit.quota_us is None:
        assert written.quota_us is None
    else:
        assert written.cores is not None and limit.cores is not None
        assert written.cores >= limit.cores
        assert written.period_us == limit.period_us
        assert cpu_quota_properties(written)["CPUQuotaPerSecUSec"] % 10_000 == 0
    # the loop writes `written`, reads it back next tick, and must find nothing to change
    assert systemd_value(Attribute.CPU_MAX, written) == written


def test_weights_and_memory_map_one_to_one() -> None:
    assert unit_properties(Attribute.CPU_WEIGHT, CpuWeight(500)) == {"CPUWeight": 500}
    assert unit_properties(Attribute.MEMORY_MAX, MemoryLimit(1 << 30)) == {"MemoryMax": 1 << 30}
    assert unit_properties(Attribute.MEMORY_HIGH, MemoryLimit(None)) == {"MemoryHigh": UINT64_MAX}
    assert unit_properties(Attribute.MEMORY_LOW, MemoryLimit(4096)) == {"MemoryLow": 4096}
    assert systemd_value(Attribute.MEMORY_MAX, MemoryLimit(8192)) == MemoryLimit(8192)


def test_a_value_of_the_wrong_kind_has_no_property() -> None:
    with pytest.raises(UnitPropertyError, match=r"no systemd property for cpu\.weight"):
        unit_properties(Attribute.CPU_WEIGHT, MemoryLimit(4096))


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    assert isinstance(exc.value, NodeagentError)
    return message


def test_no_bus_and_no_private_socket_is_one_line_naming_both(tmp_path: Path) -> None:
    systemd = Systemd(f"unix:path={tmp_path}/bus", str(tmp_path / "private"))
    with pytest.raises(NoBus) as exc:
        systemd.set_unit_properties(DOCKER_SCOPE, {"CPUWeight": 500})
    assert one_line(exc) == (
        f"no D-Bus: cannot set CPUWeight=500 on {DOCKER_SCOPE}: "
        f"the system bus {tmp_path}/bus: No such file or directory; "
        f"systemd's private socket {tmp_path}/private: No such file or directory"
    )


@pytest.fixture
def silent_socket(tmp_path: Path) -> Iterator[str]:
    """A socket that accepts connections and never answers: a hung bus."""
    path = str(tmp_path / "silent")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_bus_that_never_answers_times_out(silent_socket: str) -> None:
    systemd = Systemd(f"unix:path={silent_socket}", silent_socket, timeout=0.2)
    with pytest.raises(NoBus) as exc:
        systemd.unit_property(DOCKER_SCOPE, "CPUWeight")
    assert one_line(exc) == (
        f"no D-Bus: cannot read CPUWeight of {DOCKER_SCOPE}: "
        f"the system bus {silent_socket}: no answer in time; "
        f"systemd's private socket {silent_socket}: no answer in time"
    )


@pytest.mark.parametrize(
    ("props", "problem"),
    [
        ({"CPUShares": 1024}, "CPUShares is not a property nodeagent sets"),
        ({"MemoryMax": -1}, "MemoryMax must be an integer in 0..2^64-1"),
        ({"MemoryMax": 2**64}, "MemoryMax must be an integer in 0..2^64-1"),
        ({"CPUWeight": True}, "CPUWeight must be an integer in 0..2^64-1"),
    ],
)
def test_bad_properties_are_refused_before_any_call(
    tmp_path: Path, props: dict[str, int], problem: str
) -> None:
    systemd = Systemd(f"unix:path={tmp_path}/bus", str(tmp_path / "private"))
    with pytest.raises(SystemdBusError) as exc:
        systemd.set_unit_properties(DOCKER_SCOPE, props)
    assert one_line(exc).endswith(f"on {DOCKER_SCOPE}: {problem}")
    assert not isinstance(exc.value, NoBus)


# -- a recording stub of systemd's manager (tests/unit/dbus_stub.py): what is asked, and when --


def _reply(serial: int, signature: str, body: tuple[object, ...]) -> bytearray:
    """A well-formed method return to call `serial`, as bytes a test may then spoil."""
    fields = {HeaderFields.reply_serial: serial, HeaderFields.signature: signature}
    header = Header(Endianness.little, MessageType.method_return, 0, 1, 0, 999, fields)
    return bytearray(Message(header, body).serialise())


def _bad_endianness(serial: int) -> bytes:
    return b"X" + bytes(_reply(serial, "o", ("/a",)))[1:]


def _bad_message_type(serial: int) -> bytes:
    raw = _reply(serial, "o", ("/a",))
    raw[1] = 9  # no such message type
    return bytes(raw)


def _string_past_its_end(serial: int) -> bytes:
    raw = _reply(serial, "o", ("/org/freedesktop/systemd1/unit/x",))
    body = len(raw) - (4 + len("/org/freedesktop/systemd1/unit/x") + 1)
    raw[body : body + 4] = (10_000).to_bytes(4, "little")  # a length beyond the message
    return bytes(raw)


def _number_cut_short(serial: int) -> bytes:
    raw = _reply(serial, "u", (5,))
    raw[4:8] = (2).to_bytes(4, "little")  # a uint32 body of 2 bytes
    return bytes(raw[:-2])


def _bad_signature(serial: int) -> bytes:
    raw = _reply(serial, "o", ("/a",))
    at = raw.index(b"\x01o\x00")  # the signature field's value: 'o' becomes '('
    raw[at + 1] = ord("(")
    return bytes(raw)


def _wrong_shape(serial: int) -> bytes:
    return bytes(_reply(serial, "ss", ("/a", "/b")))  # GetUnit answers one object path


def _too_big(serial: int) -> bytes:
    raw = _reply(serial, "o", ("/a",))
    raw[4:8] = (1 << 31).to_bytes(4, "little")  # a 2 GiB body: over D-Bus's 128 MiB limit
    return bytes(raw)


MALFORMED = {
    "bad endianness": _bad_endianness,
    "no such message type": _bad_message_type,
    "a string past the message's end": _string_past_its_end,
    "a number cut short": _number_cut_short,
    "a signature that does not parse": _bad_signature,
    "a reply of the wrong shape": _wrong_shape,
    "a body over D-Bus's limit": _too_big,
}


@pytest.fixture
def manager() -> Manager:
    return Manager({"-.slice": "/", "system.slice": "/system.slice",
                    DOCKER_SCOPE: f"/system.slice/{DOCKER_SCOPE}"})  # fmt: skip


@pytest.fixture
def stub(tmp_path: Path, manager: Manager) -> Iterator[tuple[Manager, str]]:
    path = str(tmp_path / "bus")
    with serving(path, manager):
        yield manager, path


@pytest.mark.parametrize("spoil", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_reply_closes_the_connection_and_the_next_call_reconnects(
    stub: tuple[Manager, str], tmp_path: Path, spoil: Callable[[int], bytes]
) -> None:
    manager, bus = stub
    spoiled: list[int] = []

    def once(call: Call) -> bytes | None:
        if call.member == "GetUnit" and not spoiled:
            spoiled.append(call.serial)
            return spoil(call.serial)
        return None

    manager.override = once
    systemd = Systemd(f"unix:path={bus}", str(tmp_path / "private"), timeout=5)
    with pytest.raises(SystemdBusError) as exc:
        systemd.unit_property(DOCKER_SCOPE, "CPUWeight")
    assert one_line(exc).startswith(
        f"cannot read CPUWeight of {DOCKER_SCOPE}: systemd on the system bus {bus} sent "
        "a malformed message ("
    ), "a SystemdBusError that names the unit and the bus"
    assert str(exc.value).endswith("); connection closed")
    assert not isinstance(exc.value, NoBus)
    assert systemd.via is None, "the half-read connection is gone"
    assert systemd.unit_property(DOCKER_SCOPE, "CPUWeight") == 100, "the next call works"
    assert systemd.connects == 2
    systemd.set_unit_properties(DOCKER_SCOPE, {"CPUWeight": 200})
    assert systemd.connects == 2, "and the new connection is kept"
    assert manager.members()[-1] == "SetUnitProperties"


def test_a_malformed_hello_is_a_bus_that_cannot_be_used(
    stub: tuple[Manager, str], tmp_path: Path
) -> None:
    manager, bus = stub
    manager.override = lambda call: _bad_endianness(call.serial) if call.member == "Hello" else None
    systemd = Systemd(f"unix:path={bus}", str(tmp_path / "private"), timeout=5)
    with pytest.raises(NoBus) as exc:
        systemd.unit_property(DOCKER_SCOPE, "CPUWeight")
    assert f"the system bus {bus}: a malformed message (" in one_line(exc)
    manager.override = None
    assert systemd.unit_property(DOCKER_SCOPE, "CPUWeight") == 100


def test_the_unit_of_a_cgroup_is_what_systemd_says_owns_exactly_that_cgroup(
    stub: tuple[Manager, str], tmp_path: Path
) -> None:
    manager, bus = stub
    manager.units["user@1000.service"] = "/user.slice/user-1000.slice/user@1000.service"
    systemd = Systemd(f"unix:path={bus}", str(tmp_path / "private"), timeout=5)
    assert systemd.unit_for_cgroup(f"system.slice/{DOCKER_SCOPE}") == DOCKER_SCOPE
    assert manager.members()[0] == "GetUnitByControlGroup", "asked, not read off the path"
    refused = {
        # named like a system unit, in a user's delegated tree
        f"user.slice/user-1000.slice/user@1000.service/app.slice/{DOCKER_SCOPE}": (
            "user@1000.service", "/user.slice/user-1000.slice/user@1000.service"),
        # below a unit: the unit's own business
        f"system.slice/{DOCKER_SCOPE}/inner": (DOCKER_SCOPE, f"/system.slice/{DOCKER_SCOPE}"),
        # a directory made by hand, named as a unit that does not own it
        "system.slice/sshd.service": ("system.slice", "/system.slice"),
    }  # fmt: skip
    for path, (unit, its_cgroup) in refused.items():
        with pytest.raises(NodeagentError) as exc:
            systemd.unit_for_cgroup(path)
        assert one_line(exc) == (
            f"cgroup /{path} is not a unit's own cgroup: systemd has it inside unit {unit}, "
            f"whose cgroup is {its_cgroup}; nothing is written through systemd for it"
        )
        assert not isinstance(exc.value, SystemdBusError), "systemd answered: not a bus fault"
