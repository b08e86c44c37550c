"""A real systemd for the kernel tests: PID 1 of its own PID, mount and cgroup namespaces in the VM.

The VM's own init is not systemd, so the tests boot one beside the other tests, the way a container
runtime boots systemd in a container (``container=other``):

- **cgroups**: systemd runs in a cgroup namespace rooted at ``/sys/fs/cgroup/<name>`` of the VM,
  with a cgroup2 mount of its own, so what it calls ``/system.slice/x.scope`` is
  ``/sys/fs/cgroup/<name>/system.slice/x.scope`` here (:meth:`SystemdHost.outer`,
  :meth:`SystemdHost.inner`). It never touches the rest of the VM's hierarchy.
- **units**: only an allow-list of the host's unit files (targets, D-Bus, journald) plus the
  harness's own; generators are hidden and ``/etc/systemd/system`` is an empty tmpfs where tests
  install units as an operator would. With the host's full unit set, boot waits on units that
  cannot start here (issue 8: it stayed ``initializing``), and the host's ``/etc`` enablements
  (gettys, timers, postgresql, ...) would start too.
- **/run and /tmp** are its own tmpfs: the system bus socket and ``/run/systemd/private`` exist
  only in its mount namespace. A checkout under the VM's /tmp (a fresh clone) stays visible at
  its own path there (it is moved into the new /tmp), and units with ``PrivateTmp=yes`` get it
  through :func:`checkout_binding`. From the VM they are reachable through ``/proc/<pid>/root/...``
  (:attr:`SystemdHost.system_bus_address`), but systemd refuses private-socket clients outside its
  PID namespace (their peer PID reads as 0): code that must use the private socket runs inside,
  through :meth:`SystemdHost.run` / :meth:`SystemdHost.python` (``nsenter -p -m -C``).

Every wait has a deadline; a boot that fails raises :class:`SystemdHostError` with a one-line
reason followed by the journal's tail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from conftest import (
    CGROUP_ROOT,
    REQUIRED_CONTROLLERS,
    enable_controllers,
    new_sandbox_path,
    remove_cgroup_tree,
)

HOST_UNIT_DIR = Path("/usr/lib/systemd/system")
# The host's units this systemd may load (Debian 12 paths; `systemd` and `dbus` packages).
HOST_UNITS = (
    "basic.target",
    "sysinit.target",
    "sockets.target",
    "paths.target",
    "timers.target",
    "slices.target",
    "local-fs.target",
    "swap.target",
    "shutdown.target",
    "multi-user.target",
    "dbus.socket",
    "dbus.service",
    "systemd-journald.service",
    "systemd-journald.socket",
    "systemd-journald-dev-log.socket",
)
# What each target pulls in (the host's own .wants directories are hidden with its unit dir).
WANTS = {
    "sockets.target": ("dbus.socket", "systemd-journald.socket", "systemd-journald-dev-log.socket"),
    "sysinit.target": ("systemd-journald.service",),
    "multi-user.target": ("dbus.service",),
}
# Stops every unit (they all conflict with shutdown.target), then exits, leaving mounts alone:
# systemd-exit.service would also pull umount.target, which unmounts every mount in the
# namespace one by one (25 s under TCG) for nothing.
EXIT_SERVICE = "nodeagent-harness-exit.service"
HARNESS_UNITS = {
    EXIT_SERVICE: """\
[Unit]
Description=Exit the nodeagent test systemd after stopping every unit
DefaultDependencies=no
Requires=shutdown.target
After=shutdown.target
SuccessAction=exit-force

[Service]
Type=oneshot
ExecStart=/bin/true
""",
}
JOURNALD_CONF = "[Journal]\nStorage=volatile\nReadKMsg=no\n"

# Runs as PID 1 of the new PID namespace, in the new mount and cgroup namespaces (bash -c, $1 is
# the control directory). It waits until the harness has moved the `unshare` parent out of the
# namespace's root cgroup: systemd cannot enable controllers for its children while a process
# sits in the root of its namespace (the kernel's no-internal-processes rule).
STAGE2 = r"""
set -eu
ctl=$1
: > "$ctl/forked"
i=0
until [ -e "$ctl/go" ]; do
  i=$((i + 1)); [ "$i" -lt 600 ] || { echo "the harness never let systemd start" >&2; exit 1; }
  sleep 0.05
