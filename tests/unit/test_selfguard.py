"""The agent never tightens its own cgroup or one above it (nodeagent.selfguard), whatever
the plan says: as a systemd service (its path from /proc/self/cgroup) and in a private
cgroup namespace (a pod: found by its own process in the tree's cgroup.procs). The tree is
a fixture directory; /proc is a fixture too."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
from builders import docker_cgroupfs, job, proc_self, snapshot, thawed_tree

from nodeagent.act import Executor, Outcome
from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight, Frozen, Value
from nodeagent.identity import WorkloadIdentity
from nodeagent.policy.plan import CgroupPlan, Plan, Target
from nodeagent.selfguard import MOST_SEARCHED, SelfGuard
from nodeagent.snapshot import CgroupSample, WorkloadState

PID = 4242
AGENT = "system.slice/nodeagent.service/agent"


def plan(
    *targets: tuple[WorkloadIdentity, Attribute, Value],
) -> tuple[Plan, list[WorkloadState]]:
    cgroups = tuple(
        CgroupPlan(who, None, {attr: Target(value, "test", f"test: {attr}")}, ())
        for who, attr, value in targets
    )
    current: dict[Attribute, Value] = {
        Attribute.FREEZE: Frozen(False),
        Attribute.CPU_MAX: CpuMax(None, 100000),
        Attribute.CPU_WEIGHT: CpuWeight(100),
    }
    states = [
        WorkloadState(who, CgroupSample(populated=True, settings=dict(current)), 1.0)
        for who, _, _ in targets
    ]
    return Plan(7, 1.0, cgroups, {}), states


def outcomes(executor: Executor, *targets: tuple[WorkloadIdentity, Attribute, Value]) -> dict[
    str, tuple[Outcome, str]
]:  # fmt: skip
    p, states = plan(*targets)
    results = executor.apply(p, snapshot(states))
    return {r.path: (r.outcome, r.detail) for r in results}


FREEZE = (Attribute.FREEZE, Frozen(True))
CAP = (Attribute.CPU_MAX, CpuMax(5000, 100000))


def test_a_service_agent_never_freezes_or_caps_its_own_cgroup_or_those_above_it(
    tmp_path: Path,
) -> None:
    cg = thawed_tree(tmp_path / "cg", [AGENT, "system.slice/other.service"])
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", AGENT), pid=PID)
    executor = Executor(cg, lambda *a: None, guard=guard)
    own, parent, other = (
        job(AGENT),
        job("system.slice/nodeagent.service"),
        job("system.slice/other.service"),
    )
    with structlog.testing.capture_logs() as logs:
        got = outcomes(executor, (own, *FREEZE), (parent, *CAP), (other, *FREEZE))
    assert got[AGENT][0] is Outcome.READ_ONLY
    assert got["system.slice/nodeagent.service"][0] is Outcome.READ_ONLY
    assert "the agent runs in system.slice/nodeagent.service/agent" in got[AGENT][1]
    assert got["system.slice/other.service"] == (Outcome.WRITTEN, "")
    assert (tmp_path / "cg" / AGENT / "cgroup.freeze").read_text() == "0\n"
    assert (tmp_path / "cg/system.slice/nodeagent.service/cpu.max").read_text() == "max 100000\n"
    assert (tmp_path / "cg/system.slice/other.service/cgroup.freeze").read_text().strip() == "1"
    said = [e for e in logs if e["event"] == "agent.own_cgroup_guarded"]
    assert sorted(e["cgroup"] for e in said) == ["system.slice/nodeagent.service", AGENT]
    with structlog.testing.capture_logs() as again:
        outcomes(executor, (own, *FREEZE))
    assert not [e for e in again if e["event"] == "agent.own_cgroup_guarded"], "said once"


def test_what_loosens_the_agents_own_cgroup_still_goes_ahead(tmp_path: Path) -> None:
    cg = thawed_tree(tmp_path / "cg", [AGENT])
    (tmp_path / "cg" / AGENT / "cgroup.freeze").write_text("1\n")
    (tmp_path / "cg" / AGENT / "cpu.max").write_text("5000 100000\n")
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", AGENT), pid=PID)
    executor = Executor(cg, lambda *a: None, guard=guard)
    p, states = plan((job(AGENT), Attribute.FREEZE, Frozen(False)))
    states = [
        WorkloadState(
            job(AGENT),
            CgroupSample(populated=True, settings={Attribute.FREEZE: Frozen(True)}),
            1.0,
        )
    ]
    [r] = executor.apply(p, snapshot(states))
    assert r.outcome is Outcome.WRITTEN, "a thaw of the agent's own cgroup is never refused"
    p, _ = plan((job(AGENT), Attribute.CPU_MAX, CpuMax(None, 100000)))
    states = [
        WorkloadState(
            job(AGENT),
            CgroupSample(populated=True, settings={Attribute.CPU_MAX: CpuMax(5000, 100000)}),
            1.0,
        )
    ]
    [r] = executor.apply(p, snapshot(states))
    assert r.outcome is Outcome.WRITTEN, "nor is lifting its cap"


POD = "kubepods/burstable/pod1234"
MINE = f"{POD}/{'a1' * 32}"
OTHER = f"kubepods/burstable/pod5678/{'b2' * 32}"


def test_in_a_pod_the_agent_finds_its_own_container_by_its_process_and_never_freezes_it(
    tmp_path: Path,
) -> None:
    """A private cgroup namespace: /proc/self/cgroup says '/', and the tree (the host's,
    mounted in) lists the agent's process, by the number its PID namespace gives it, in its
    container's cgroup.procs."""
    cg = thawed_tree(tmp_path / "cg", [MINE, OTHER], procs={MINE: f"1\n{PID}", OTHER: "1"})
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", "/"), pid=PID)
    executor = Executor(cg, lambda *a: None, guard=guard)
    mine, other = docker_cgroupfs("a1" * 32), docker_cgroupfs("b2" * 32)
    mine = WorkloadIdentity(MINE, mine.kind, mine.runtime, mine.owner, mine.name)
    other = WorkloadIdentity(OTHER, other.kind, other.runtime, other.owner, other.name)
    pod = WorkloadIdentity(POD, mine.kind, mine.runtime, mine.owner, "pod")
    got = outcomes(executor, (mine, *FREEZE), (pod, *CAP), (other, *FREEZE))
    assert got[MINE][0] is Outcome.READ_ONLY
    assert f"the agent's process {PID} runs in {MINE}" in got[MINE][1]
    assert got[POD][0] is Outcome.READ_ONLY, "its pod holds it too"
    assert got[OTHER] == (Outcome.WRITTEN, "")


