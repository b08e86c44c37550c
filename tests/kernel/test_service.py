"""systemd/nodeagent.service's life cycle under a real systemd (issue 8, section 3; issue 13).

The shipped units are installed in the test systemd as `nodeagent unit --install` installs them
(ExecStart= at this checkout's venv), with one drop-in that raises TimeoutStartSec for the
emulated VM (and, for a checkout under /tmp, binds it into the unit's private /tmp). The
operator's paths /etc/nodeagent and /var/lib/nodeagent are tmpfs mounts in systemd's own mount
namespace, so the tests never touch those paths of the machine they run on. The shipped
WatchdogSec=30s stays, so that a slow tick on a busy host cannot trip it; the watchdog tests
lower it in a drop-in of their own.

The tests share the installed units and run in file order; each starts the agent if it is not
running. Waits are keyed to progress (ticks seen, units active, processes gone) with generous
ceilings. A failing test prints the agent's journal and `systemctl status`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import remove_cgroup_tree
from floods import Calls, Flood
from helpers import read
from systemd_host import SystemdHost, agent_record, checkout_binding

from nodeagent import state
from nodeagent.api import client
from nodeagent.cli.units import FILES, OPTIONAL, installed_executable, render

SERVICE = "nodeagent.service"
WORKLOADS = "nodeagent-workloads.service"
UNIT_DIR = "/etc/systemd/system"
POLICY = "/etc/nodeagent/policy.yaml"
STATE = "/var/lib/nodeagent/state.json"
SOCKET = "/run/nodeagent/nodeagent.sock"
CGROUP = "system.slice/nodeagent.service"  # systemd's name for the agent's cgroup
MANAGED = f"system.slice/{WORKLOADS}/workloads"  # docs/service.md's managed root
EXE = installed_executable()  # this checkout's .venv/bin/nodeagent: what the units run
WAIT_S = 300.0  # under TCG on a busy host, validate and the agent's start took 40 s and 90 s
WATCHDOG_S = 10  # the watchdog tests' WatchdogSec: ticks take well under 1 s, even here
pytestmark = pytest.mark.timeout(900)  # a test may wait WAIT_S for a start, a reload and a stop
METRICS_PORT = 19464
# The start timeout raised (from 90 s) for the emulated VM, where starting Python and importing
# the agent can take a minute (it bounds ExecReload= and ExecStopPost= too).
TEST_DROPIN = f"[Service]\nTimeoutStartSec={WAIT_S:.0f}s\nTimeoutStopSec={WAIT_S:.0f}s\n"
WATCHDOG_DROPIN = f"[Service]\nWatchdogSec={WATCHDOG_S}s\n"
T = TypeVar("T")

# What the agent may write under the unit's sandbox (the rest of / is read-only for it).
MOUNTS = {
    "/sys/fs/cgroup": "rw",
    "/run/nodeagent": "rw",
    "/var/lib/nodeagent": "rw",
    "/etc": "ro",
    "/etc/nodeagent": "ro",
    "/usr": "ro",
    "/var/lib": "ro",
    str(Path(EXE).parents[2]): "ro",  # this checkout, where the units' nodeagent is
    "/home": "ro",
}
# The operator's paths, inside systemd's mount namespace only, on the mount points the run made
# (conftest.MOUNT_POINTS: never removed here, where the other worker may have mounts on them).
MOUNT = r"""
set -eu
mount -t tmpfs -o mode=0755 tmpfs /etc/nodeagent
mount -t tmpfs -o mode=0755 tmpfs /var/lib/nodeagent
"""
UNMOUNT = "umount /etc/nodeagent /var/lib/nodeagent"
# $2 busy loops in a new cgroup of the managed subtree ($1, relative to the cgroup root), started
# inside systemd's PID namespace so that systemd sees them.
SPAWN_BUSY = r"""
cg=/sys/fs/cgroup/$1
mkdir "$cg" &&
for i in $(seq "${2:-1}"); do
  sh -c 'echo $$ > "$0/cgroup.procs" && exec sh -c "while :; do :; done"' "$cg" \
    </dev/null >/dev/null 2>&1 &
done
"""


def policy(cpu_max: str, agent: str = "") -> str:
    """The operator's policy: the managed subtree in nodeagent-workloads.service, a cap for
    each workload; `agent`: more lines of its agent section."""
    return f"""\
version: 1
agent:
  managed_root: {MANAGED}
{agent}tenants:
  research:
    shares: 1
