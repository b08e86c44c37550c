"""Plan reuse in the daemon's loop: a tick whose inputs are unchanged makes the last plan
again (with the usage history advanced) instead of planning anew; a changed input, a reload
or `agent.replan_interval` passing makes a new plan; jobs with deadlines are planned every
tick.

The agent runs in dry-run on a fixture tree (a plain directory standing in for cgroupfs),
its monotonic clock is the test's (`nodeagent.reconcile.time` replaced by a shim, the real
module but for `monotonic()`), each busy workload's cpu.stat moves by one core per second of that
clock, and the plans made are counted where the plan cache calls `make_plan`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from nodeagent import reconcile as reconcile_module
from nodeagent.cgroupfs.tree import CgroupTree
from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.daemon import Agent, open_agent
from nodeagent.policy import plancache as plancache_module
from nodeagent.policy.plan import make_plan
from nodeagent.policyfile.model import PolicySpec
from nodeagent.report import TickRecord

FILES = {
    "cgroup.procs": "",
    "cgroup.events": "populated 1\nfrozen 0\n",
    "cpu.weight": "100\n",
    "cpu.max": "max 100000\n",
    "memory.current": "4096\n",
    "cgroup.threads": "11\n",
    "cpu.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
}
POLICY: dict[str, Any] = {
    "version": 1,
    "agent": {"interval": 1, "replan_interval": 30},
    "tenants": {"a": {"shares": 2}, "b": {"shares": 1}},
    "rules": [
        {"name": "a", "match": {"path": "nodeagent.slice/a-*"}, "tenant": "a"},
        {"name": "b", "match": {"path": "nodeagent.slice/b-*"}, "tenant": "b"},
    ],
}


class Clock:
    """The `time` module, but for its monotonic clock: the test's."""

    def __init__(self, now: list[float]) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@dataclass
class Node:
    """The agent, its tree, its clock, and how many plans it has made."""

    agent: Agent
    root: Path
    clock: list[float]
    plans: list[float] = field(default_factory=list)
    """When (on the test's clock) each plan was made."""
    busy: dict[str, float] = field(default_factory=dict)
    """CPU-seconds used so far by each busy cgroup (cpu.stat's usage_usec)."""

    def mkdir(self, name: str, busy: bool = True) -> None:
        d = self.root / "nodeagent.slice" / name
        d.mkdir(parents=True)
        for f, text in FILES.items():
            (d / f).write_text(text)
        self.busy[name] = 0.0 if busy else -1.0
        self._stat(name)

    def _stat(self, name: str) -> None:
        used = max(0.0, self.busy[name])
        (self.root / "nodeagent.slice" / name / "cpu.stat").write_text(
            f"usage_usec {int(used * 1e6)}\nuser_usec 0\nsystem_usec 0\n"
        )

    def tick(self, seconds: float = 1.0) -> TickRecord:
        """`seconds` later, each busy cgroup having used a core all along: one tick."""
        self.clock[0] += seconds
        for name, used in self.busy.items():
            if used >= 0:
                self.busy[name] = used + seconds
            self._stat(name)
        return self.agent.tick()

    def planned(self, ticks: int = 1, seconds: float = 1.0) -> int:
        """How many new plans `ticks` more ticks made."""
        before = len(self.plans)
        for _ in range(ticks):
            self.tick(seconds)
        return len(self.plans) - before


def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **policy: Any) -> Node:
    root = tmp_path / "cgroup"
    clock = [1000.0]
    monkeypatch.setattr(reconcile_module, "time", Clock(clock))
    plans: list[float] = []

    def counted(*args: Any, **kw: Any) -> Any:
        plans.append(clock[0])
        return make_plan(*args, **kw)

    monkeypatch.setattr(plancache_module, "make_plan", counted)
    body = {**POLICY, **policy}
    body["agent"] = {**POLICY["agent"], **policy.get("agent", {})}
    body["agent"]["state_file"] = str(tmp_path / "state.json")
    agent = open_agent(PolicySpec.model_validate(body), CgroupTree(str(root)), dry_run=True)
    # a long history, the same for both: a second's use moves their parts by far less than
    # the percent that makes a new plan
    agent.rec.feedback = replace(agent.rec.feedback, usage={"a": 1e5, "b": 1e5})
    n = Node(agent, root, clock, plans)
    n.mkdir("a-1")
    n.mkdir("b-1")
    agent.prepare()
    return n


