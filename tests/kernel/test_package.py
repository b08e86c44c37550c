"""The Debian package ./scripts/package builds, under the VM's real systemd, managing a workload.

dist/nodeagent_VERSION_ARCH.deb (./scripts/test builds it before the VM starts when it is
missing or older than the sources) is unpacked as dpkg would install it, into systemd's mount
namespace only: /opt/venvs/nodeagent and /etc/nodeagent are mounts there (so nothing is
installed on the machine the tests run on), and the package's unit goes into
/etc/systemd/system (the harness shows systemd its allow-list of units in /usr/lib). One
drop-in raises TimeoutStartSec for the emulated VM, where Python starts slowly; nothing else of
the unit is changed. The operator's edit of the conffile is a policy that caps docker
containers, and a docker-<id>.scope (systemd-run) is the workload: the packaged agent, in its
sandbox, caps it through systemd's D-Bus API.
"""

from __future__ import annotations

import json
import platform
import re
import secrets
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import read, wait_for
from systemd_host import SystemdHost

CHECKOUT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
DEB = CHECKOUT / "dist" / f"nodeagent_{VERSION}_{ARCH}.deb"
VENV = "/opt/venvs/nodeagent"
UNIT = "nodeagent.service"
WORKLOADS = "nodeagent-workloads.service"
"""The unit that holds the workloads; nodeagent.service Requires= it."""
WAIT_S = 300.0
pytestmark = pytest.mark.timeout(900)  # the install, the start and the cap may each wait WAIT_S
POLICY = """\
version: 1
agent:
  interval: 1s
tenants:
  research: {shares: 1}
rules:
  - name: docker
    match: {runtime: docker}
    tenant: research
    limits: {cpu_max: 0.25, memory_max: 256Mi}
"""
# The package's files into systemd's mount namespace ($1: where the .deb was unpacked, in its
# /tmp), on the mount points the run made (conftest.MOUNT_POINTS: never removed here, where the
# other worker may have mounts on them).
MOUNT = r"""
set -eu
mount --bind "$1/opt/venvs/nodeagent" /opt/venvs/nodeagent
mount -t tmpfs -o mode=0755 tmpfs /etc/nodeagent
cp -a "$1/etc/nodeagent/." /etc/nodeagent/
cp "$1/lib/systemd/system/nodeagent.service" "$1/lib/systemd/system/nodeagent-workloads.service" \
  /etc/systemd/system/
"""
UNMOUNT = "umount /opt/venvs/nodeagent /etc/nodeagent"


@pytest.fixture
def installed(systemd_host: SystemdHost) -> Iterator[SystemdHost]:
    host = systemd_host
    if not DEB.exists():
        pytest.fail(f"{DEB} is missing: ./scripts/package deb builds it", pytrace=False)
    unpacked = "/tmp/nodeagent-deb"
    subprocess.run(["dpkg-deb", "-x", str(DEB), str(host.path(unpacked))], check=True)
    host.run("sh", "-c", MOUNT, "mount", unpacked)
    dropin = host.path(f"/etc/systemd/system/{UNIT}.d/vm.conf")
    dropin.parent.mkdir()
    dropin.write_text(f"[Service]\nTimeoutStartSec={WAIT_S:.0f}s\n")
    host.systemctl("daemon-reload")
    try:
        yield host
    finally:
        host.systemctl("stop", UNIT, check=False)
        dropin.unlink()
        dropin.parent.rmdir()
        host.systemctl("stop", WORKLOADS, check=False)
        for unit in (UNIT, WORKLOADS):
            host.path(f"/etc/systemd/system/{unit}").unlink(missing_ok=True)
        host.systemctl("daemon-reload", check=False)
        host.run("sh", "-c", UNMOUNT, check=False)
        host.run("rm", "-rf", unpacked, check=False)


def test_the_installed_unit_verifies_and_runs_the_packaged_command(
    installed: SystemdHost,
) -> None:
    host = installed
    unit = host.path(f"/etc/systemd/system/{UNIT}").read_text()
    assert re.search(rf"^ExecStart={VENV}/bin/nodeagent run ", unit, re.M), unit
    units = [f"/etc/systemd/system/{u}" for u in (UNIT, WORKLOADS)]
    verify = host.run("systemd-analyze", "verify", *units, check=False)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    version = host.run(f"{VENV}/bin/nodeagent", "--version", timeout=WAIT_S).stdout
    assert version == f"nodeagent, version {VERSION}\n"
    shipped = host.path("/etc/nodeagent/policy.yaml").read_text()
    assert shipped == (CHECKOUT / "config/policy.yaml").read_text(), "the conffile as shipped"


def test_the_packaged_agent_caps_a_container_through_systemd(installed: SystemdHost) -> None:
    host = installed
    scope_unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(scope_unit)
    host.path("/etc/nodeagent/policy.yaml").write_text(POLICY)  # the operator's edit
    try:
        t0 = time.monotonic()
        started = host.run("systemctl", "start", UNIT, check=False, timeout=WAIT_S)
        journal = host.run("journalctl", "--no-pager", "-o", "cat", "-u", UNIT, check=False).stdout
        assert started.returncode == 0, f"{started.stderr}\n{journal[-3000:]}"
        took = time.monotonic() - t0
        main_pid = host.systemctl("show", UNIT, "-p", "MainPID").stdout.strip().split("=")[1]
        exe = host.run("readlink", f"/proc/{main_pid}/exe").stdout.strip()
        cmdline = host.run("cat", f"/proc/{main_pid}/cmdline").stdout.split("\0")
        assert exe.startswith("/usr/bin/python3"), exe
        assert cmdline[1] == f"{VENV}/bin/nodeagent", cmdline

        def capped() -> bool:
            return read(scope, "cpu.max") == "25000 100000"

        assert wait_for(capped, WAIT_S, step=0.5), read(scope, "cpu.max")
        assert read(scope, "memory.max") == str(256 << 20)
        shown = host.systemctl("show", scope_unit, "-p", "CPUQuotaPerSecUSec").stdout
        assert "CPUQuotaPerSecUSec=250ms" in shown, shown
        lines = host.run("journalctl", "--no-pager", "-o", "cat", "-u", UNIT).stdout.splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        writes = [r for r in records if r.get("event") == "cgroup.write"]
        assert {
            (r["path"].rsplit("/", 1)[-1], r["new"]) for r in writes if scope_unit in r["path"]
        } >= {("cpu.max", "25000 100000")}, writes
        # no dockerd here (the scope only has a docker-like name): that the docker socket is
        # absent is said once, and is no problem of the package's
        problems = [
            r
            for r in records
            if r.get("level") in ("warning", "error") and r.get("event") != "runtime.unavailable"
        ]
        assert problems == [], problems
        print(f"package: {UNIT} active {took:.1f} s after systemctl start")
    finally:
        host.systemctl("stop", UNIT, check=False)
        host.systemctl("stop", scope_unit, check=False)