rules:
  - name: workloads
    match:
      path: {MANAGED}/*
    tenant: research
    limits:
      cpu_max: {cpu_max}
"""


GOOD = policy("0.2")  # cpu.max 20000 100000
BETTER = policy("0.3")  # cpu.max 30000 100000
BAD = policy("lots")  # line 13: not a number of cores
BAD_LINE = 13


class Service:
    """nodeagent.service in the test systemd: systemctl, its journal, its files and cgroups."""

    def __init__(self, host: SystemdHost) -> None:
        self.host = host

    # -- systemd ------------------------------------------------------------------------------

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.host.systemctl(*args, check=check)

    def show(self, *properties: str) -> dict[str, str]:
        args = [f"--property={p}" for p in properties]
        out = self.systemctl("show", *args, SERVICE).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def show_unit(self, unit: str, prop: str) -> str:
        return self.systemctl("show", f"--property={prop}", "--value", unit).stdout.strip()

    def active_state(self) -> str:
        return self.show("ActiveState")["ActiveState"]

    def main_pid(self) -> int:
        return int(self.show("MainPID")["MainPID"])

    def dropin(self, name: str, text: str | None) -> None:
        """Add (or, with None, remove) /etc/systemd/system/nodeagent.service.d/NAME.conf."""
        path = self.host.path(f"{UNIT_DIR}/{SERVICE}.d/{name}.conf")
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        self.systemctl("daemon-reload")

    def start(self) -> float:
        """`systemctl start` (it returns once the unit is active); the seconds it took."""
        t0 = time.monotonic()
        started = self.host.run("systemctl", "start", SERVICE, check=False, timeout=WAIT_S)
        took = time.monotonic() - t0
        assert started.returncode == 0, f"systemctl start {SERVICE}: {started.stderr.strip()}"
        assert self.active_state() == "active"
        return took

    def restart(self, old: int) -> int:
        """`systemctl restart`; the new agent's MainPID, once it is active (READY=1)."""
        done = self.host.run("systemctl", "restart", SERVICE, check=False, timeout=WAIT_S)
        assert done.returncode == 0, f"systemctl restart {SERVICE}: {done.stderr.strip()}"
        return self.wait_for_a_new_agent(old)

    def wait_for_a_new_agent(self, old: int) -> int:
        def new() -> int:
            now = self.show("ActiveState", "MainPID")
            pid = int(now["MainPID"])
            return pid if now["ActiveState"] == "active" and pid not in (0, old) else 0

        return wait("a new agent, active", new, timeout=2 * WAIT_S)

    def start_seconds(self) -> str:
        """How long the last start took, by systemd's clock: from leaving `inactive` (the
        ExecStartPre= validate included) to `active` (READY=1)."""
        began, ready = "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic"
        times = self.show(began, ready)
        return f"{(int(times[ready]) - int(times[began])) / 1e6:.1f}"

    def ensure_running(self, text: str = GOOD) -> int:
        """The agent's MainPID, after starting it (with policy `text`) if it is not active."""
        if self.active_state() != "active":
            self.write_policy(text)  # a test that failed may have left another one
            self.systemctl("reset-failed", SERVICE, check=False)
            self.start()
        return self.main_pid()

    def write_policy(self, text: str) -> None:
        self.host.path(POLICY).write_text(text)

    # -- the journal --------------------------------------------------------------------------

    def cursor(self) -> str | None:
        """Where the journal ends now: pass it to entries() to read only what comes after."""
        last = self.host.run("journalctl", "--no-pager", "-o", "json", "-n", "1").stdout.strip()
        return str(json.loads(last)["__CURSOR"]) if last else None

    def entries(self, after: str | None = None, pid: int | None = None) -> list[dict[str, Any]]:
        """The unit's journal entries (systemd's about it and the agent's own), oldest first."""
        args = ["journalctl", "--no-pager", "-o", "json", "-u", SERVICE]
        if after is not None:
            # --cursor, not --after-cursor: with a filter, systemd < 255 skips the first entry
            # that matches when the cursor's own entry does not (systemd issue 30288)
            args.append(f"--cursor={after}")
        if pid is not None:
            args.append(f"_PID={pid}")
        lines = self.host.run(*args).stdout.splitlines()
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if e.get("__CURSOR") != after]

    def manager_says(self, after: str | None) -> list[str]:
        """systemd's own messages about the unit."""
        return [str(e["MESSAGE"]) for e in self.entries(after) if e.get("_PID") == "1"]

    def events(self, after: str | None = None, pid: int | None = None) -> list[dict[str, Any]]:
        """The agent's log records (native journal entries: NODEAGENT_EVENT and its fields)."""
        return [r for e in self.entries(after, pid) if (r := agent_record(e)) is not None]

    def event(self, after: str | None, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events(after) if e.get("event") == name), None)

    def tail(self, lines: int = 40) -> str:
        """The journal's last lines about the unit, without systemd's debug messages."""
        args = ("journalctl", "--no-pager", "-o", "cat", "-p", "info", "-u", SERVICE)
        return self.host.run(*args, "-n", str(lines), check=False).stdout

    # -- the agent's process, files and cgroups -----------------------------------------------

    def proc(self, pid: int, name: str) -> str:
        """/proc/PID/NAME as systemd's PID namespace sees it."""
        return self.host.run("cat", f"/proc/{pid}/{name}").stdout

    def allocations(self) -> dict[str, Any]:
        """What `nodeagent allocations --json` shows, asked of the API socket from here (a
        client inside would be one more Python start, which takes seconds under TCG)."""
        answer = client.get(str(self.host.path(SOCKET)), "/v1/allocations", timeout=60)
        assert isinstance(answer, dict)
        return answer

    def status(self) -> dict[str, Any]:
        """What `nodeagent status --json` shows (GET /v1/status)."""
        answer = client.get(str(self.host.path(SOCKET)), "/v1/status", timeout=60)
        assert isinstance(answer, dict)
        return answer

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs the running agent knows (GET /v1/jobs)."""
        answer = client.get(str(self.host.path(SOCKET)), "/v1/jobs", timeout=60)
        assert isinstance(answer, dict)
        return list(answer["jobs"])

    @staticmethod
    def alive(pid: int) -> bool:
        """Whether process `pid` (as the VM numbers it: cgroup.procs read from here) is there
        and not a zombie."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]

    @staticmethod
    def inner_pid(pid: int) -> int:
        """The number systemd's PID namespace (and so the agent) gives the VM's process `pid`."""
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("NSpid:")).split()[-1])

    def status_tick(self) -> int | None:
        """The tick number of the agent's last STATUS= line ("tick N: ..."), if any."""
        found = re.match(r"tick (\d+):", self.show("StatusText")["StatusText"])
        return int(found.group(1)) if found else None

    def job(
        self, name: str, *options: str
    ) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
        """`nodeagent exec --name NAME OPTIONS -- sleep infinity` from a shell of systemd's
        host (SystemdHost.job_client)."""
        command = [sys.executable, "-m", "nodeagent", "exec", "--name", name, *options]
        job = self.host.outer(f"/{MANAGED}/{name}")
        return self.host.job_client([*command, "--", "sleep", "infinity"], job)

    @contextlib.contextmanager
    def busy_workload(self, name: str, loops: int = 1, listed: bool = True) -> Iterator[Path]:
        """A cgroup MANAGED/NAME with `loops` busy processes; its VM path. It outlives the
        agent (nodeagent-workloads.service holds it); removed after. With `listed`, once the
        agent lists it among its workloads."""
        cgroup = self.host.outer(f"/{MANAGED}/{name}")
        self.host.run("sh", "-c", SPAWN_BUSY, "spawn", f"{MANAGED}/{name}", str(loops))
        try:
            wait(
                f"{loops} processes in {cgroup}",
                lambda: len(read(cgroup, "cgroup.procs").split()) >= loops,
            )
            if listed:
                wait(
                    f"the agent to list {MANAGED}/{name} among its workloads",
                    lambda: _rows(self.allocations(), {name}),
                )
            yield cgroup
        finally:
            if cgroup.exists():
                remove_cgroup_tree(cgroup)


def started(cli: subprocess.Popen[str], cgroup: Path) -> list[str] | None:
    """The pids in a job's cgroup once `nodeagent exec` has put its command there; fails at
    once with the CLI's own words if it exited instead (a refused job)."""
    if cli.poll() is not None:
        out = cli.stdout.read() if cli.stdout else ""
        raise AssertionError(f"nodeagent exec exited {cli.returncode}: {out.strip()}")
    return read(cgroup, "cgroup.procs").split() if cgroup.is_dir() else None


def wait(what: str, check: Callable[[], T | None], timeout: float = WAIT_S, step: float = 0.2) -> T:
    """check()'s first truthy value; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)
    return value


def cpu_max(cgroup: Path) -> str:
    return read(cgroup, "cpu.max")


def exec_start() -> str:
    """The installed unit's ExecStart command line."""
    lines = render(SERVICE, EXE).splitlines()
    return next(line.split("=", 1)[1] for line in lines if line.startswith("ExecStart="))


def install_units(host: SystemdHost, metrics: bool = False) -> None:
    """The units as `nodeagent unit --install [--metrics]` writes them (this checkout's
    nodeagent in ExecStart=); without `metrics`, the metrics drop-in is removed."""
    for relative in FILES:
        target = host.path(f"{UNIT_DIR}/{relative}")
        if relative in OPTIONAL and not metrics:
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(relative, EXE))
    host.systemctl("daemon-reload")


@pytest.fixture(scope="module")
def service(systemd_host: SystemdHost) -> Iterator[Service]:
    """The units installed (with the policy and a test drop-in), not started."""
    host = systemd_host
    host.run("sh", "-c", MOUNT)
    unit = Service(host)
    try:
        install_units(host)
        unit.write_policy(GOOD)
        unit.dropin("50-test", TEST_DROPIN + checkout_binding())
        yield unit
    finally:
        for name in (SERVICE, WORKLOADS):
            unit.systemctl("stop", name, check=False)
            unit.systemctl("reset-failed", name, check=False)  # a failed unit degrades the host
        for relative in FILES:
            host.path(f"{UNIT_DIR}/{relative}").unlink(missing_ok=True)
        shutil.rmtree(host.path(f"{UNIT_DIR}/{SERVICE}.d"), ignore_errors=True)
        with contextlib.suppress(OSError):
            host.path(f"{UNIT_DIR}/system.slice.d").rmdir()
        unit.systemctl("daemon-reload")
        host.run("sh", "-c", UNMOUNT)


@pytest.fixture(autouse=True)
def _journal_on_failure(request: pytest.FixtureRequest, service: Service) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        status = service.systemctl("status", "--lines=0", SERVICE, check=False).stdout
        print(f"--- systemctl status {SERVICE} ---\n{status}")
        print(f"--- journalctl -u {SERVICE} -o cat (tail) ---\n{service.tail()}")


def test_start_is_active_only_after_the_first_tick_and_never_with_a_bad_policy(
    service: Service, record_testsuite_property: Callable[[str, object], None]
) -> None:
    s = service
    s.systemctl("stop", SERVICE)
    # ExecStartPre=nodeagent validate refuses the file: the agent itself never runs
    s.write_policy(BAD)
    before = s.show("ExecMainStartTimestampMonotonic")
    mark = s.cursor()
    refused = s.host.run("systemctl", "start", SERVICE, check=False, timeout=WAIT_S)
    assert refused.returncode != 0
    assert s.show("ExecMainStartTimestampMonotonic") == before  # no main process was started
    assert any(re.search(rf"^{POLICY}:{BAD_LINE}:\d+: ", m) for m in s.tail(20).splitlines())
    assert s.events(mark) == []  # not one line from `nodeagent run`
    assert _errors(s, rf"^{POLICY}:{BAD_LINE}:\d+: ")  # filed at priority err
    s.systemctl("stop", SERVICE)  # Restart=on-failure would retry it every RestartSec
    s.systemctl("reset-failed", SERVICE, check=False)  # "not loaded" once collected

    # The agent is held (SIGSTOP) as it starts, before Python runs: systemd has a MainPID but
    # the unit stays `activating`. Let go, it turns `active` only once READY=1 comes, and
    # systemd's debug log shows the first tick's STATUS= arriving before READY=1.
    s.write_policy(GOOD)
    command = exec_start()
    s.dropin(
        "60-test-hold",
        f"[Service]\nExecStart=\nExecStart=/bin/sh -c 'kill -STOP $$$$ && exec {command}'\n",
    )
    s.host.run("systemd-analyze", "log-level", "debug")
    try:
        mark = s.cursor()
        s.systemctl("start", "--no-block", SERVICE)
        pid = wait("the held agent", lambda: s.main_pid() and _stopped(s, s.main_pid()))
        held = s.show("ActiveState", "SubState")
        assert held == {"ActiveState": "activating", "SubState": "start"}
        assert not s.host.path(SOCKET).exists()
        t0 = time.monotonic()
        s.systemctl("kill", "--kill-whom=main", "--signal=SIGCONT", SERVICE)
        wait("active", lambda: s.active_state() == "active")
        record_testsuite_property(
            "nodeagent.service let go to active (s)", f"{time.monotonic() - t0:.1f}"
        )
    finally:
        s.host.run("systemd-analyze", "log-level", "info")
        s.dropin("60-test-hold", None)
    assert s.main_pid() == pid  # the same process that was held
    notes = [m for m in s.manager_says(mark) if f"Got notification message from PID {pid} " in m]
    ready = next(i for i, m in enumerate(notes) if "READY=1" in m)
    assert [m for m in notes[:ready] if "STATUS=tick 1:" in m], notes[: ready + 1]


def _errors(s: Service, pattern: str) -> list[str]:
    """The unit's journal lines at priority err or worse (`journalctl -p err`) matching."""
    args = ("journalctl", "--no-pager", "-o", "cat", "-p", "err", "-u", SERVICE)
    return [m for m in s.host.run(*args).stdout.splitlines() if re.search(pattern, m)]


def _stopped(s: Service, pid: int) -> int:
    """pid if that process is stopped (state T), else 0."""
    stat = s.host.run("cat", f"/proc/{pid}/stat", check=False).stdout
    return pid if stat.rsplit(")", 1)[-1].split()[:1] == ["T"] else 0


def test_the_agent_runs_under_the_hardened_unit(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    s = service
    pid = s.ensure_running()
    # the unit's sandbox is the agent's: no new privileges, a seccomp filter, two capabilities
    status = dict(line.split(":", 1) for line in s.proc(pid, "status").splitlines() if ":" in line)
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # filter mode: SystemCallFilter=, MemoryDenyW^X
    caps = (1 << 0) | (1 << 1) | (1 << 23)  # CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_SYS_NICE
    assert int(status["CapBnd"], 16) == caps
    # LimitNOFILE=8192: a flood of API connections cannot starve the tick of descriptors
    limits = s.proc(pid, "limits")
    assert re.search(r"^Max open files\s+8192\s+8192\s", limits, re.M), limits
    # ProtectSystem=strict and ProtectHome=read-only, seen from the agent's mount namespace:
    # it may write only its cgroups, its run and state directories (and its private /tmp)
    probe = " ".join(f"[ -w {p} ] && echo {p}: rw || echo {p}: ro;" for p in MOUNTS)
    seen = s.host.run("nsenter", "-t", str(pid), "-m", "--", "sh", "-c", probe).stdout
    assert dict(line.split(": ") for line in seen.splitlines()) == MOUNTS

    # it stays alone in its unit's cgroup; the workloads' subtree is nodeagent-workloads.service's,
    # whose one process waits in a leaf, with cpu+memory enabled below it by the agent
    assert s.proc(pid, "cgroup").strip() == f"0::/{CGROUP}"
    holder = s.host.outer(f"/system.slice/{WORKLOADS}")
    assert read(holder, "cgroup.procs") == ""  # no internal process
    assert len(read(holder / "holder", "cgroup.procs").split()) == 1
    assert {"cpu", "memory"} <= set(read(holder / "workloads", "cgroup.subtree_control").split())
    # 13.25: it protects itself under pressure (the OOM killer, reclaim, CPU)
    assert s.proc(pid, "oom_score_adj").strip() == "-900"
    agent_cgroup = s.host.outer(f"/{CGROUP}")
    assert read(agent_cgroup, "memory.min") == str(64 << 20)
    assert read(agent_cgroup.parent, "memory.min") == str(64 << 20)  # handed down by system.slice
    assert read(agent_cgroup, "cpu.weight") == "500"

    mark = s.cursor()
    with s.busy_workload("train-0") as workload:
        # a workload of its delegated subtree gets its rule's cap, with an audit record
        wait("the rule's cpu.max", lambda: cpu_max(workload) == "20000 100000")
        write = wait(
            "the audit record of the cpu.max write",
            lambda: next(
                (
                    e
                    for e in s.events(mark)
                    if e.get("event") == "cgroup.write" and e.get("attribute") == "cpu.max"
                ),
                None,
            ),
        )
        write_path = write["path"]
        assert write["path"].endswith(f"{MANAGED}/train-0/cpu.max")
        assert (write["old"], write["new"]) == ("max 100000", "20000 100000")
        # the journal reads like other services' (`journalctl -u`, `systemctl status`): a
        # line, not a JSON object; `-o json` keeps every field apart (issue 36, item 9)
        [entry] = [
            e
            for e in s.entries(mark)
            if e.get("NODEAGENT_EVENT") == "cgroup.write" and e.get("NODEAGENT_PATH") == write_path
        ]
        assert entry["MESSAGE"].startswith(
            f'cgroup.write path={write_path} attribute=cpu.max old="max 100000"'
            ' new="20000 100000" reason='
        ), entry
        assert (entry["PRIORITY"], entry["SYSLOG_IDENTIFIER"]) == ("6", "nodeagent")
        assert entry["_PID"] == str(pid)
        shown = s.host.run("journalctl", "--no-pager", "-u", SERVICE, "-n", "6").stdout
        with capsys.disabled():
            print(f"\njournalctl -u {SERVICE} -n 6:\n{shown}")

        # `nodeagent exec` through the API socket: a job the agent puts in a cgroup of its own
        job_cgroup = s.host.outer(f"/{MANAGED}/sleeper")
        with s.job("sleeper", "--tenant", "research", "--cpus", "0.1") as cli:
            job_pids = wait(
                "the job's process in its cgroup",
                lambda: started(cli, job_cgroup),
            )
            assert cpu_max(job_cgroup) == "10000 100000"
            rows = wait(
                "both workloads in `nodeagent allocations`",
                lambda: _rows(s.allocations(), {"train-0", "sleeper"}),
            )
            assert {r["tenant"] for r in rows} == {"research"}
            os.kill(int(job_pids[0]), signal.SIGTERM)  # the job ends ...
            out, _ = cli.communicate(timeout=WAIT_S)
            assert cli.returncode == 128 + signal.SIGTERM, out
        # ... and the agent removes its cgroup
        wait("the agent to remove the finished job's cgroup", lambda: not job_cgroup.exists())
        assert s.jobs() == []

    # its run and state directories, as the unit made them
    socket = s.host.path(SOCKET)
    assert socket.is_socket() and (socket.stat().st_mode & 0o777) == 0o660
    assert (socket.parent.stat().st_mode & 0o777) == 0o750
    assert (s.host.path(STATE).parent.stat().st_mode & 0o777) == 0o750
    saved = state.load(str(s.host.path(STATE)), tenants={"research"})
    assert saved is not None
    # it ticks, and nothing it did under the sandbox failed or was refused
    tick = s.status_tick()
    wait("another tick", lambda: (s.status_tick() or 0) > (tick or 0))
    complaints = [
        e for e in s.events(pid=pid) if e.get("level") in ("warning", "error", "critical")
    ]
    assert complaints == []
    assert s.main_pid() == pid


def _rows(allocations: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    """The allocation rows of the workloads named `names`, once all of them are there."""
    rows = [r for r in allocations["allocations"] if r["cgroup"].rsplit("/", 1)[-1] in names]
    return rows if len(rows) == len(names) else []


def test_reload_fails_on_a_bad_file_keeps_the_last_good_policy_and_applies_a_good_one(
    service: Service, record_testsuite_property: Callable[[str, object], None]
) -> None:
    """13.5, and issue 36 item 4: ExecReload= asks the agent itself (`nodeagent reload`), so
    `systemctl reload` tells the truth and so does the agent: a bad file fails it (non-zero,
    the FILE:LINE:COL at priority err), the agent refused it (policy.invalid; its status says
    the reload was refused, which is what nodeagent_config_last_reload_successful reads) and
    keeps its last good policy; a good one is applied. A SIGHUP by hand is refused the same
    way."""
    s = service
    s.write_policy(GOOD)
    pid = s.ensure_running()
    with s.busy_workload("train-reload") as workload:
        wait("the rule's cpu.max", lambda: cpu_max(workload) == "20000 100000")

        s.write_policy(BAD)
        mark = s.cursor()
        refused = s.host.run("systemctl", "reload", SERVICE, check=False, timeout=WAIT_S)
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert (s.active_state(), s.main_pid()) == ("active", pid)
        problem = rf"^{POLICY}:{BAD_LINE}:\d+: "
        assert [e for e in s.entries(mark) if re.search(problem, str(e.get("MESSAGE")))]
        assert _errors(s, problem)
        invalid = wait("policy.invalid", lambda: s.event(mark, "policy.invalid"))
        assert invalid["problem"].startswith(f"{POLICY}:{BAD_LINE}:")  # the agent was asked
        last = s.status()["last_reload"]
        assert last["applied"] is False and last["problems"][0].startswith(f"{POLICY}:"), last

        mark = s.cursor()
        s.systemctl("kill", "--kill-whom=main", "--signal=SIGHUP", SERVICE)
        invalid = wait("policy.invalid", lambda: s.event(mark, "policy.invalid"))
        assert invalid["problem"].startswith(f"{POLICY}:{BAD_LINE}:")
        assert invalid["action"] == "keeping the last good policy"
        said = [e for e in s.entries(mark) if e.get("NODEAGENT_EVENT") == "policy.invalid"]
        assert [e["PRIORITY"] for e in said] == ["3"], said  # the agent's entry, at err
        # still the same agent, still applying the old values, to a workload new since too
        assert (s.active_state(), s.main_pid()) == ("active", pid)
        with s.busy_workload("train-late") as late:
            wait("the old policy's cpu.max", lambda: cpu_max(late) == "20000 100000")
        assert s.event(mark, "policy.reloaded") is None

        s.write_policy(BETTER)
        mark = s.cursor()
        t0 = time.monotonic()
        s.host.run("systemctl", "reload", SERVICE, timeout=WAIT_S)
        wait("the new policy's cpu.max", lambda: cpu_max(workload) == "30000 100000")
        took = time.monotonic() - t0
        record_testsuite_property("nodeagent.service reload to new value (s)", f"{took:.1f}")
        assert s.event(mark, "policy.reloaded") is not None
        assert (s.active_state(), s.main_pid()) == ("active", pid)

        s.write_policy(GOOD)  # as the other tests expect it
        mark = s.cursor()
        s.host.run("systemctl", "reload", SERVICE, timeout=WAIT_S)
        wait("policy.reloaded", lambda: s.event(mark, "policy.reloaded"))


def test_a_restart_a_crash_and_a_watchdog_kill_leave_jobs_running_for_the_next_agent(
    service: Service, record_testsuite_property: Callable[[str, object], None]
) -> None:
    """13.1: an `exec` job runs on through `systemctl restart`, a crash (SIGKILL of the main
    process) and a watchdog kill (SIGSTOP: no more pings), each agent after adopts it (its
    API lists it, from the state file), and the last one removes its cgroup when it ends."""
    s = service
    s.dropin("70-test-watchdog", WATCHDOG_DROPIN)
    s.systemctl("stop", SERVICE)
    pid = s.ensure_running()
    assert s.show("WatchdogUSec")["WatchdogUSec"] == f"{WATCHDOG_S}s"
    job_cgroup = s.host.outer(f"/{MANAGED}/survivor")
    try:
        with s.job("survivor", "--tenant", "research", "--cpus", "0.1") as cli:
            [job_pid] = wait(
                "the job's process in its cgroup",
                lambda: started(cli, job_cgroup),
            )
            # its process is in before the start is answered: the API lists it by then
            wait("the job listed", lambda: [j["name"] for j in s.jobs()] == ["survivor"])

            def adopted(how: str, new: int) -> None:
                assert s.alive(int(job_pid)), f"the job died with the agent ({how})"
                assert read(job_cgroup, "cgroup.procs").split() == [job_pid], how
                assert cli.poll() is None, f"`nodeagent exec` ended ({how})"
                jobs = s.jobs()  # the new agent's, restored from the state file
                expected = [("survivor", s.inner_pid(int(job_pid)))]
                assert [(j["name"], j["pid"]) for j in jobs] == expected, how
                rows = wait(f"the job among the allocations ({how})",
                            lambda: _rows(s.allocations(), {"survivor"}))  # fmt: skip
                assert rows[0]["rule"] == "exec:survivor"
                assert cpu_max(job_cgroup) == "10000 100000"
                assert s.main_pid() == new

            t0 = time.monotonic()
            pid = s.restart(pid)
            record_testsuite_property(
                "nodeagent.service restart to active (s)", f"{time.monotonic() - t0:.1f}"
            )
            adopted("systemctl restart", pid)

            restarts = int(s.show("NRestarts")["NRestarts"])
            s.systemctl("kill", "--kill-whom=main", "--signal=SIGKILL", SERVICE)  # a crash
            pid = s.wait_for_a_new_agent(pid)
            assert int(s.show("NRestarts")["NRestarts"]) == restarts + 1
            adopted("SIGKILL of the agent", pid)

            mark = s.cursor()
            t0 = time.monotonic()
            s.systemctl("kill", "--kill-whom=main", "--signal=SIGSTOP", SERVICE)  # hung
            pid = s.wait_for_a_new_agent(pid)
            record_testsuite_property(
                "nodeagent.service hung to restarted and active (s)", f"{time.monotonic() - t0:.1f}"
            )
            said = s.manager_says(mark)
            assert [m for m in said if "Watchdog timeout" in m], said
            assert int(s.show("NRestarts")["NRestarts"]) == restarts + 2
            adopted("watchdog kill", pid)
            record_testsuite_property(
                "nodeagent.service restart: start to active, validate included (s)",
                s.start_seconds(),
            )

            mark = s.cursor()
            os.kill(int(job_pid), signal.SIGTERM)  # the job ends: `exec` reports it ...
            out, _ = cli.communicate(timeout=WAIT_S)
            assert cli.returncode == 128 + signal.SIGTERM, out
        # ... and the agent that adopted it removes its cgroup and its record
        wait("the adopting agent to remove the job's cgroup", lambda: not job_cgroup.exists())
        finished = wait("job.finished", lambda: s.event(mark, "job.finished"))
        assert finished["job"] == "survivor"
        assert s.jobs() == []
        assert s.main_pid() == pid
    finally:
        s.dropin("70-test-watchdog", None)


SHORT_WATCHDOG_S, INTERVAL_S = 5, 12
"""13.2's WatchdogSec and interval. Without the fix the pings (every half WatchdogSec) stop one
WatchdogSec after a tick and systemd kills the agent one WatchdogSec after the last: 7.5 to
10 s after a tick, before the next at 12 s. (WATCHDOG_S and 25 s made the same proof with
twice the wait.)"""


def test_an_interval_longer_than_the_watchdog_does_not_get_the_agent_killed(
    service: Service,
) -> None:
    """13.2: agent.interval 12 s under WatchdogSec=5s: the loop pings between ticks, so the same
    agent ticks on for two whole intervals (the loop used to ping only within WatchdogSec of
    its last tick: systemd killed it between ticks)."""
    s = service
    s.dropin("70-test-watchdog", f"[Service]\nWatchdogSec={SHORT_WATCHDOG_S}s\n")
    try:
        s.systemctl("stop", SERVICE)
        pid = s.ensure_running(policy("0.2", agent=f"  interval: {INTERVAL_S}s\n"))
        before = s.show("NRestarts")["NRestarts"]
        mark = s.cursor()
        first = wait("a tick", s.status_tick)
        wait("two more ticks of the same agent",
             lambda: (s.status_tick() or 0) >= first + 2 or s.main_pid() != pid,
             timeout=4 * INTERVAL_S + WAIT_S)  # fmt: skip
        assert s.main_pid() == pid, s.manager_says(mark)
        assert s.show("NRestarts")["NRestarts"] == before
        assert not [m for m in s.manager_says(mark) if "Watchdog timeout" in m]
    finally:
        s.dropin("70-test-watchdog", None)
        s.systemctl("stop", SERVICE)


def test_metrics_need_the_drop_in_which_validate_names_and_with_it_the_endpoint_answers(
    service: Service,
) -> None:
    """13.3: with agent.metrics.listen set, the shipped unit (no network) fails at once in
    ExecStartPre=, in one line naming the drop-in, and no agent runs; with
    nodeagent.service.d/metrics.conf installed the endpoint answers."""
    s = service
    s.systemctl("stop", SERVICE)
    s.write_policy(policy("0.2", agent=f"  metrics:\n    listen: 127.0.0.1:{METRICS_PORT}\n"))
    before = s.show("ExecMainStartTimestampMonotonic")
    mark = s.cursor()
    refused = s.host.run("systemctl", "start", SERVICE, check=False, timeout=WAIT_S)
    try:
        assert refused.returncode != 0
        assert s.show("ExecMainStartTimestampMonotonic") == before  # the agent never ran
        said = [str(e.get("MESSAGE")) for e in s.entries(mark)]
        line = (
            f"{POLICY}: agent.metrics.listen 127.0.0.1:{METRICS_PORT}:"
            " this process may not open AF_INET sockets"
        )
        assert [m for m in said if m.startswith(line) and "metrics.conf" in m], said
        assert _errors(s, re.escape(line))
    finally:
        s.systemctl("stop", SERVICE)
        s.systemctl("reset-failed", SERVICE, check=False)

    install_units(s.host, metrics=True)
    try:
        s.start()
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"

        def scrape() -> str:
            try:
                with urllib.request.urlopen(url, timeout=30) as answer:
                    return str(answer.read().decode())
            except OSError:
                return ""

        body = wait(
            f"{url} to answer with a tick",
            lambda: b if "nodeagent_ticks_total" in (b := scrape()) else None,
        )
        assert re.search(r'^nodeagent_ticks_total\{result="ok"\} [1-9]', body, re.M), body[:2000]
    finally:
        s.systemctl("stop", SERVICE)
        install_units(s.host)
        s.write_policy(GOOD)


FLOOD_GROUP = 4242  # the API socket's group: no user of the node has it
NOBODY = 65534
FLOODS = {"metrics": 800, "api": 200}
FLOOD_TICKS, FLOOD_AT_LEAST_S, FLOOD_CEILING_S = 30, 20.0, 600.0


def _agent_process(s: Service) -> int:
    """The agent's PID as the VM numbers it (its unit's cgroup holds it alone)."""
    procs = read(s.host.outer(f"/{CGROUP}"), "cgroup.procs").split()
    assert len(procs) == 1, procs
    return int(procs[0])


@pytest.mark.nightly
@pytest.mark.timeout(900)
def test_floods_from_a_member_and_a_stranger_leave_the_agent_under_its_unit_ticking(
    service: Service,
    capsys: pytest.CaptureFixture[str],
    record_testsuite_property: Callable[[str, object], None],
) -> None:
    """12.16 and 12.18 under the real systemd: the agent started from the shipped unit (its
    LimitNOFILE=, CPUWeight=, MemoryMin=, sandbox, and the metrics drop-in), the API socket's
    group set. uid 65534 with that group keeps 200 connections open to the API socket (through
    the unit's RuntimeDirectory=, which the agent gives the socket's group), and without it 800
    to the metrics endpoint, reconnecting for every one cut. Throughout, root's calls (the CLI's
    5 s deadline) are all answered, the ticks keep coming, the agent holds few descriptors."""
    s = service
    s.systemctl("stop", SERVICE)
    install_units(s.host, metrics=True)
    s.write_policy(
        policy(
            "0.2",
            agent=(
                f'  interval: 200ms\n  socket_group: "{FLOOD_GROUP}"\n'
                f"  metrics:\n    listen: 127.0.0.1:{METRICS_PORT}\n"
            ),
        )
    )
    try:
        s.start()
        pid = s.main_pid()
        agent = _agent_process(s)
        directory = s.host.path("/run/nodeagent").stat()
        assert (directory.st_gid, directory.st_mode & 0o777) == (FLOOD_GROUP, 0o750)
        sock = str(s.host.path(SOCKET))  # root's way in: /proc/PID/root of systemd's namespace
        # uid 65534 may not walk /proc/PID/root: its flooder goes to the socket's directory first
        run = str(s.host.path(SOCKET).parent)
        limits = Path(f"/proc/{agent}/limits").read_text().splitlines()
        nofile = next(line for line in limits if line.startswith("Max open files")).split()[3:5]
        assert nofile == ["8192", "8192"], nofile  # the unit's LimitNOFILE=

        def tick() -> int:
            status = calls.call(sock, "/v1/status")
            return int(status["tick"] or 0) if isinstance(status, dict) else -1

        mark = s.cursor()
        calls = Calls()
        with (
            Flood(("127.0.0.1", METRICS_PORT), FLOODS["metrics"], NOBODY) as metrics,
            Flood(Path(SOCKET).name, FLOODS["api"], NOBODY, (FLOOD_GROUP,), run) as api,
        ):
            wait("the metrics flood to open its connections", metrics.opened_all)
            wait("the API flood, a member of the group, to open its connections", api.opened_all)
            t0, first, seen, fds = time.monotonic(), tick(), 0, 0
            while seen < FLOOD_TICKS or time.monotonic() - t0 < FLOOD_AT_LEAST_S:
                assert time.monotonic() - t0 < FLOOD_CEILING_S, f"{seen} ticks in the flood"
                calls.call(sock, "/v1/allocations")
                seen = max(seen, tick() - first)
                fds = max(fds, len(os.listdir(f"/proc/{agent}/fd")))
                time.sleep(0.2)
            seconds = time.monotonic() - t0
            url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=60) as answer:
                scraped = int(answer.status)
            flooders = {"metrics": dict(metrics.latest), "api": dict(api.latest)}
            held = {"metrics": metrics.most_open, "api": api.most_open}
        figures = {
            "under": f"{SERVICE} (the real systemd)",
            "limit_nofile": nofile[0],
            "connections_held": held,
            "flooders": flooders,
            "ticks": seen,
            "seconds": round(seconds, 1),
            "ticks_per_s": round(seen / seconds, 2),
            "most_fds": fds,
            "root": calls.figures(),
            "scrape_during": scraped,
        }
        record_testsuite_property("floods_under_the_unit", json.dumps(figures))
        with capsys.disabled():
            print("\nfloods under the unit:", json.dumps(figures))
        assert calls.failed == [], calls.failed[:5]  # root answered within 5 s, every time
        assert seen >= FLOOD_TICKS and scraped == 200
        assert s.main_pid() == pid and s.active_state() == "active"  # never restarted
        for name, figure in flooders.items():
            assert figure.get("failed") == 0 and figure["cut"] > FLOODS[name], (name, figure)
        assert fds < 150
        failed = [e for e in s.events(mark) if str(e.get("event")).endswith("failed")]
        assert failed == [], failed[:5]  # no tick.failed, no accept_failed
    finally:
        s.systemctl("stop", SERVICE)
        install_units(s.host)
        s.write_policy(GOOD)


PROTECTION = f"""\
version: 1
agent:
  managed_root: {MANAGED}
fair_share:
  active_threshold: 0
tenants:
  research:
    shares: 1
classes:
  batch:
    floor_cpu: 1.5
protection:
  step: 0.5
  calm_ticks: 2
  freeze_after: 2
rules:
  - name: inference
    match:
      path: {MANAGED}/infer-*
    tenant: research
    class: inference
  - name: victim
    match:
      path: system.slice/docker-*.scope
    tenant: research
    class: batch
    limits:
      cpu_max: 1.8
"""


def test_a_stop_hands_back_what_protection_froze_and_capped_and_a_restart_does_not(
    service: Service,
) -> None:
    """13.4: a container outside the agent's subtree (a docker scope systemd owns), capped by its
    rule and frozen by the protection controller while inference stalls: `systemctl restart`
    keeps it so for the next agent (ExecStopPost='s release sees the restart job); `systemctl
    stop` hands both back through systemd (thawed, uncapped), its processes still running."""
    s = service
    s.systemctl("stop", SERVICE)
    unit = f"docker-{os.urandom(32).hex()}.scope"
    victim = s.host.outer(f"/system.slice/{unit}")
    busy = (
        "(while :; do :; done) </dev/null >/dev/null 2>&1 & sleep 3600 </dev/null >/dev/null 2>&1 &"
    )
    s.host.run("systemd-run", "--scope", f"--unit={unit}", "--slice=system.slice", "sh", "-c", busy)
    try:
        victims = read(victim, "cgroup.procs").split()
        assert len(victims) == 2
        s.ensure_running(PROTECTION)
        with s.busy_workload("infer-1", loops=3):
            wait("the protection controller to freeze the docker scope",
                 lambda: read(victim, "cgroup.freeze") == "1")  # fmt: skip
            capped = cpu_max(victim)
            assert capped != "max 100000"
            assert s.show_unit(unit, "FreezerState") == "frozen"  # through systemd: FreezeUnit

            mark = s.cursor()
            pid = s.restart(s.main_pid())
            said = [str(e.get("MESSAGE")) for e in s.entries(mark)]
            assert [
                m
                for m in said
                if m.startswith(f"nodeagent release: {SERVICE}: a restart is queued")
            ], said
            assert not [m for m in said if m.startswith("released ")], said
            assert read(victim, "cgroup.freeze") == "1"  # kept for the next agent ...
            assert cpu_max(victim) != "max 100000"
            wait("a tick of the new agent", lambda: (s.status_tick() or 0) >= 2)
            assert read(victim, "cgroup.freeze") == "1"  # ... which keeps it frozen
            assert s.main_pid() == pid

            mark = s.cursor()
            s.host.run("systemctl", "stop", SERVICE, timeout=WAIT_S)
            said = [str(e.get("MESSAGE")) for e in s.entries(mark)]
            assert read(victim, "cgroup.freeze") == "0", said
            assert cpu_max(victim) == "max 100000", said
            assert s.show_unit(unit, "FreezerState") == "running"
            quota = s.show_unit(unit, "CPUQuotaPerSecUSec")
            assert quota == "infinity", f"a daemon-reload would bring the cap back: {quota}"
            released = [m for m in said if m.startswith("released ") and unit in m]
            assert {m.split()[2] for m in released} >= {"cgroup.freeze", "cpu.max"}, said
            assert all(s.alive(int(p)) for p in victims)  # thawed, never killed
            saved = state.load(str(s.host.path(STATE)))
            assert saved is not None and unit not in str(saved.originals)
            assert "protection" not in saved.carry
            s.host.run("systemctl", "daemon-reload")
            assert cpu_max(victim) == "max 100000"  # systemd's own value is the original now
    finally:
        s.systemctl("stop", unit, check=False)
        s.write_policy(GOOD)


def test_stop_leaves_the_state_file_whole_and_the_workloads_running(
    service: Service, record_testsuite_property: Callable[[str, object], None]
) -> None:
    s = service
    s.ensure_running()
    with s.busy_workload("train-history") as workload:
        wait("the rule's cpu.max", lambda: cpu_max(workload) == "20000 100000")
        usage = wait(
            "usage history for the tenant",
            lambda: s.allocations()["tenant_usage"].get("research", 0.0),
        )
        mark = s.cursor()
        asked, t0 = time.time(), time.monotonic()
        s.host.run("systemctl", "stop", SERVICE, timeout=WAIT_S)
        took = time.monotonic() - t0
        record_testsuite_property("nodeagent.service systemctl stop (s)", f"{took:.1f}")
        # the workload is not the agent's unit's: it runs on, and its cap is handed back
        assert read(workload, "cgroup.procs").split()
        assert cpu_max(workload) == "max 100000"
        assert s.show_unit(WORKLOADS, "ActiveState") == "active"
    assert s.active_state() == "inactive"
    # it ended by itself on SIGTERM, in time: not killed after TimeoutStopSec
    stopping = s.event(mark, "stopping")
    assert stopping is not None and stopping["signal"] == "SIGTERM"
    said = s.manager_says(mark)
    assert [m for m in said if m.endswith(": Deactivated successfully.")], said
    assert not [m for m in said if "SIGKILL" in m or "timed out" in m], said
    saved = state.load(str(s.host.path(STATE)), tenants={"research"})
    assert saved is not None
    assert saved.saved_at >= asked  # written as it stopped
    assert saved.tenant_usage["research"] >= usage
    leftovers = [p.name for p in s.host.path(STATE).parent.iterdir() if p.name != "state.json"]
    assert leftovers == []  # no temp file left behind