done
mount --make-rprivate /
mount -t proc proc /proc
umount /sys/fs/cgroup  # a new cgroup2 mount is rooted at this namespace's root cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount --bind "$ctl/units" /usr/lib/systemd/system
mount -t tmpfs -o mode=0755 tmpfs /usr/lib/systemd/system-generators
mount -t tmpfs -o mode=0755 tmpfs /usr/lib/systemd/system-environment-generators
mount -t tmpfs -o mode=0755 tmpfs /etc/systemd/system
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/systemd/journald.conf.d
cp "$ctl/journald.conf" /run/systemd/journald.conf.d/nodeagent-harness.conf
# its own /tmp hides $ctl, which is in the VM's /tmp, and would hide a checkout there ($2) with
# its venv: that one is moved into the new /tmp at the same path
case $2 in /tmp/?*) keep=/run/nodeagent-harness-checkout ;; *) keep= ;; esac
[ -z "$keep" ] || { mkdir "$keep" && mount --rbind "$2" "$keep"; }
mount -t tmpfs -o mode=1777 tmpfs /tmp
[ -z "$keep" ] || { mkdir -p "$2" && mount --move "$keep" "$2" && rmdir "$keep"; }
exec env -i container=other PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  /lib/systemd/systemd --system --unit=multi-user.target --show-status=false \
  --log-target=journal-or-kmsg --log-level=info
"""

CHECKOUT = Path(__file__).resolve().parents[2]
"""This checkout, its .venv included: the same path inside as outside, wherever it is."""


def checkout_binding() -> str:
    """Lines for a test drop-in of a unit with PrivateTmp=yes, which gets a /tmp of its own:
    a checkout under /tmp (a fresh clone, CI) is bound into it read-only at its path."""
    return f"BindReadOnlyPaths={CHECKOUT}\n" if CHECKOUT.is_relative_to("/tmp") else ""


BOOT_TIMEOUT_S = float(os.environ.get("NODEAGENT_SYSTEMD_BOOT_TIMEOUT", "240"))
STOP_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 120.0  # generous: under TCG on a busy host, Python starts slowly
JOURNAL_LINES = 25


LEVELS = {"7": "debug", "6": "info", "4": "warning", "3": "error", "2": "critical"}
"""Log levels by the syslog priority nodeagent's journal entries carry (nodeagent.journal)."""