def test_a_tree_too_large_to_search_is_not_tightened(tmp_path: Path) -> None:
    many = [f"kubepods/besteffort/pod{i}" for i in range(MOST_SEARCHED + 1)]
    cg = thawed_tree(tmp_path / "cg", many)
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", "/"), pid=PID)
    guard.begin()
    assert guard.refuses("kubepods/besteffort") is not None
    assert guard.refuses("kubepods/besteffort/pod0") is None


@pytest.mark.parametrize("where", ["", "user.slice"])
def test_an_agent_at_the_root_or_elsewhere_guards_only_its_own_line(
    tmp_path: Path, where: str
) -> None:
    cg = thawed_tree(
        tmp_path / "cg", ["user.slice", "system.slice/x.service"], procs={where: str(PID)}
    )
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", where or "/"), pid=PID)
    guard.begin()
    assert guard.refuses("") is not None
    assert guard.refuses("system.slice/x.service") is None
    assert (guard.refuses("user.slice") is None) == (where == "")


def test_in_a_pod_the_agents_place_once_found_costs_one_read_a_tick_until_it_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search of the tree (up to MOST_SEARCHED cgroup.procs files) is not repeated every
    tick: the next apply checks the cgroup it found, and searches again only once the
    agent's process is no longer there."""
    moved = f"{POD}/{'c3' * 32}"
    cg = thawed_tree(tmp_path / "cg", [MINE, OTHER, moved], procs={MINE: str(PID)})
    guard = SelfGuard(cg, proc_self(tmp_path / "proc", "/"), pid=PID)
    read: list[str] = []
    real = SelfGuard._in

    def counted(self: SelfGuard, path: str) -> bool:
        read.append(path)
        return real(self, path)

    monkeypatch.setattr(SelfGuard, "_in", counted)
    guard.begin()
    assert guard.refuses(OTHER) is None
    assert guard.refuses("kubepods") is not None
    assert len(read) > 4, "the first apply searches"
    read.clear()
    guard.begin()
    assert guard.refuses(OTHER) is None
    assert guard.refuses(POD) is not None
    assert read == ["", MINE], "the next reads the root's cgroup.procs and the place it found"
    (tmp_path / "cg" / MINE / "cgroup.procs").write_text("\n")
    (tmp_path / "cg" / moved / "cgroup.procs").write_text(f"{PID}\n")
    guard.begin()
    assert guard.refuses(MINE) is None, "moved away: searched again"
    assert f"the agent's process {PID} runs in {moved}" in (guard.refuses(moved) or "")


def test_where_the_agent_is_is_read_at_most_once_in_every_seconds(tmp_path: Path) -> None:
    """A burst of newcomers (each its own apply on the fast path) costs one read of
    /proc/self/cgroup with `every`; a move is seen once `every` has passed."""
    moved = "system.slice/nodeagent.service/moved"
    cg = thawed_tree(tmp_path / "cg", [AGENT, moved])
    proc = proc_self(tmp_path / "proc", AGENT)
    now = [100.0]
    guard = SelfGuard(cg, proc, pid=PID, every=1.0, clock=lambda: now[0])
    guard.begin()
    assert guard.refuses(AGENT) is not None and guard.refuses(moved) is None
    (tmp_path / "proc" / "self" / "cgroup").write_text(f"0::/{moved}\n")  # moved by another
    now[0] += 0.9
    guard.begin()
    assert guard.refuses(moved) is None, "not read again within the second"
    now[0] += 0.1
    guard.begin()
    assert guard.refuses(moved) is not None, "read again: the move is seen"
    assert guard.refuses(AGENT) is None
