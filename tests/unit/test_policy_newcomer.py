"""The fast path's plan for a new cgroup: its own caps, and its tenant's weight beside it."""

from __future__ import annotations

from builders import job, snapshot, spec, workload

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight
from nodeagent.policy.classify import assign
from nodeagent.policy.newcomer import plan_newcomers
from nodeagent.policy.plan import make_plan

RULES = [
    {"name": "a", "match": {"name": "a-*"}, "tenant": "a", "limits": {"cpu_max": 0.5}},
    {"name": "b", "match": {"name": "b-*"}, "tenant": "b"},
]


def test_a_newcomer_gets_its_caps_and_its_tenants_weight() -> None:
    policy = spec({"a": 3, "b": 1}, RULES)
    before = snapshot([workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1")])
    last = make_plan(before, policy, {})
    a_weight = last.cgroups[0].targets[Attribute.CPU_WEIGHT].value
    new = [job("nodeagent.slice/a-2"), job("nodeagent.slice/b-2"), job("other.slice/x")]
    plan, snap = plan_newcomers(
        new, assign(new, policy), policy, previous=last, node=before.node, wall_time=0.0
    )
    targets = {cg.path: cg.targets for cg in plan.cgroups}
    assert set(targets) == {"nodeagent.slice/a-2", "nodeagent.slice/b-2"}, "unclaimed: left"
    a2 = targets["nodeagent.slice/a-2"]
    assert a2[Attribute.CPU_MAX].value == CpuMax(50_000)
    assert a2[Attribute.CPU_WEIGHT].value == a_weight
    assert isinstance(a_weight, CpuWeight) and a_weight.value > 100, "a has 3 shares of 4"
    assert snap.workloads[0].sample.settings == {}, "nothing read: the executor re-reads"


def test_without_a_sibling_the_weight_waits_for_the_full_tick() -> None:
    policy = spec({"a": 1}, RULES[:1])
    new = [job("nodeagent.slice/a-1")]
    node = snapshot([]).node
    plan, _ = plan_newcomers(
        new, assign(new, policy), policy, previous=None, node=node, wall_time=0
    )
    assert set(plan.cgroups[0].targets) == {Attribute.CPU_MAX}
