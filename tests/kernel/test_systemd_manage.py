"""The agent manages a container scope that systemd owns, as runc does: unit properties
over D-Bus first, then the files; the values survive `systemctl daemon-reload`, and a
property another tool changes is put back within one tick, with an audit record. Only the
unit systemd says owns a cgroup is ever written: a user's delegated tree, and a cgroup
merely named like a unit, never reach the system manager's units of those names."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from helpers import read, sleeper, spec
from structlog.testing import capture_logs
from systemd_host import SystemdHost

from nodeagent.act import Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute
from nodeagent.daemon import open_agent
from nodeagent.report import allocations, explain, identities
from nodeagent.sdbus import Systemd

MIB = 1 << 20


def test_a_docker_scope_is_managed_through_systemd(
    systemd_host: SystemdHost, tmp_path: Path
) -> None:
    host = systemd_host
    unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(unit)
    try:
        policy = spec(
            "nodeagent.slice",
            tmp_path,
            agent={"resync_interval": 1},
            fair_share={"active_threshold": 0},
            tenants={"a": {"shares": 1}},
            rules=[{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a",
                    "limits": {"cpu_max": 0.333, "memory_max": "256Mi"}}],
        )  # fmt: skip
        agent = open_agent(policy, CgroupTree(str(host.cgroup)))
        agent.rec.executor.units = Systemd(bus_address=host.system_bus_address, timeout=30)
        writes: list[tuple[str, str | None, str]] = []
        agent.rec.executor.audit = lambda path, attr, old, new, reason: writes.append(
            (attr, old, new)
        )
        agent.prepare()

        record = agent.tick()
        mine = {r.attribute: r for r in record.results if r.path.endswith(unit)}
        assert mine[Attribute.CPU_MAX].outcome is Outcome.WRITTEN, mine
        assert read(scope, "cpu.max") == "34000 100000", "0.333 rounded up as systemd keeps it"
        assert read(scope, "memory.max") == str(256 * MIB)
        shown = host.systemctl("show", unit, "-p", "CPUQuotaPerSecUSec", "-p", "MemoryMax").stdout
        assert "CPUQuotaPerSecUSec=340ms" in shown and f"MemoryMax={256 * MIB}" in shown, shown
        assert agent.tick().results == (), "nothing left to write: file and property agree"

        host.systemctl("daemon-reload")
        assert read(scope, "cpu.max") == "34000 100000", "runtime properties survive a reload"
        assert read(scope, "memory.max") == str(256 * MIB)

        host.systemctl("set-property", "--runtime", unit, "CPUQuota=90%")  # someone else
        assert read(scope, "cpu.max") == "90000 100000"
        writes.clear()
        time.sleep(1.1)  # within a resync interval, each workload's settings are read again
        agent.tick()
        assert read(scope, "cpu.max") == "34000 100000", "put back within one interval"
        assert ("cpu.max", "90000 100000", "34000 100000") in writes, writes
        shown = host.systemctl("show", unit, "-p", "CPUQuotaPerSecUSec").stdout
        assert "CPUQuotaPerSecUSec=340ms" in shown
    finally:
        host.systemctl("stop", unit, check=False)


def test_a_scope_made_idle_gets_its_limits_and_stays_idle(
    systemd_host: SystemdHost, tmp_path: Path
) -> None:
    """CPUWeight=idle: systemd sets cpu.idle, the kernel then shows the weight as 0 and
    refuses another. The agent sets the scope's other properties and no CPUWeight (which
    would end the idleness), and finds nothing left to write at the next tick."""
    host = systemd_host
    unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(unit)
    try:
        host.systemctl("set-property", "--runtime", unit, "CPUWeight=idle")
        assert read(scope, "cpu.idle") == "1" and read(scope, "cpu.weight") == "0"
        policy = spec(
            "nodeagent.slice",
            tmp_path,
            fair_share={"active_threshold": 0},
            tenants={"a": {"shares": 1}},
            rules=[{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a",
                    "limits": {"memory_max": "256Mi"}}],
        )  # fmt: skip
        agent = open_agent(policy, CgroupTree(str(host.cgroup)))
        agent.rec.executor.units = Systemd(bus_address=host.system_bus_address, timeout=30)
        agent.prepare()
        record = agent.tick()
        assert not [s for s in record.snapshot.skipped if s.path.endswith(unit)]
        mine = [r for r in record.results if r.path.endswith(unit)]
        assert {r.attribute: r.outcome for r in mine}[Attribute.MEMORY_MAX] is Outcome.WRITTEN
        assert not [r for r in mine if r.outcome is Outcome.FAILED], mine
        assert read(scope, "memory.max") == str(256 * MIB)
        assert read(scope, "cpu.idle") == "1" and read(scope, "cpu.weight") == "0"
        assert not [r for r in agent.tick().results if r.path.endswith(unit)]
    finally:
        host.systemctl("stop", unit, check=False)


class RecordingSystemd(Systemd):
    """The real adapter, noting which unit each cgroup was given and what was written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units_given: list[tuple[str, str]] = []
        self.written: list[str] = []

    def unit_for_cgroup(self, cgroup: str) -> str:
        unit = super().unit_for_cgroup(cgroup)
        self.units_given.append((cgroup, unit))
        return unit

    def set_unit_properties(
        self, unit: str, properties: Mapping[str, int], *, runtime: bool = True
    ) -> None:
        self.written.append(unit)
        super().set_unit_properties(unit, properties, runtime=runtime)

    def freeze_unit(self, unit: str, frozen: bool) -> None:
        self.written.append(unit)
        super().freeze_unit(unit, frozen)


