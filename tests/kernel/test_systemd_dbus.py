"""nodeagent.sdbus against a real systemd and a real D-Bus (the test systemd of systemd_host.py).

The adapter runs inside systemd's PID and mount namespaces, where the agent itself would run
(systemd refuses private-socket clients from outside its PID namespace); the files are checked
from the VM through the cgroup mapping.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import read
from systemd_host import SystemdHost

from nodeagent.cgroupfs.unitprops import UINT64_MAX, cpu_quota_properties, systemd_value
from nodeagent.cgroupfs.values import Attribute, CpuMax
from nodeagent.sdbus import NoBus, Systemd

MIB = 1 << 20

# Prepended to every snippet run inside: a Systemd on the default (in-namespace) addresses.
PRELUDE = """
import json, subprocess, sys
from nodeagent.sdbus import *
from nodeagent.cgroupfs.unitprops import *
from nodeagent.cgroupfs.values import CpuMax
systemd = Systemd(timeout=20)
def out(**values):
    print(json.dumps(values))
"""


def inside(host: SystemdHost, code: str) -> dict[str, Any]:
    """Run `code` (after PRELUDE) inside; it reports through out(...), one JSON line."""
    result: dict[str, Any] = json.loads(host.python(PRELUDE + code).strip().splitlines()[-1])
    return result


def docker_name() -> str:
    return f"docker-{secrets.token_hex(32)}.scope"


@pytest.fixture
def docker_scope(systemd_host: SystemdHost) -> Iterator[str]:
    """A running transient scope named as Docker names its scopes."""
    unit = docker_name()
    systemd_host.start_scope(unit)
    try:
        yield unit
    finally:
        systemd_host.systemctl("stop", unit, check=False)


def test_properties_set_over_the_bus_reach_the_files_and_survive_daemon_reload(
    systemd_host: SystemdHost, docker_scope: str
) -> None:
    host, unit = systemd_host, docker_scope
    quota = CpuMax(12_345, 100_000)  # 12.345 %: systemd keeps only whole percents on reload
    props = {
        "CPUWeight": 500,
        **cpu_quota_properties(quota),
        "MemoryMax": 256 * MIB,
        "MemoryHigh": 192 * MIB,
        "MemoryLow": 16 * MIB,
        "MemoryMin": 8 * MIB,
    }
    scope = host.outer(f"/system.slice/{unit}")
    expected = {
        "cpu.weight": "500",
        "cpu.max": systemd_value(Attribute.CPU_MAX, quota).render(),
        "memory.max": str(256 * MIB),
        "memory.high": str(192 * MIB),
        "memory.low": str(16 * MIB),
        "memory.min": str(8 * MIB),
    }
    assert expected["cpu.max"] == "13000 100000"
    got = inside(
        host,
        f"""
systemd.set_unit_properties({unit!r}, {props!r})
out(**{{name: systemd.unit_property({unit!r}, name) for name in {sorted(props)!r}}})
""",
    )
    assert got == props
    assert {name: read(scope, name) for name in expected} == expected

    # what systemd does to a file written behind its back, and to our runtime properties
    (scope / "cpu.weight").write_text("42")
    host.systemctl("daemon-reload")
    assert {name: read(scope, name) for name in expected} == expected
    reloaded = inside(
        host, f"out(**{{n: systemd.unit_property({unit!r}, n) for n in {sorted(props)!r}}})"
    )
    assert reloaded == props


def test_a_quota_not_rounded_to_whole_percents_changes_at_daemon_reload(
    systemd_host: SystemdHost, docker_scope: str
) -> None:
    """Why cpu_quota_properties rounds: systemd keeps the runtime quota as a whole percent."""
    host, unit = systemd_host, docker_scope
    host.run("busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
             "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)", unit, "true",
             "1", "CPUQuotaPerSecUSec", "t", "123450")  # fmt: skip
    assert read(host.outer(f"/system.slice/{unit}"), "cpu.max") == "12345 100000"
    host.systemctl("daemon-reload")
    after = inside(host, f"out(q=systemd.unit_property({unit!r}, 'CPUQuotaPerSecUSec'))")["q"]
    assert after != 123_450
    assert read(host.outer(f"/system.slice/{unit}"), "cpu.max") != "12345 100000"


def test_the_unit_of_a_cgroup_is_systemds_answer_for_exactly_that_cgroup(
    systemd_host: SystemdHost, docker_scope: str
) -> None:
    """A scope's own cgroup is its unit's; a cgroup below it, or one made by hand and named
    after a unit that lives elsewhere, is no unit's own (issue 12 item 9)."""
    host, unit = systemd_host, docker_scope
    named_after = f"/machine.slice/{unit}"  # the real scope is in system.slice
    made = [host.outer(f"/system.slice/{unit}") / "inner", host.outer(named_after)]
    neighbour = docker_name()
    host.start_scope(neighbour, "machine.slice")  # so that machine.slice is there
    try:
        for d in made:
            d.mkdir()
        got = inside(
            host,
            f"""
def refused(path):
    try:
        return systemd.unit_for_cgroup(path)
    except NotTheUnit as exc:
        return str(exc)
out(leaf=systemd.unit_for_cgroup("/system.slice/{unit}"),
    below=refused("/system.slice/{unit}/inner"),
    named_after=refused({named_after!r}),
    connects=systemd.connects)
""",
        )
    finally:
        for d in made:
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()
        host.systemctl("stop", neighbour, check=False)
    nothing = "nothing is written through systemd for it"
    assert got == {
        "leaf": unit,
        "below": f"cgroup /system.slice/{unit}/inner is not a unit's own cgroup: systemd has "
        f"it inside unit {unit}, whose cgroup is /system.slice/{unit}; {nothing}",
        "named_after": f"cgroup {named_after} is not a unit's own cgroup: systemd has it "
        f"inside unit machine.slice, whose cgroup is /machine.slice; {nothing}",
        "connects": 1,
    }


