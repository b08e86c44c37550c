"""The agent manages a container scope that systemd owns, as runc does: unit properties
over D-Bus first, then the files; the values survive `systemctl daemon-reload`, and a
property another tool changes is put back within one tick, with an audit record."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from helpers import read, spec
from systemd_host import SystemdHost

from nodeagent.act import Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute
from nodeagent.daemon import Agent
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
        agent = Agent(policy, CgroupTree(str(host.cgroup)))
        agent.systemd = Systemd(bus_address=host.system_bus_address, timeout=30)
        agent.executor.units = agent.systemd
        writes: list[tuple[str, str | None, str]] = []
        agent.executor.audit = lambda path, attr, old, new, reason: writes.append((attr, old, new))
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
