"""A freeze never outlives the agent's claim (issue 33, defect 1), on a real kernel: a
workload the protection controller froze, and one frozen for a GPU violation (a simulated
node, a labelled fake from config/gpus/: no GPU here; the process and its cgroup are real),
are thawed once a reload's policy no longer claims them, each thaw an audit record (a
container scope systemd owns, through ThawUnit); after the loop stops and `nodeagent release
--all` runs (the unit's ExecStopPost=), nothing below the test's cgroup is left frozen.

The daemon's loop runs as `nodeagent run --config FILE` runs it, in the test's process (as
helpers.running does; a daemon of its own took more than 90 s to start under TCG on a shared
host), and reloads its file as SIGHUP has it do. On 645b2ad each workload stayed frozen after
the reload: the policies dropped a frozen cgroup that was not among the tick's workloads
without planning its thaw."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, busy, read, sleeper, spec, wait_for
from systemd_host import SystemdHost

from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.daemon import open_agent
from nodeagent.logs import audit_write
from nodeagent.policyfile.load import load_policy
from nodeagent.policyfile.model import PolicySpec
from nodeagent.sdbus import Systemd

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "config" / "gpus" / "4x-a100-two-nvlink-pairs.yaml"
WAIT_S = 90.0
"""Ceiling of each wait for the daemon (a tick is 0.5 s; Python under TCG on a shared host is
slow, and a freeze by protection takes several ticks of pressure)."""
THAWED = "thawed: no longer a workload the agent plans (unclaimed, or gone)"
RELEASED = "released: the value before nodeagent changed it"
INFER = {"name": "infer", "match": {"name": "i-*"}, "tenant": "t", "class": "inference"}
BATCH = {"name": "batch", "match": {"name": "b-*"}, "tenant": "t", "class": "batch"}
NOBODY = {"name": "nobody", "match": {"name": "nothing-*"}, "tenant": "t"}


class Agent:
    """The daemon's loop in this process, as `nodeagent run --config FILE` runs it (as
    helpers.running does, with the policy file it reloads): the test rewrites the file and
    asks for a reload as SIGHUP does (the handler only sets this flag)."""

    def __init__(self, tmp_path: Path, managed: str, base: Mapping[str, Any]) -> None:
        self.policy = tmp_path / "policy.yaml"
        self.managed, self.tmp, self.base = managed, tmp_path, base
        self.write(base)
        self.writes: list[tuple[str, str | None, str, str]] = []
        """(path, old, new, reason) of each audited cgroup write."""
        self.agent = open_agent(
            load_policy(str(self.policy)), CgroupTree(ROOT), config_path=str(self.policy)
        )
        self.agent.rec.executor.audit = self.audit
        self.agent.prepare()
        self.loop = threading.Thread(target=self.agent.run, daemon=True)
        self.loop.start()

    def audit(self, path: str, attribute: str, old: str | None, new: str, reason: str) -> None:
        self.writes.append((path, old, new, reason))
        audit_write(path, attribute, old, new, reason)

    def write(self, sections: Mapping[str, Any]) -> None:
        agent = {"interval": 0.5, "managed_root": self.managed,
                 "state_file": str(self.tmp / "state.json"),
                 "socket": str(self.tmp / "api.sock")}  # fmt: skip
        doc = {"version": 1, "tenants": {"t": {"shares": 1}}, **sections, "agent": agent}
        self.policy.write_text(json.dumps(doc))  # JSON is YAML

    def freezes(self, cgroup: Path) -> list[tuple[str | None, str, str]]:
        """The audit records of the agent's writes of cgroup's cgroup.freeze."""
        mine = str(cgroup / "cgroup.freeze")
        return [(old, new, why) for path, old, new, why in self.writes if path == mine]

    def reload(self, sections: Mapping[str, Any]) -> None:
        loaded = self.agent.last_reload[1]
        self.write({**self.base, **sections})
        self.agent.reload_requested.set()
        self.wait("the policy reloaded", lambda: self.agent.last_reload[1] != loaded)
        assert self.agent.last_reload[0], "the reload applied"

    def wait(self, what: str, check: Callable[[], bool]) -> None:
        assert wait_for(lambda: check() or not self.loop.is_alive(), WAIT_S, step=0.1), (
            f"{what}: not within {WAIT_S:.0f} s"
        )
        assert self.loop.is_alive(), f"{what}: the loop ended"

    def stop(self) -> None:
        self.agent.stop.set()
        self.loop.join(timeout=60)
        assert not self.loop.is_alive(), "the loop did not stop within 60 s"

    def stop_and_release(self) -> None:
        """As `systemctl stop` does: the loop stops, then the unit's ExecStopPost= release."""
        self.stop()
        done = subprocess.run(
            [sys.executable, "-m", "nodeagent", "release", "--all", "--config", str(self.policy)],
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents a test started: stopped after it, whatever happened."""
    started: list[Agent] = []
    yield started
    for a in started:
        a.agent.stop.set()
        a.loop.join(timeout=60)


def frozen_below(top: Path) -> list[str]:
    return [d for d, _, files in os.walk(top) if "cgroup.freeze" in files
            and read(d, "cgroup.freeze") == "1"]  # fmt: skip


@pytest.mark.timeout(600)  # a freeze by protection takes ticks of pressure under TCG
def test_a_workload_protection_froze_is_thawed_when_a_reload_no_longer_claims_it(
    two_cpus: float,
    managed: str,
    cgroup_sandbox: Path,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    agents: list[Agent],
) -> None:
    """Inference stalls and a batch floor too high for throttling to help: the batch cgroup
    is frozen (test_protection's recipe). A reload whose rules claim inference only: the batch
    cgroup is thawed while the pressure goes on, and says so in the audit log; its weight
    (and any cap) are handed back too, each an audit record (before, only the stop did)."""
    infer, low = Path(ROOT, managed, "i-1"), Path(ROOT, managed, "b-1")
    base = {
        "node": {"reserved_cpu": two_cpus},
        "fair_share": {"active_threshold": 0},
        "classes": {"batch": {"floor_cpu": 1.5}},
        "protection": {"step": 0.5, "calm_ticks": 2, "freeze_after": 2},
        "rules": [INFER, BATCH],
    }
    a = Agent(tmp_path, managed, base)
    agents.append(a)
    for cg in (infer, low):
        cg.mkdir()
    stays = sleeper(low)
    procs += [stays, busy(low), busy(infer), busy(infer), busy(infer)]
    a.wait("b-1 frozen by protection", lambda: read(low, "cgroup.freeze") == "1")
    assert ("0", "1") in [(old, new) for old, new, _ in a.freezes(low)]

    a.reload({"rules": [INFER]})
    a.wait("b-1 thawed once no rule claims it", lambda: read(low, "cgroup.freeze") == "0")
    assert wait_for(lambda: "frozen 0" in read(low, "cgroup.events"), timeout=30)
    a.wait("the thaw's audit record", lambda: ("1", "0", THAWED) in a.freezes(low))
    assert stays.poll() is None, "frozen and thawed, never killed"
    # and what else the agent set there (its weight, protection's cap) is handed back too
    a.wait(
        "b-1's weight and cap handed back",
        lambda: (read(low, "cpu.weight"), read(low, "cpu.max")) == ("100", "max 100000"),
    )
    handed = [p.rsplit("/", 1)[1] for p, _, _, why in a.writes
              if p.startswith(f"{low}/") and why.startswith(RELEASED)]  # fmt: skip
    assert handed, a.writes  # not only found that way: handed back by the agent
    for p in procs[1:]:  # the pressure's work is done: the VM's CPUs back for release's start
        p.kill()
        p.wait()
    a.stop_and_release()
    assert frozen_below(cgroup_sandbox) == []


def test_a_workload_frozen_for_a_gpu_violation_is_thawed_when_its_rule_is_removed(
    managed: str,
    cgroup_sandbox: Path,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    agents: list[Agent],
) -> None:
    """A real process in a claimed cgroup is listed on GPU 1, which its cgroup does not hold
    (the simulated node reads its cgroup from /proc): with gpu.on_violation: freeze the
    workload is frozen; a reload whose rules no longer claim it thaws it, though the process
    is still on the GPU (it is no longer the agent's to judge)."""
    job = Path(ROOT, managed, "v-1")
    job.mkdir(parents=True)
    stray = sleeper(job)
    procs.append(stray)
    node = tmp_path / "node.yaml"
    node.write_text(
        NODE.read_text().split("\nprocesses:")[0]
        + f"\nprocesses:\n  - {{pid: {stray.pid}, gpu: 1}}\n"
    )
    rule = {"name": "v", "match": {"name": "v-*"}, "tenant": "t", "class": "batch"}
    base = {"gpu": {"simulate": str(node), "on_violation": "freeze"}, "rules": [rule]}
    a = Agent(tmp_path, managed, base)
    agents.append(a)
    a.wait("v-1 frozen for its GPU violation", lambda: read(job, "cgroup.freeze") == "1")
    a.wait("the tick's record", lambda: a.agent.rec.last is not None)  # made after its writes
    last = a.agent.rec.last
    assert last is not None
    assert [n.fields["pid"] for n in last.plan.notes if n.kind == "gpu-violation"] == [stray.pid]

    a.reload({"rules": [NOBODY]})
    a.wait("v-1 thawed once its rule is gone", lambda: read(job, "cgroup.freeze") == "0")
    a.wait("the thaw's audit record", lambda: ("1", "0", THAWED) in a.freezes(job))
    assert stray.poll() is None
    a.stop_and_release()
    assert frozen_below(cgroup_sandbox) == []


def test_a_container_scope_frozen_for_a_gpu_violation_is_thawed_through_systemd(
    systemd_host: SystemdHost, tmp_path: Path
) -> None:
    """A docker-named scope systemd owns, frozen for a GPU violation through FreezeUnit; a
    reload whose rules no longer claim it: thawed through ThawUnit (systemd's own freezer
    state says running, so a later FreezeUnit/ThawUnit of the unit agrees), audited. The
    agent runs in this process against the test systemd's bus (test_systemd_manage's way)."""
    host = systemd_host
    unit = f"docker-{secrets.token_hex(32)}.scope"
    scope = host.start_scope(unit)
    try:
        (pid,) = read(scope, "cgroup.procs").split()
        node = tmp_path / "node.yaml"
        listed = f"\nprocesses:\n  - {{pid: {pid}, gpu: 1, cgroup: system.slice/{unit}}}\n"
        node.write_text(NODE.read_text().split("\nprocesses:")[0] + listed)
        docker = {"name": "docker", "match": {"runtime": "docker"}, "tenant": "t"}

        def policy(rule: Mapping[str, Any]) -> PolicySpec:
            gpu = {"simulate": str(node), "on_violation": "freeze"}
            return spec("nodeagent.slice", tmp_path, tenants={"t": {"shares": 1}}, rules=[rule],
                        gpu=gpu)  # fmt: skip

        agent = open_agent(policy(docker), CgroupTree(str(host.cgroup)))
        agent.rec.executor.units = Systemd(bus_address=host.system_bus_address, timeout=30)
        writes: list[tuple[str, str | None, str, str]] = []
        agent.rec.executor.audit = lambda path, attr, old, new, why: writes.append(
            (attr, old, new, why)
        )
        agent.prepare()

        def state() -> str:
            shown = host.systemctl("show", unit, "-p", "FreezerState").stdout.strip()
            return f"{read(scope, 'cgroup.freeze')} {shown}"

        assert wait_for(lambda: agent.tick() is not None and state() == "1 FreezerState=frozen",
                        timeout=WAIT_S, step=0.5), state()  # fmt: skip
        agent.rec.reloaded(policy(NOBODY))  # what `Agent.reload` applies once the file loads
        assert wait_for(lambda: agent.tick() is not None and state() == "0 FreezerState=running",
                        timeout=WAIT_S, step=0.5), state()  # fmt: skip
        thaws = [w for w in writes if w[:3] == ("cgroup.freeze", "1", "0")]
        assert thaws == [("cgroup.freeze", "1", "0", f"{THAWED} (through systemd, unit {unit})")]
        agent.tick()
        assert state() == "0 FreezerState=running", "and left so"
    finally:
        host.systemctl("stop", unit, check=False)