def test_a_missing_unit_is_one_line_naming_unit_and_bus(systemd_host: SystemdHost) -> None:
    unit = f"docker-{'0' * 64}.scope"
    got = inside(
        systemd_host,
        f"""
try:
    systemd.set_unit_properties({unit!r}, {{"CPUWeight": 200}})
except SystemdBusError as exc:
    out(error=str(exc))
""",
    )
    assert got["error"] == (
        f"cannot set CPUWeight=200 on {unit}: systemd on the system bus "
        f"/run/dbus/system_bus_socket answered org.freedesktop.systemd1.NoSuchUnit: "
        f"Unit {unit} not found."
    )


def test_outside_its_namespaces_the_bus_works_and_the_private_socket_refuses(
    systemd_host: SystemdHost,
) -> None:
    host = systemd_host
    private = str(host.path("/run/systemd/private"))
    with Systemd(host.system_bus_address, private) as systemd:
        assert systemd.unit_property("dbus.service", "ActiveState") == "active"
        assert systemd.via == f"the system bus {host.path('/run/dbus/system_bus_socket')}"
    with Systemd("unix:path=/nonexistent/bus", private) as systemd, pytest.raises(NoBus) as exc:
        systemd.unit_property("dbus.service", "ActiveState")
    refused = f"systemd's private socket {private}: the peer closed the connection"
    assert str(exc.value).endswith(refused)  # its peer PID reads 0 there: systemd refuses


@pytest.fixture
def bus_stopped(systemd_host: SystemdHost) -> Iterator[None]:
    systemd_host.systemctl("stop", "dbus.socket", "dbus.service")
    try:
        yield
    finally:
        systemd_host.systemctl("start", "dbus.socket", "dbus.service")


def test_without_the_bus_it_talks_to_systemd_on_its_private_socket(
    systemd_host: SystemdHost, docker_scope: str, bus_stopped: None
) -> None:
    host, unit = systemd_host, docker_scope
    assert host.systemctl("is-active", "dbus.socket", check=False).stdout.strip() == "inactive"
    got = inside(
        host,
        f"""
systemd.set_unit_properties({unit!r}, {{"CPUWeight": 321, "MemoryMax": {UINT64_MAX}}})
out(via=systemd.via, weight=systemd.unit_property({unit!r}, "CPUWeight"))
""",
    )
    assert got == {"via": "systemd's private socket /run/systemd/private", "weight": 321}
    assert read(host.outer(f"/system.slice/{unit}"), "cpu.weight") == "321"
    assert read(host.outer(f"/system.slice/{unit}"), "memory.max") == "max"


def test_one_connection_reconnects_after_the_bus_restarts(
    systemd_host: SystemdHost, docker_scope: str
) -> None:
    host, unit = systemd_host, docker_scope
    got = inside(
        host,
        f"""
before = systemd.unit_property({unit!r}, "CPUWeight")
first = (systemd.via, systemd.connects)
subprocess.run(["systemctl", "restart", "dbus.service"], check=True, timeout=60)
systemd.set_unit_properties({unit!r}, {{"CPUWeight": 777}})
weight = systemd.unit_property({unit!r}, "CPUWeight")
out(first=first, then=(systemd.via, systemd.connects), weight=weight)
""",
    )
    # Exactly one new connection, to the bus again: the write finds the old connection dead
    # (EPIPE or EOF from the daemon that went), closes it and opens one to the bus, which is
    # back when `systemctl restart` returns (dbus.socket, systemd's, kept listening
    # throughout); the read after it goes over that same connection. The private socket
    # would be taken only were the bus unreachable; nor does the new bus answer "systemd is
    # not on it" while systemd reconnects: dbus-daemon, started by systemd
    # (--systemd-activation), holds a call to org.freedesktop.systemd1 until systemd is on
    # it (bus/activation.c, "Let's just wait until systemd connects to us").
    bus = "the system bus /run/dbus/system_bus_socket"
    assert got == {"first": [bus, 1], "then": [bus, 2], "weight": 777}
    assert read(host.outer(f"/system.slice/{unit}"), "cpu.weight") == "777"


def test_a_bus_without_systemd_on_it_sends_the_call_to_the_private_socket(
    systemd_host: SystemdHost, docker_scope: str
) -> None:
    """A bus that is up but has no systemd on it (a restart in progress): the private socket."""
    got = inside(
        systemd_host,
        f"""
import os, time
daemon = ["dbus-daemon", "--session", "--address=unix:path=/tmp/other-bus", "--nofork"]
bus = subprocess.Popen(daemon, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + 30
    while not os.path.exists("/tmp/other-bus") and time.monotonic() < deadline:
        time.sleep(0.05)
    other = Systemd("unix:path=/tmp/other-bus")
    other.set_unit_properties({docker_scope!r}, {{"CPUWeight": 654}})
    out(via=other.via, connects=other.connects)
finally:
    bus.kill()
""",
    )
    assert got == {"via": "systemd's private socket /run/systemd/private", "connects": 2}
    assert read(systemd_host.outer(f"/system.slice/{docker_scope}"), "cpu.weight") == "654"