def agent_record(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """One of the agent's journal entries (`journalctl -o json`) as the record it logged:
    {"event", "level", field: value} from NODEAGENT_EVENT, PRIORITY and the NODEAGENT_<KEY>
    fields, values as the journal keeps them (text; what was not a string, as JSON). None
    for an entry that is not one of the agent's records (systemd's, validate's text)."""
    if "NODEAGENT_EVENT" not in entry:
        return None
    record: dict[str, Any] = {"level": LEVELS.get(str(entry.get("PRIORITY")), "info")}
    for name, value in entry.items():
        if name.startswith("NODEAGENT_"):
            record[name.removeprefix("NODEAGENT_").lower()] = value
    return record


class SystemdHostError(AssertionError):
    """The test systemd failed: one line of reason, then the journal's tail."""


class SystemdHost:
    """A booted systemd. Use :func:`boot`; :meth:`stop` exits it and removes its cgroup."""

    def __init__(self, cgroup: Path, ctl: Path, launcher: subprocess.Popen[bytes]) -> None:
        self.cgroup = cgroup  # its "/" in the VM's /sys/fs/cgroup
        self.ctl = ctl
        self.launcher = launcher
        self.pid = 0  # its PID 1, as the VM sees it
        self.boot_seconds = 0.0
        self.stop_seconds = 0.0

    # -- where things are -------------------------------------------------------------------------

    def outer(self, inner: str) -> Path:
        """The VM's path of the cgroup systemd calls `inner` (``/system.slice/x.scope``)."""
        return self.cgroup / inner.strip("/")

    def inner(self, outer: Path | str) -> str:
        """systemd's name (``/system.slice/x.scope``) of the VM's cgroup directory `outer`."""
        relative = Path(outer).relative_to(self.cgroup)
        return "/" + str(relative) if str(relative) != "." else "/"

    def path(self, inside: str) -> Path:
        """A file of its mount namespace, seen from the VM (``/proc/<pid>/root/...``)."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    @property
    def system_bus_address(self) -> str:
        """D-Bus address of its system bus, usable from the VM (outside its namespaces)."""
        return f"unix:path={self.path('/run/dbus/system_bus_socket')}"

    @property
    def _nsenter(self) -> list[str]:
        # its PID, mount and cgroup namespaces (not its cgroup: the command stays in the caller's)
        return ["nsenter", "-t", str(self.pid), "-p", "-m", "-C", "--"]

    # -- commands ---------------------------------------------------------------------------------

    def run(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = COMMAND_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv in its namespaces, seeing the system as systemd's own services see it."""
        command = [*self._nsenter, *argv]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise self.failure(f"{' '.join(argv)!r} did not finish in {timeout:.0f} s") from exc
        if check and done.returncode != 0:
            output = (done.stdout + done.stderr).strip().replace("\n", " | ")
            raise self.failure(f"{' '.join(argv)!r} exited {done.returncode}: {output}")
        return done

    def python(self, code: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run Python `code` inside (this venv, so nodeagent imports); returns its stdout."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
        return self.run(sys.executable, "-c", code, timeout=timeout, env=env).stdout

    @contextlib.contextmanager
    def job_client(self, argv: Sequence[str], job: Path) -> Iterator[subprocess.Popen[str]]:
        """`argv` (a `nodeagent exec ... -- sleep infinity`) inside its namespaces, from a
        cgroup of its own inside its tree, as a shell of that host would run it (not from this
        process's cgroup, outside its cgroup namespace, which earlier tests may have moved:
        the agent may not move a process in from there); output on its stdout. The job ends
        when the test ends it, or at the end (`job`'s cgroup.kill): a `sleep 600` ended on its
        own under the 900 s ceiling when a busy host made a test slow, and then read as a job
        that died with the agent."""
        clients = self.outer("/nodeagent-test-clients")
        clients.mkdir(exist_ok=True)
        enter = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(clients)]
        cli = subprocess.Popen(
            [*enter, *self._nsenter, *argv],
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            yield cli
        finally:
            if cli.poll() is None:  # the test failed before the job ended: kill it
                with contextlib.suppress(OSError):
                    (job / "cgroup.kill").write_text("1")
                try:
                    cli.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    cli.kill()
                    cli.communicate()
            with contextlib.suppress(OSError):  # empty once the CLI is gone
                clients.rmdir()

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check)

    def start_scope(self, unit: str, slice_: str = "system.slice") -> Path:
        """Transient scope `unit` holding one sleeping process (systemd-run); its VM cgroup."""
        idle = "sleep 3600 >/dev/null 2>&1 &"
        self.run("systemd-run", "--scope", f"--unit={unit}", f"--slice={slice_}", "sh", "-c", idle)
        return self.outer(f"/{slice_}/{unit}")

    def journal_tail(self, lines: int = JOURNAL_LINES) -> str:
        """The last lines of its journal, or why there are none (never raises, never hangs)."""
        if not self.pid or self.launcher.poll() is not None:
            return self._launcher_log(lines)
        command = [*self._nsenter, "journalctl", "--no-pager"]
        command += ["-o", "short-monotonic", "-n", str(lines)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
        except subprocess.TimeoutExpired:
            return "(journalctl did not answer in 20 s)\n" + self._launcher_log(lines)
        if done.returncode != 0 or not done.stdout.strip():
            return f"(no journal: {done.stderr.strip()})\n" + self._launcher_log(lines)
        return done.stdout

    def failure(self, reason: str) -> SystemdHostError:
        tail = self.journal_tail()
        return SystemdHostError(f"test systemd: {reason}\n--- journal tail ---\n{tail}")

    def _launcher_log(self, lines: int) -> str:
        try:
            text = (self.ctl / "launcher.log").read_text(errors="replace")
        except OSError as exc:
            return f"(no launcher log: {exc})"
        return "launcher: " + "\n".join(text.splitlines()[-lines:])

    # -- life cycle -------------------------------------------------------------------------------

    def _wait(self, what: str, done: Callable[[], bool], deadline: float) -> None:
        while not done():
            if self.launcher.poll() is not None:
                raise self.failure(f"exited ({self.launcher.returncode}) while {what}")
            if time.monotonic() > deadline:
                raise self.failure(f"timed out after {BOOT_TIMEOUT_S:.0f} s {what}")
            time.sleep(0.05)

    def _start(self, t0: float) -> None:
        deadline = t0 + BOOT_TIMEOUT_S
        self._wait("forking", (self.ctl / "forked").exists, deadline)
        # out of the namespace's root cgroup, into the one this process is in
        own = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        (CGROUP_ROOT / own.lstrip("/") / "cgroup.procs").write_text(str(self.launcher.pid))
        children = Path(f"/proc/{self.launcher.pid}/task/{self.launcher.pid}/children")
        self.pid = int(children.read_text().split()[0])
        (self.ctl / "go").touch()
        private = self.path("/run/systemd/private")
        self._wait("starting its manager (no /run/systemd/private)", private.exists, deadline)
        remaining = max(1.0, deadline - time.monotonic())
        state = self.run("systemctl", "is-system-running", "--wait", check=False, timeout=remaining)
        if state.stdout.strip() != "running":
            failed = self.systemctl("--failed", "--plain", "--no-legend", check=False).stdout
            failed = " ".join(line.split()[0] for line in failed.splitlines() if line.strip())
            raise self.failure(
                f"boot ended {state.stdout.strip() or state.stderr.strip()!r}, "
                f"not 'running' (failed units: {failed or 'none'})"
            )
        self.boot_seconds = time.monotonic() - t0

    def stop(self) -> None:
        """Stop every unit and exit systemd, then remove its cgroup.

        Raises SystemdHostError, after cleaning up all the same, when systemd had to be killed.
        """
        problem = None
        if self.launcher.poll() is None:
            t0 = time.monotonic()
            try:
                if not self.pid:
                    raise self.failure("never started")
                self.systemctl(
                    "start", "--no-block", "--job-mode=replace-irreversibly", EXIT_SERVICE
                )
                self.launcher.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                jobs = self.systemctl("list-jobs", "--plain", "--no-legend", check=False).stdout
                jobs = " | ".join(line.strip() for line in jobs.splitlines()) or "none"
                problem = self.failure(f"did not exit in {STOP_TIMEOUT_S:.0f} s (jobs: {jobs})")
            except SystemdHostError as exc:
                problem = exc
            if problem is not None:
                self.launcher.kill()  # --kill-child takes PID 1, and so the namespace, with it
                self.launcher.wait(timeout=30)
            self.stop_seconds = time.monotonic() - t0
        if self.cgroup.exists():
            remove_cgroup_tree(self.cgroup)
        shutil.rmtree(self.ctl, ignore_errors=True)
        if problem is not None:
            raise problem


def boot(boot_units: Mapping[str, str] | None = None) -> SystemdHost:
    """Boot a systemd as described in the module docstring; waits until it is ``running``.

    `boot_units` (name: unit file text) are added and started at boot (multi-user.target wants
    them): for tests of the harness itself.
    """
    t0 = time.monotonic()
    # pids too, as a host's systemd has it: podman under this systemd asks crun for its pids
    # limit, and without pids enabled at the root (a cgroupfs runtime's start enables it there
    # as a side effect) `podman run` fails, "the requested cgroup controller `pids` is not
    # available" (the nightly tier, where no cgroupfs podman ran first)
    enable_controllers(CGROUP_ROOT, (*REQUIRED_CONTROLLERS, "pids"))
    cgroup = new_sandbox_path()
    ctl = Path(tempfile.mkdtemp(prefix="nodeagent-systemd-"))
    units = ctl / "units"
    units.mkdir()
    for name in HOST_UNITS:
        shutil.copy(HOST_UNIT_DIR / name, units / name)
    extra = dict(boot_units or {})
    for name, text in {**HARNESS_UNITS, **extra}.items():
        (units / name).write_text(text)
    wants = {**WANTS, "multi-user.target": (*WANTS["multi-user.target"], *extra)}
    for target, wanted in wants.items():
        (units / f"{target}.wants").mkdir()
        for name in wanted:
            (units / f"{target}.wants" / name).symlink_to(f"../{name}")
    (ctl / "journald.conf").write_text(JOURNALD_CONF)
    unshare = "unshare --pid --fork --mount --cgroup --kill-child --"
    enter = f'echo $$ > "$0" && exec {unshare} bash -c "$1" stage2 "$2" "$3"'
    with open(ctl / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(
            ["sh", "-c", enter, str(cgroup / "cgroup.procs"), STAGE2, str(ctl), str(CHECKOUT)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # a Ctrl-C of pytest must not reach PID 1 as SIGINT
        )
    host = SystemdHost(cgroup, ctl, launcher)
    try:
        host._start(t0)
    except BaseException:
        with contextlib.suppress(SystemdHostError):  # the boot's own failure is the one to show
            host.stop()
        raise
    return host
