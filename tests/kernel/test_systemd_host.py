"""The real-systemd harness itself: boot, namespaces, the mapping of cgroup paths.

Keep these first among the systemd tests: when they fail, no other systemd result means anything.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import pytest
from helpers import read
from systemd_host import CHECKOUT, SystemdHost, SystemdHostError, boot, checkout_binding


def docker_scope() -> str:
    return f"docker-{secrets.token_hex(32)}.scope"


def test_boots_to_running_with_the_system_bus(systemd_host: SystemdHost) -> None:
    host = systemd_host
    assert host.systemctl("is-system-running").stdout.strip() == "running"
    active = host.systemctl("is-active", "dbus.service", "systemd-journald.service").stdout
    assert active.split() == ["active", "active"]
    assert host.path("/run/dbus/system_bus_socket").is_socket()
    assert host.path("/run/systemd/private").is_socket()
    # only the allow-listed units exist: nothing from the host's own /etc or .wants
    loaded = host.systemctl("list-units", "--all", "--plain", "--no-legend", "*.service").stdout
    assert not [u for u in loaded.split() if u.startswith(("getty", "postgresql", "cron"))]


def test_its_cgroup_root_is_a_cgroup_of_the_vm(systemd_host: SystemdHost) -> None:
    host = systemd_host
    # PID 1 sits in init.scope of its namespace: /<its root>/init.scope in the VM's hierarchy
    membership = Path(f"/proc/{host.pid}/cgroup").read_text().strip()
    assert membership == f"0::/{host.cgroup.name}/init.scope"
    assert str(host.pid) in read(host.outer("/init.scope"), "cgroup.procs").split()
    assert host.inner(host.outer("/system.slice")) == "/system.slice"
    assert host.inner(host.cgroup) == "/"
    # and from inside, the namespace's root is "/"
    assert host.run("cat", "/proc/1/cgroup").stdout.strip() == "0::/init.scope"


def test_a_docker_named_scope_gets_properties_that_survive_daemon_reload(
    systemd_host: SystemdHost,
) -> None:
    host = systemd_host
    unit = docker_scope()
    scope = host.start_scope(unit)
    try:
        host.systemctl("set-property", "--runtime", unit, "CPUWeight=500", "CPUQuota=50%")
        assert read(scope, "cpu.weight") == "500"
        assert read(scope, "cpu.max") == "50000 100000"
        (scope / "cpu.weight").write_text("42")  # a write behind systemd's back ...
        host.systemctl("daemon-reload")
        assert read(scope, "cpu.weight") == "500"  # ... is undone by the next re-apply
        assert read(scope, "cpu.max") == "50000 100000"
    finally:
        host.systemctl("stop", unit, check=False)


def test_a_broken_boot_fails_at_once_with_the_reason_and_the_journal() -> None:
    """A unit that fails at boot: boot() raises, naming it and showing its journal lines."""
    broken = {"nodeagent-broken.service": "[Service]\nType=oneshot\nExecStart=/bin/false\n"}
    with pytest.raises(SystemdHostError) as exc:
        boot(broken)
    first, *rest = str(exc.value).splitlines()
    assert first == (
        "test systemd: boot ended 'degraded', not 'running'"
        " (failed units: nodeagent-broken.service)"
    )
    assert rest[0] == "--- journal tail ---"
    assert any("nodeagent-broken.service" in line and "Failed" in line for line in rest)


def test_the_checkout_and_its_venv_are_seen_inside_at_their_path(systemd_host: SystemdHost) -> None:
    """Wherever the checkout is (a clone under /tmp included, issue 13.27: the harness's own
    /tmp hid it), code run inside imports nodeagent from it, and a PrivateTmp=yes unit runs
    its venv's Python."""
    host = systemd_host
    seen = host.python("import nodeagent, sys; print(nodeagent.__file__, sys.prefix)").split()
    assert seen == [str(CHECKOUT / "nodeagent" / "__init__.py"), str(CHECKOUT / ".venv")]
    unit = "nodeagent-harness-venv.service"
    host.path(f"/etc/systemd/system/{unit}").write_text(
        "[Service]\nType=oneshot\nPrivateTmp=yes\nProtectSystem=strict\n"
        + checkout_binding()
        + f"ExecStart={sys.executable} -c 'import nodeagent'\n"
    )
    host.systemctl("daemon-reload")
    try:
        done = host.run("systemctl", "start", unit, check=False, timeout=180)
        log = host.run("journalctl", "--no-pager", "-o", "cat", "-u", unit).stdout
        assert done.returncode == 0, log
    finally:
        host.path(f"/etc/systemd/system/{unit}").unlink()
        host.systemctl("daemon-reload")
