"""The fast path's plan for a new cgroup: its own caps, and its tenant's weight beside it."""

from __future__ import annotations

from builders import job, plan_claimed, snapshot, spec, workload

from nodeagent.cgroupfs.values import Attribute, CpuMax, CpuWeight
from nodeagent.policy.classify import assign
from nodeagent.policy.newcomer import Siblings, plan_newcomers

RULES = [
    {"name": "a", "match": {"name": "a-*"}, "tenant": "a", "limits": {"cpu_max": 0.5}},
    {"name": "b", "match": {"name": "b-*"}, "tenant": "b"},
]


def test_a_newcomer_gets_its_caps_and_its_tenants_weight() -> None:
    policy = spec({"a": 3, "b": 1}, RULES)
    before = snapshot([workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1")])
    last = plan_claimed(before, policy, {})
    a_weight = last.cgroups[0].targets[Attribute.CPU_WEIGHT].value
    new = [job("nodeagent.slice/a-2"), job("nodeagent.slice/b-2"), job("other.slice/x")]
    plan, snap = plan_newcomers(
        new,
        assign(new, policy),
        policy,
        siblings=Siblings.of(last),
        node=before.node,
        wall_time=0.0,
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
        new, assign(new, policy), policy, siblings=None, node=node, wall_time=0
    )
    assert set(plan.cgroups[0].targets) == {Attribute.CPU_MAX}


CAPPED = [
    {
        "name": "a",
        "match": {"name": "a-*"},
        "tenant": "a",
        "class": "inference",
        "limits": {"cpu_max": 1.5, "memory_max": "1Gi", "memory_request": "256Mi"},
    },
]


def test_the_fast_path_and_the_full_tick_agree_on_a_newcomers_caps() -> None:
    """The same policy code, the same merge: the caps and protection the fast path writes
    are the full tick's for the same workload, so the tick that follows changes none."""
    policy = spec({"a": 1}, CAPPED)
    new = [job("nodeagent.slice/a-1")]
    full = plan_claimed(snapshot([workload("nodeagent.slice/a-1", cpu_rate=None)]), policy, {})
    fast, _ = plan_newcomers(
        new, assign(new, policy), policy, siblings=None, node=snapshot([]).node, wall_time=0
    )
    caps = {
        Attribute.CPU_MAX, Attribute.MEMORY_MAX, Attribute.MEMORY_HIGH,
        Attribute.MEMORY_MIN, Attribute.MEMORY_LOW,
    }  # fmt: skip
    want = {a: t for a, t in full.cgroups[0].targets.items() if a in caps}
    assert set(want) == caps
    assert {a: t for a, t in fast.cgroups[0].targets.items() if a in caps} == want


def test_the_trace_says_fast_path_then_what_each_policy_decided() -> None:
    policy = spec({"a": 3, "b": 1}, RULES)
    before = snapshot([workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1")])
    last = plan_claimed(before, policy, {})
    new = [job("nodeagent.slice/a-2")]
    plan, _ = plan_newcomers(
        new,
        assign(new, policy),
        policy,
        siblings=Siblings.of(last),
        node=before.node,
        wall_time=0.0,
    )
    assert plan.cgroups[0].trace == (
        "fast path: a new cgroup, before the next tick",
        "matched rule a: tenant a, class batch",
        "static-limits: rule a: cpu_max 0.5 cores",
        "sibling-weight: fast path: the weight of tenant a's workloads beside it in tick 7",
    )
    weight = plan.cgroups[0].targets[Attribute.CPU_WEIGHT]
    assert weight.policy == "sibling-weight"
    assert weight.reason == "fast path: the weight of tenant a's workloads beside it in tick 7"


def test_a_newcomer_the_pipeline_skips_gets_no_targets_as_in_a_full_tick() -> None:
    """The one merge's rule: a cgroup a policy cannot plan gets nothing this time, not even
    its siblings' weight (a full tick skips it the same way)."""
    policy = spec({"a": 1}, RULES[:1])
    before = snapshot([workload("nodeagent.slice/a-1")])
    last = plan_claimed(before, policy, {})
    new = [job("nodeagent.slice/a-2")]
    broken = assign(new, policy)["nodeagent.slice/a-2"]
    object.__setattr__(broken, "limits", None)  # a bug: no Limits at all
    plan, _ = plan_newcomers(
        new,
        {new[0].path: broken},
        policy,
        siblings=Siblings.of(last),
        node=before.node,
        wall_time=0.0,
    )
    (cg,) = plan.cgroups
    assert cg.targets == {}
    assert cg.skipped is not None and cg.skipped.startswith("static-limits: rule a: ")
