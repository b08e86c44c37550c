"""The Debian package ./scripts/package builds, through its whole life under the VM's real systemd,
installed, upgraded, removed and purged by the real dpkg, its maintainer scripts run as dpkg runs
them (issue 36 item 1).

dist/nodeagent_VERSION_ARCH.deb (./scripts/test builds it before the VM starts when it is
missing or older than the sources) is installed with `dpkg -i` inside systemd's namespaces, so
that the maintainer scripts' systemctl and deb-systemd-invoke talk to that systemd. Nothing is
installed on the machine the tests run on, nor kept in the VM: in systemd's mount namespace
/var/lib (dpkg's database, the state directory) and /opt/venvs are overlays on a tmpfs for the
test's duration, /etc/nodeagent a tmpfs, and the files dpkg puts in /usr go with the purge (the
VM's / is read-only: dpkg, which removes a directory the package leaves empty, may not meet it).
Two stand-ins for what a Debian host has: a Docker-style policy-rc.d, where the host has one
(this machine's refuses every start and stop; a plain Debian has none), is replaced in that
namespace by one that allows them, as on a host without one; and one drop-in raises
TimeoutStartSec for the emulated VM, where Python starts slowly. man-db's trigger does not
rebuild its database (its auto-update is off, as in Debian's container images: mandb over every
man page of the VM took over 10 minutes under TCG); `man` finds the package's pages without it.
The "newer build" is the same .deb with a higher version in its control file, as a rebuild with
a new changelog entry would be.

The operator's edit of the conffile is a policy with the packaged managed root that caps docker
containers; a docker-<id>.scope (systemd-run) is the workload, which the packaged agent, in its
sandbox, caps through systemd's D-Bus API; a `nodeagent exec` job is the job.
"""

from __future__ import annotations

import io
import json
import platform
import re
import secrets
import subprocess
import tarfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import read, wait_for
from systemd_host import SystemdHost, agent_record

from nodeagent.api import client

CHECKOUT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
NEWER = f"{VERSION}+rebuild1"
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
DEB = CHECKOUT / "dist" / f"nodeagent_{VERSION}_{ARCH}.deb"
VENV = "/opt/venvs/nodeagent"
UNIT = "nodeagent.service"
WORKLOADS = "nodeagent-workloads.service"
"""The unit that holds the workloads; nodeagent.service Requires= it."""
MANAGED = f"system.slice/{WORKLOADS}/workloads"
SOCKET = "/run/nodeagent/nodeagent.sock"
STATE_DIR = "/var/lib/nodeagent"
WAIT_S = 300.0
pytestmark = pytest.mark.timeout(900)  # the suite's ceiling: each step may wait WAIT_S
POLICY = f"""\
version: 1
agent:
  interval: 1s
  managed_root: {MANAGED}
tenants:
  research: {{shares: 1}}
rules:
  - name: docker
    match: {{runtime: docker}}
    tenant: research
    limits: {{cpu_max: 0.25, memory_max: 256Mi}}
"""
CAPPED = "25000 100000"
WORK = "/tmp/nodeagent-dpkg"
"""In systemd's /tmp (a tmpfs of its own): the overlays' upper layers and the .deb files."""
# In systemd's mount namespace, for the test's duration (see the module's docstring).
ISOLATE = rf"""
set -eu
w={WORK}
for d in /var/lib /opt/venvs; do
  layer=$w/layers$d
  mkdir -p "$layer/upper" "$layer/work"
  mount -t overlay overlay -o "lowerdir=$d,upperdir=$layer/upper,workdir=$layer/work" "$d"
done
mount -t tmpfs -o mode=0755 tmpfs /etc/nodeagent
rm -f /var/lib/man-db/auto-update
if [ -e /usr/sbin/policy-rc.d ]; then  # a Docker-style host's: it refuses every action
  printf '#!/bin/sh\nexit 0\n' >$w/policy-rc.d && chmod 755 $w/policy-rc.d
  mount --bind $w/policy-rc.d /usr/sbin/policy-rc.d
fi
"""
UNISOLATE = """
umount -l /etc/nodeagent /opt/venvs /var/lib
if grep -q ' /usr/sbin/policy-rc.d ' /proc/self/mountinfo; then umount -l /usr/sbin/policy-rc.d; fi
"""
DPKG = ("--force-confold", "--force-unsafe-io")
"""--force-unsafe-io: no fsync of each of the virtualenv's thousands of files, which under TCG
made an install take minutes; what dpkg does is otherwise the same."""
DPKG_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "DEBIAN_FRONTEND": "noninteractive",
    "LANG": "C.UTF-8",
}


