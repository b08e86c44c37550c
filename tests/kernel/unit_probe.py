"""Run as nodeagent.service's ExecStart (by test_systemd_unit.py): inside the unit's sandbox, try
what the agent needs and what the sandbox must refuse; print one JSON object of outcomes.

Each outcome is "ok" or the error's name (e.g. "EROFS"), so the test can say which one broke.
Environment: SCOPE, a systemd-owned scope's cgroup directory to write (as the agent will).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def own_cgroup() -> Path:
    return CGROUP / Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1].lstrip("/")


def child_cgroup() -> None:
    child = own_cgroup() / "probe"
    child.mkdir()
    child.rmdir()


def scope_weight() -> None:
    (Path(os.environ["SCOPE"]) / "cpu.weight").write_text("300")


def runtime_socket_file() -> None:
    path = Path("/run/nodeagent/probe")
    path.write_text("x")
    os.chmod(path, 0o660)
    os.chown(path, -1, 100)  # another group, as agent.socket_group does: CAP_CHOWN
    path.unlink()


def state_file() -> None:
    tmp, path = Path("/var/lib/nodeagent/state.tmp"), Path("/var/lib/nodeagent/state.json")
    tmp.write_text("{}")
    os.replace(tmp, path)
    path.unlink()


def other_users_process() -> None:
    for status in Path("/proc").glob("[0-9]*/status"):
        uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        if uids.split()[1] != "0":  # the file's owner is root for processes that changed uid
            (status.parent / "cgroup").read_text()
            return
    raise FileNotFoundError(errno.ENOENT, "no process of another user")


def dbus(bus_address: str, via: str) -> Callable[[], object]:
    def call() -> None:
        from nodeagent.sdbus import Systemd

        with Systemd(bus_address) as systemd:
            systemd.set_unit_properties(Path(os.environ["SCOPE"]).name, {"CPUWeight": 300})
            state = systemd.unit_property("nodeagent.service", "ActiveState")
            if state != "activating" or not str(systemd.via).startswith(via):
                raise RuntimeError(f"{state} on {systemd.via}")

    return call


def imports() -> None:
    """The agent's compiled dependencies load (MemoryDenyWriteExecute refuses W+X mappings)."""
    import inotify_simple
    import psutil
    import pydantic_core
    import pynvml
    import yaml

    psutil.cpu_times()
    assert inotify_simple and pydantic_core and pynvml and yaml


def journal_entries() -> None:
    """Native journal entries as the agent sends them: one in a datagram, one too large for
    any (4 MiB, passed as a sealed memfd: memfd_create, F_ADD_SEALS, SCM_RIGHTS)."""
    from nodeagent import journal

    sink = journal.Journal(journal.SOCKET)
    for size in (10, 4 << 20):
        fields = [("MESSAGE", "probe"), ("NODEAGENT_EVENT", "probe.journal")]
        sink.send(journal.encode([*fields, ("NODEAGENT_VALUE", "v" * size)]))
    sink.close()


NEEDS = {
    "import_dependencies": imports,
    "mkdir_in_own_cgroup": child_cgroup,
    "write_systemd_scope_cgroup": scope_weight,
    "run_dir_chmod_chown": runtime_socket_file,
    "state_dir_atomic_write": state_file,
    "read_proc_stat": lambda: Path("/proc/stat").read_text(),
    "read_other_users_proc": other_users_process,
    "dbus_system_bus": dbus("unix:path=/run/dbus/system_bus_socket", "the system bus"),
    "dbus_private_socket": dbus("unix:path=/nonexistent/bus", "systemd's private socket"),
    "journal_native_entries": journal_entries,
}
REFUSED = {
    "write_etc": lambda: Path("/etc/nodeagent-probe").write_text("x"),
    "write_kernel_tunable": lambda: Path("/proc/sys/kernel/domainname").write_text("x"),
    "inet_socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
    "sched_setaffinity": lambda: os.sched_setaffinity(0, {0}),
    "setuid": lambda: os.setuid(65534),
}

print(json.dumps({name: attempt(action) for name, action in {**NEEDS, **REFUSED}.items()}))
