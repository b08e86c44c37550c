"""memory.max is never set below usage, for a cgroup systemd owns too (issue 33 item 2).

A scope systemd owns is written through its unit's properties first, all of them at once
(systemd re-applies the unit's whole controller from them), so the guard that holds back a
memory.max below usage must hold back MemoryMax as well: the property keeps the kernel's
value while usage is above the target, memory.high (MemoryHigh) takes the target meanwhile,
and MemoryMax follows once the usage fits. Under the VM's real systemd, over D-Bus.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from helpers import hog_memory, read, spec, wait_for
from structlog.testing import capture_logs
from systemd_host import SystemdHost

from nodeagent.act import Outcome
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.unitprops import UINT64_MAX
from nodeagent.cgroupfs.values import Attribute
from nodeagent.daemon import open_agent
from nodeagent.sdbus import Systemd

MIB = 1 << 20
HOG_MIB = 64
TARGET = 32 * MIB
SETTLE_S = 60.0  # ceiling for the hog's pages to be charged, and freed once it is killed


def memory_max(host: SystemdHost, unit: str) -> int:
    """The unit's MemoryMax property, in bytes (infinity: UINT64_MAX)."""
    shown = host.systemctl("show", unit, "-p", "MemoryMax", "--value").stdout.strip()
    return UINT64_MAX if shown == "infinity" else int(shown)


def limit_bytes(text: str) -> int:
    return UINT64_MAX if text == "max" else int(text)


def oom_kills(scope: Path) -> int:
    events = dict(line.split() for line in read(scope, "memory.events").splitlines())
    return int(events["oom_kill"])


def test_memory_max_of_a_systemd_scope_never_goes_below_its_usage(
    systemd_host: SystemdHost, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A docker scope using 64 MiB, a rule capping it at 32 MiB: the properties set over
    D-Bus keep MemoryMax at the kernel's value (infinity) and give MemoryHigh the target;
    memory.max's write is reported unreachable; a daemon-reload (systemd re-applying the
    properties) and further ticks change none of it, and nothing is OOM-killed. Once the hog
    is gone, MemoryMax and memory.max take the target."""
    host = systemd_host
    unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(unit)
    try:
        # the memory controller for the scope, so that the hog's pages are charged to it
        host.systemctl("set-property", "--runtime", unit, "MemoryMax=infinity")
        assert (scope / "memory.current").exists(), "systemd enabled memory for the scope"
        hog = hog_memory(scope, HOG_MIB)
        procs.append(hog)
        assert wait_for(lambda: int(read(scope, "memory.current")) > 60 * MIB, SETTLE_S), (
            f"the hog's {HOG_MIB} MiB charged to the scope: {read(scope, 'memory.current')}"
        )
        policy = spec(
            "nodeagent.slice",
            tmp_path,
            fair_share={"active_threshold": 0},
            tenants={"a": {"shares": 1}},
            rules=[{"name": "docker", "match": {"runtime": "docker"}, "tenant": "a",
                    "limits": {"memory_max": f"{TARGET // MIB}Mi"}}],
        )  # fmt: skip
        agent = open_agent(policy, CgroupTree(str(host.cgroup)))
        agent.rec.executor.units = Systemd(bus_address=host.system_bus_address, timeout=30)
        agent.prepare()

        def never_below_usage(when: str) -> None:
            usage = int(read(scope, "memory.current"))
            assert usage > TARGET, f"{when}: the hog still holds its memory ({usage})"
            assert memory_max(host, unit) >= usage, f"{when}: MemoryMax below usage {usage}"
            assert limit_bytes(read(scope, "memory.max")) >= usage, (
                f"{when}: memory.max {read(scope, 'memory.max')} below usage {usage}"
            )
            assert read(scope, "memory.high") == str(TARGET), f"{when}: memory.high holds it"
            assert hog.poll() is None and oom_kills(scope) == 0, f"{when}: OOM-killed"

        with capture_logs() as logs:
            first = agent.tick()
        given = [e["properties"] for e in logs if e["event"] == "systemd.set_properties"]
        assert given and all(p["MemoryMax"] == UINT64_MAX for p in given), (
            f"MemoryMax kept at the kernel's value, not the target: {given}"
        )
        assert all(p["MemoryHigh"] == TARGET for p in given), given
        mine = {r.attribute: r for r in first.results if r.path.endswith(unit)}
        assert mine[Attribute.MEMORY_MAX].outcome is Outcome.UNREACHABLE, mine
        assert "memory.max waits for reclaim" in mine[Attribute.MEMORY_MAX].detail
        never_below_usage("after the first tick")

        host.systemctl("daemon-reload")  # systemd writes every property of the unit again
        never_below_usage("after a daemon-reload")
        for i in range(3):
            record = agent.tick()
            mine = {r.attribute: r for r in record.results if r.path.endswith(unit)}
            assert Attribute.MEMORY_MAX not in mine or (
                mine[Attribute.MEMORY_MAX].outcome is Outcome.UNREACHABLE
            ), mine
            never_below_usage(f"after tick {i + 2}")

        hog.kill()
        hog.wait()
        assert wait_for(lambda: int(read(scope, "memory.current")) < TARGET, SETTLE_S), (
            f"the scope's usage fell below the target: {read(scope, 'memory.current')}"
        )
        agent.tick()
        assert memory_max(host, unit) == TARGET, "the write waited, then landed"
        assert read(scope, "memory.max") == str(TARGET)
    finally:
        host.systemctl("stop", unit, check=False)