@pytest.fixture
def n(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    n = node(tmp_path, monkeypatch)
    n.planned(3)  # the first reads settle: every workload measured, busy
    yield n


def test_an_unchanged_tick_makes_the_last_plan_again(n: Node) -> None:
    last = n.agent.rec.last
    assert last is not None
    assert n.planned(5) == 0
    record = n.agent.rec.last
    assert record is not None and record is not last
    assert record.plan.cgroups is last.plan.cgroups, "the same plan, made again"
    assert record.plan.seq == record.snapshot.seq == last.snapshot.seq + 5
    # the usage history goes on, tick by tick: U' = U * 2^(-1 s / half-life) + 1 core-second
    kept = 0.5 ** (1 / n.agent.rec.spec.fair_share.half_life)
    for t in ("a", "b"):
        expected = last.plan.tenant_usage[t]
        for _ in range(5):
            expected = expected * kept + 1.0
        assert record.plan.tenant_usage[t] == pytest.approx(expected, abs=1e-6), t


def test_a_new_workload_makes_a_new_plan_with_it(n: Node) -> None:
    n.mkdir("a-2")
    n.agent.rec.registry.resync()
    assert n.planned() == 1
    assert n.agent.rec.last is not None
    assert "nodeagent.slice/a-2" in {c.path for c in n.agent.rec.last.plan.cgroups}
    assert n.planned(3) == 0


def test_a_workload_going_idle_makes_a_new_plan(n: Node) -> None:
    n.busy["b-1"] = -1.0  # its cpu.stat stops moving
    assert n.planned() == 1
    assert n.planned(3) == 0


def test_a_workload_that_cannot_be_read_makes_a_new_plan(n: Node) -> None:
    stat = n.root / "nodeagent.slice" / "b-1" / "cpu.stat"
    n.busy.pop("b-1")
    stat.write_text("usage_usec lots\n")
    assert n.planned() == 1
    assert n.agent.rec.last is not None
    assert [s.path for s in n.agent.rec.last.snapshot.skipped] == ["nodeagent.slice/b-1"]
    assert n.planned(3) == 0


def test_a_move_of_the_usage_history_by_a_percent_makes_a_new_plan(n: Node) -> None:
    usage = dict(n.agent.rec.feedback.usage)
    n.agent.rec.feedback = replace(
        n.agent.rec.feedback, usage={"a": usage["a"] * 1.02, "b": usage["b"] * 0.98}
    )
    assert n.planned() == 1


def test_a_reload_makes_a_new_plan(n: Node, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(
        "version: 1\n"
        f"agent: {{state_file: {tmp_path / 'state.json'}, replan_interval: 30}}\n"
        "tenants: {a: {shares: 1}, b: {shares: 1}}\n"
        "rules:\n"
        "  - {name: a, match: {path: nodeagent.slice/a-*}, tenant: a}\n"
        "  - {name: b, match: {path: nodeagent.slice/b-*}, tenant: b}\n"
    )
    n.agent.config_path = str(config)
    n.agent.reload()
    assert n.planned() == 1
    assert n.planned(3) == 0


def test_the_replan_interval_forces_a_new_plan(n: Node) -> None:
    """30 s: the last plan is made again until 30 s after it was made, then anew."""
    since = n.clock[0] - n.plans[-1]
    assert n.planned(int(29 - since)) == 0
    assert n.planned() == 1, "due 30 s after the last plan"
    assert n.plans[-1] - n.plans[-2] == 30
    assert n.planned(29) == 0
    assert n.planned() == 1


def test_a_replan_interval_of_zero_plans_every_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = node(tmp_path, monkeypatch, agent={"replan_interval": 0})
    n.planned(3)
    assert n.planned(4) == 4


def test_jobs_with_deadlines_are_planned_every_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    due = {
        "name": "due",
        "match": {"path": "nodeagent.slice/a-*"},
        "tenant": "a",
        "class": "training",
        "deadline": "2100-01-01T00:00:00+00:00",
        "work": 100,
    }
    n = node(tmp_path, monkeypatch, rules=[due, POLICY["rules"][1]])
    n.planned(3)
    assert n.planned(4) == 4


def test_a_reloaded_policy_that_takes_the_old_ones_id_still_claims_anew(
    n: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claims are cached under the policy's id; a policy freed by a reload may hand its
    id to the next one (CPython reuses addresses), which must not keep the old claims."""
    monkeypatch.setattr(reconcile_module, "id", lambda _: 1, raising=False)  # every id alike
    assert {a.tenant for a in n.tick().assignments.values()} == {"a", "b"}
    swapped = {**POLICY, "rules": [{"name": "all", "match": {"path": "nodeagent.slice/*"},
                                    "tenant": "b"}]}  # fmt: skip
    swapped["agent"] = {**POLICY["agent"], "state_file": n.agent.rec.spec.agent.state_file}
    n.agent.rec.reloaded(PolicySpec.model_validate(swapped))
    assert {a.tenant for a in n.tick().assignments.values()} == {"b"}


def test_a_newcomer_takes_its_siblings_weight_from_the_latest_tick(n: Node) -> None:
    """The fast path looks its tenant's weight up in what the last tick's plan gave the
    workloads beside it (an index made once per tick, not a pass over every cgroup per
    newcomer): after more ticks, from the newest one, not the tick the index was first
    made for."""

    def newcomer(name: str) -> str:
        n.mkdir(name)
        n.agent.rec.registry.poll()
        new, n.agent.rec.registry.new = n.agent.rec.registry.new, []
        n.agent.fast_path(new)
        (weight,) = [
            r for r in n.agent.rec._fast_results
            if r.path.endswith(name) and r.attribute is Attribute.CPU_WEIGHT
        ]  # fmt: skip
        return weight.reason

    last = n.agent.rec.last
    assert last is not None
    a1 = {c.path: c for c in last.plan.cgroups}["nodeagent.slice/a-1"]
    weight = a1.targets[Attribute.CPU_WEIGHT].value
    assert isinstance(weight, CpuWeight)
    first = newcomer("a-2")
    assert (
        first == f"fast path: the weight of tenant a's workloads beside it in tick {last.plan.seq}"
    )
    n.planned(2)
    assert n.agent.rec.last is not None
    seq = n.agent.rec.last.plan.seq
    assert newcomer("a-3").endswith(f"in tick {seq}") and seq == last.plan.seq + 2