class Package:
    """dpkg and systemctl inside systemd's namespaces, and what the test reads back."""

    def __init__(self, host: SystemdHost) -> None:
        self.host = host

    def dpkg(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = self.host.run("dpkg", *DPKG, *args, check=False, timeout=2 * WAIT_S, env=DPKG_ENV)
        assert done.returncode == 0, f"dpkg {' '.join(args)}: {done.stdout}{done.stderr}"
        return done

    def show(self, unit: str, *names: str) -> dict[str, str]:
        out = self.host.systemctl("show", unit, *(f"-p{n}" for n in names)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def active(self, unit: str) -> str:
        return self.show(unit, "ActiveState")["ActiveState"]

    def main_pid(self) -> int:
        return int(self.show(UNIT, "MainPID")["MainPID"])

    def api(self, path: str) -> dict[str, Any]:
        answer = client.get(str(self.host.path(SOCKET)), path, timeout=60)
        assert isinstance(answer, dict)
        return answer

    def journal(self) -> list[dict[str, Any]]:
        """The agent's log records (its native journal entries)."""
        args = ("journalctl", "--no-pager", "-o", "json", "-u", UNIT)
        lines = self.host.run(*args, check=False).stdout.splitlines()
        found = (agent_record(json.loads(line)) for line in lines if line.strip())
        return [r for r in found if r is not None]


@pytest.fixture
def package(systemd_host: SystemdHost) -> Iterator[Package]:
    host = systemd_host
    if not DEB.exists():
        pytest.fail(f"{DEB} is missing: ./scripts/package deb builds it", pytrace=False)
    host.run("sh", "-c", ISOLATE)
    dropin = host.path(f"/etc/systemd/system/{UNIT}.d/vm.conf")
    dropin.parent.mkdir()
    dropin.write_text(f"[Service]\nTimeoutStartSec={WAIT_S:.0f}s\n")
    try:
        yield Package(host)
    finally:
        host.systemctl("disable", "--now", UNIT, check=False)  # the wants link, for the next
        host.systemctl("stop", WORKLOADS, check=False)
        host.run("dpkg", *DPKG, "--purge", "nodeagent", check=False, timeout=WAIT_S, env=DPKG_ENV)
        dropin.unlink()
        dropin.parent.rmdir()
        host.systemctl("daemon-reload", check=False)
        host.run("sh", "-c", UNISOLATE, check=False)
        host.run("rm", "-rf", WORK, check=False)


def ar_members(data: bytes) -> list[tuple[str, bytes]]:
    """The members of an ar archive (a .deb): name and contents, in order."""
    assert data.startswith(b"!<arch>\n"), "not an ar archive"
    members, at = [], 8
    while at < len(data):
        header = data[at : at + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        members.append((name, data[at + 60 : at + 60 + size]))
        at += 60 + size + (size % 2)
    return members


def ar_archive(members: list[tuple[str, bytes]]) -> bytes:
    out = [b"!<arch>\n"]
    for name, body in members:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n"
        out += [header.encode(), body, b"\n" if len(body) % 2 else b""]
    return b"".join(out)


def newer_build(host: SystemdHost) -> str:
    """The same .deb at version NEWER, as a rebuild with a new changelog entry would be: only
    its control file differs. Made here without unpacking its data (xz under TCG takes
    minutes): its control.tar is rewritten, its data.tar.xz kept as it is."""
    members = ar_members(DEB.read_bytes())
    [(name, packed)] = [m for m in members if m[0].startswith("control.tar")]
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(packed)) as files,
        tarfile.open(fileobj=out, mode="w") as control,
    ):
        for info in files.getmembers():
            body = files.extractfile(info) if info.isfile() else None
            if info.name.endswith("/control") or info.name == "control":
                text = body.read().decode() if body else ""
                new = re.sub(r"(?m)^Version: .*$", f"Version: {NEWER}", text).encode()
                info.size, body = len(new), io.BytesIO(new)
            control.addfile(info, body)
    rebuilt = [("control.tar", out.getvalue()) if n == name else (n, b) for n, b in members]
    deb = f"{WORK}/nodeagent_{NEWER}_{ARCH}.deb"
    host.path(deb).write_bytes(ar_archive(rebuilt))
    return deb


def test_install_upgrade_remove_and_purge_keep_the_jobs_and_hand_back_the_caps(
    package: Package,
) -> None:
    p, host = package, package.host
    t0 = time.monotonic()
    installed = p.dpkg("-i", str(DEB))
    took = {"install": time.monotonic() - t0}
    # installed as shipped: the package's command, a clean unit, the conffile, nothing started
    unit = host.path(f"/lib/systemd/system/{UNIT}").read_text()
    assert re.search(rf"^ExecStart={VENV}/bin/nodeagent run ", unit, re.M), unit
    units = [f"/lib/systemd/system/{u}" for u in (UNIT, WORKLOADS)]
    verify = host.run("systemd-analyze", "verify", *units, check=False)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    version = host.run("/usr/bin/nodeagent", "--version", timeout=WAIT_S).stdout
    assert version == f"nodeagent, version {VERSION}\n"
    pages = host.run("man", "-w", "nodeagent", "nodeagent-policy", env=DPKG_ENV).stdout.split()
    assert pages == [
        "/usr/share/man/man8/nodeagent.8.gz",
        "/usr/share/man/man5/nodeagent-policy.5.gz",
    ], pages
    shipped = host.path("/etc/nodeagent/policy.yaml").read_text()
    assert shipped == (CHECKOUT / "config/policy.yaml").read_text(), "the conffile as shipped"
    strict = host.run("/usr/bin/nodeagent", "validate", "--strict", "/etc/nodeagent/policy.yaml")
    assert strict.stdout.startswith("/etc/nodeagent/policy.yaml: ok"), strict.stdout
    assert (p.active(UNIT), p.active(WORKLOADS)) == ("inactive", "inactive"), installed.stdout

    # the operator's edit, then enable --now: the agent caps the container, exec runs a job
    host.path("/etc/nodeagent/policy.yaml").write_text(POLICY)
    scope_unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(scope_unit)
    try:
        t0 = time.monotonic()
        started = host.run("systemctl", "enable", "--now", UNIT, check=False, timeout=WAIT_S)
        assert started.returncode == 0, f"{started.stderr}\n{host.journal_tail()}"
        took["enable --now"] = time.monotonic() - t0
        cmdline = host.run("cat", f"/proc/{p.main_pid()}/cmdline").stdout.split("\0")
        assert cmdline[1] == f"{VENV}/bin/nodeagent", cmdline
        assert wait_for(lambda: read(scope, "cpu.max") == CAPPED, WAIT_S, step=0.5)
        shown = p.show(scope_unit, "CPUQuotaPerSecUSec")
        assert shown["CPUQuotaPerSecUSec"] == "250ms", shown
        job_cgroup = host.outer(f"/{MANAGED}/survivor")
        exec_job = ["/usr/bin/nodeagent", "exec", "--name", "survivor", "--tenant", "research"]
        with host.job_client([*exec_job, "--", "sleep", "infinity"], job_cgroup) as cli:

            def job_pids() -> list[str]:
                if cli.poll() is not None:
                    out = cli.stdout.read() if cli.stdout else ""
                    raise AssertionError(f"nodeagent exec exited {cli.returncode}: {out}")
                return read(job_cgroup, "cgroup.procs").split() if job_cgroup.is_dir() else []

            def job_names() -> list[str]:
                return [j["name"] for j in p.api("/v1/jobs")["jobs"]]

            assert wait_for(lambda: bool(job_pids()), WAIT_S, step=0.5), "the job never started"
            [job_pid] = job_pids()
            # its process is in before the start is answered: the API lists it by then
            assert wait_for(lambda: job_names() == ["survivor"], WAIT_S, step=0.5), job_names()

            # an upgrade while they run: the agent restarted on the new files, nothing else
            old_pid, deb = p.main_pid(), newer_build(host)
            t0 = time.monotonic()
            upgraded = p.dpkg("-i", deb)
            took["upgrade"] = time.monotonic() - t0
            said = upgraded.stdout + upgraded.stderr
            assert (p.active(UNIT), p.active(WORKLOADS)) == ("active", "active"), said
            assert p.main_pid() != old_pid, "the agent was not restarted on the new files"
            status = host.run("dpkg-query", "-W", "-f=${Version} ${Status}", "nodeagent").stdout
            assert status == f"{NEWER} install ok installed"
            assert cli.poll() is None, f"`nodeagent exec` ended with the upgrade: {said}"
            assert read(job_cgroup, "cgroup.procs").split() == [job_pid], "the job died"
            assert job_names() == ["survivor"]
            assert read(scope, "cpu.max") == CAPPED, "the cap was handed back by the upgrade"
            assert host.path("/etc/nodeagent/policy.yaml").read_text() == POLICY

            # removal: the agent stops and hands the cap back; the job runs on, and that is said
            t0 = time.monotonic()
            removed = p.dpkg("-r", "nodeagent")
            took["remove"] = time.monotonic() - t0
            said = removed.stdout + removed.stderr
            assert p.active(UNIT) == "inactive", said
            assert read(scope, "cpu.max") == "max 100000", said
            assert p.show(scope_unit, "CPUQuotaPerSecUSec")["CPUQuotaPerSecUSec"] == "infinity"
            assert cli.poll() is None and read(job_cgroup, "cgroup.procs").split() == [job_pid]
            assert p.active(WORKLOADS) == "active"
            assert "1 process of the jobs it started run on, unmanaged" in said, said
            assert not host.path("/usr/bin/nodeagent").exists()
            assert host.path(f"{STATE_DIR}/state.json").exists(), "removal keeps the state"
            host.outer(f"/{MANAGED}/survivor/cgroup.kill").write_text("1")
            cli.communicate(timeout=60)
        host.systemctl("stop", WORKLOADS)

        # purge: the conffile and the state directory go
        t0 = time.monotonic()
        p.dpkg("-P", "nodeagent")
        took["purge"] = time.monotonic() - t0
        assert not host.path(STATE_DIR).exists()
        assert not host.path("/etc/nodeagent/policy.yaml").exists()
        assert not host.path(f"/lib/systemd/system/{UNIT}").exists()
        listed = host.run("dpkg-query", "-W", "nodeagent", check=False)
        assert listed.returncode != 0, listed.stdout
        problems = [
            r
            for r in p.journal()
            if r.get("level") in ("warning", "error") and r.get("event") != "runtime.unavailable"
        ]
        assert problems == [], problems
        print("package:", ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    finally:
        host.systemctl("stop", scope_unit, check=False)