UNTOUCHED = ("CPUWeight", "CPUQuotaPerSecUSec", "MemoryMax")


def as_it_is(host: SystemdHost, unit: str, cgroup: Path) -> tuple[str, dict[str, str]]:
    """A unit's resource properties and its cgroup's files (those its controllers give it:
    one that appears later is a change too)."""
    shown = host.systemctl("show", unit, *(f"-p{p}" for p in UNTOUCHED)).stdout
    files = {n: read(cgroup, n) for n in ("cpu.weight", "cpu.max", "memory.max")
             if (cgroup / n).exists()}  # fmt: skip
    return shown, files


def test_names_in_a_users_delegated_tree_never_reach_the_system_managers_units(
    systemd_host: SystemdHost, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Issue 12 item 9, under the real systemd: a rootless-style tree below user@1000.service
    holds a libpod-<id>.scope named after a real rootful scope and a dbus.service named after
    the real one; system.slice holds a docker-<id>.scope made by hand, named after a real
    scope in another slice. None of those units is written, their properties and files stay
    as they were, and the hand-made one is refused with one line naming cgroup and unit.
    A real docker scope beside them is still written through its own unit."""
    host = systemd_host
    cid = secrets.token_hex(32)
    rootful = f"libpod-{cid}.scope"
    elsewhere = f"docker-{secrets.token_hex(32)}.scope"
    real_docker = f"docker-{secrets.token_hex(32)}.scope"
    user_manager = "/user.slice/user-1000.slice/user@1000.service"
    victims = {
        rootful: host.start_scope(rootful, "machine.slice"),
        elsewhere: host.start_scope(elsewhere, "other.slice"),
        "dbus.service": host.outer("/system.slice/dbus.service"),
    }
    real = host.start_scope(real_docker)
    # so that systemd gives system.slice's children the cpu and memory controllers
    host.systemctl("set-property", "--runtime", real_docker, "CPUWeight=100", "MemoryMax=infinity")
    # the system manager's user@1000.service, delegated, its process moved to init.scope as
    # a user manager moves itself; below it the user's own tree, made as that user would
    host.run("systemd-run", "--unit=user@1000.service", "--slice=user-1000.slice",
             "-p", "Delegate=yes", "sleep", "3600")  # fmt: skip
    manager_cg = host.outer(user_manager)
    made: list[Path] = []
    try:
        (manager_cg / "init.scope").mkdir()
        made.append(manager_cg / "init.scope")
        for pid in read(manager_cg, "cgroup.procs").split():
            (manager_cg / "init.scope" / "cgroup.procs").write_text(pid)
        rootless = manager_cg / "user.slice" / rootful
        user_dbus = manager_cg / "app.slice" / "dbus.service"
        hand_made = host.outer(f"/system.slice/{elsewhere}")
        for parent in (manager_cg, manager_cg / "user.slice", manager_cg / "app.slice"):
            if parent != manager_cg:
                parent.mkdir()
                made.append(parent)
            (parent / "cgroup.subtree_control").write_text("+cpu +memory")
        for leaf in (rootless, user_dbus, hand_made):
            leaf.mkdir()
            made.append(leaf)
            procs.append(sleeper(leaf))
        before = {u: as_it_is(host, u, cg) for u, cg in victims.items()}

        policy = spec(
            "nodeagent.slice",
            tmp_path,
            agent={"resync_interval": 1, "systemd": {"services": "write"}},
            fair_share={"active_threshold": 0},
            tenants={"a": {"shares": 1}, "b": {"shares": 3}},
            rules=[
                # a user's own cgroups match only a rule naming their owner (issue 34)
                {"name": "users", "match": {"path": "user.slice/*", "owner": "user-systemd"},
                 "tenant": "a", "limits": {"cpu_max": 0.333}},
                {"name": "hand-made", "match": {"path": f"system.slice/{elsewhere}"},
                 "tenant": "a", "limits": {"cpu_max": 0.333}},
                {"name": "docker", "match": {"path": f"system.slice/{real_docker}"},
                 "tenant": "b", "limits": {"cpu_max": 0.5}},
            ],
        )  # fmt: skip
        agent = open_agent(policy, CgroupTree(str(host.cgroup)))
        agent.rec.executor.units = RecordingSystemd(bus_address=host.system_bus_address, timeout=30)
        agent.prepare()
        with capture_logs() as logs:
            first = agent.tick()
            time.sleep(1.1)  # a resync: every file read again, every write tried again
            agent.tick()

        claimed = {host.inner(p)[1:] for p in (rootless, user_dbus, hand_made, real)}
        assert claimed <= {cg.path for cg in first.plan.cgroups}, "all four are claimed"
        assert not set(agent.rec.executor.units.written) & set(victims), (
            agent.rec.executor.units.written
        )
        after = {u: as_it_is(host, u, cg) for u, cg in victims.items()}
        assert after == before, "their properties and files are as they were"
        for (
            cgroup,
            unit,
        ) in agent.rec.executor.units.units_given:  # levels included (user.slice, ...)
            owns = host.systemctl("show", unit, "-p", "ControlGroup").stdout.strip()
            assert owns == f"ControlGroup=/{cgroup}", f"{unit} was given for {cgroup}"

        # the user's tree: read-only, with the reason, in explain
        rows = {r["cgroup"]: r for r in allocations(first)["allocations"]}
        for leaf in (rootless, user_dbus):
            row = rows[host.inner(leaf)[1:]]
            assert (row["owner"], row["write"]) == ("user-systemd", "read-only"), row
            shown = explain(first, next(i for i in identities(first) if i.path == row["cgroup"]))
            assert {w["outcome"] for w in shown["writes"]} == {"read-only"}, shown["writes"]
            assert all("below user@1000.service" in w["detail"] for w in shown["writes"])
            assert read(leaf, "cpu.max") == "max 100000", "not written directly either"
        # the hand-made one: refused once, by systemd's own answer
        refusals = [e for e in logs if e["event"] == "systemd.not_the_unit"]
        assert [(e["cgroup"], e["unit"]) for e in refusals] == [
            (host.inner(hand_made), "system.slice")
        ], refusals
        hand_rows = [r for r in first.results if r.path == host.inner(hand_made)[1:]]
        assert hand_rows and {r.outcome for r in hand_rows} == {Outcome.READ_ONLY}, hand_rows
        assert "inside unit system.slice, whose cgroup is /system.slice" in hand_rows[0].detail
        assert read(hand_made, "cpu.max") == "max 100000"
        # and the real docker scope, through its own unit
        assert read(real, "cpu.max") == "50000 100000"
        assert real_docker in agent.rec.executor.units.written
    finally:
        for p in procs:
            p.kill()
            p.wait()
        procs.clear()
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        for unit in (rootful, elsewhere, real_docker, "user@1000.service"):
            host.systemctl("stop", unit, check=False)
