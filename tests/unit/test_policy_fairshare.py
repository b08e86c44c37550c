"""Fair share: cpu.weight follows tenant shares, corrected by decayed usage."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
from builders import plan_claimed, policy_input, snapshot, spec, workload
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from nodeagent.cgroupfs.values import Attribute, CpuWeight
from nodeagent.policy.base import CpuTarget, Decision, Floor, Note, PolicyInput, Share
from nodeagent.policy.fairshare import FairShare, is_active
from nodeagent.policy.weights import CpuWeights
from nodeagent.policyfile.model import FairShareSettings, PolicySpec, Tenant
from nodeagent.snapshot import CgroupSample, WorkloadState


def weights(given_: PolicyInput) -> dict[str, int]:
    """Fair share, then the weights made from its shares, as the plan runs them."""
    shares = list(FairShare().decide(given_))
    assert all(isinstance(s, Share) for s in shares)
    decisions = [
        d
        for d in CpuWeights().decide(replace(given_, earlier=tuple(shares)))
        if not isinstance(d, Note | CpuTarget)  # the hierarchy's report, the targets
    ]
    out = {}
    for d in decisions:
        assert isinstance(d, Decision)
        assert d.attribute is Attribute.CPU_WEIGHT
        assert isinstance(d.value, CpuWeight)
        out[d.path] = d.value.value
    assert len(out) == len(decisions) == len(shares), "one decision per cgroup"
    return out


def tenant_total(w: dict[str, int], tenant: str) -> int:
    return sum(v for path, v in w.items() if path.startswith(f"nodeagent.slice/{tenant}-"))


def decide(
    workloads: list[WorkloadState],
    shares: Mapping[str, float],
    usage: Mapping[str, float] | None = None,
    **fair_share: Any,
) -> dict[str, int]:
    return weights(policy_input(snapshot(workloads), spec(shares, **fair_share), usage))


TWO_TO_ONE = [
    workload("nodeagent.slice/a-1"),
    *(workload(f"nodeagent.slice/b-{i}") for i in range(4)),
]


def test_two_to_one_shares_with_unequal_workload_counts() -> None:
    w = decide(TWO_TO_ONE, {"a": 2, "b": 1})
    a, b = tenant_total(w, "a"), tenant_total(w, "b")
    assert a / b == pytest.approx(2.0, rel=0.02)
    b_weights = {v for p, v in w.items() if "/b-" in p}
    assert len(b_weights) == 1, "b's cgroups get equal weights"
    # the budget is weight_per_workload per active workload: 100 x 5
    assert w["nodeagent.slice/a-1"] == 333
    assert b_weights == {42}


def test_more_cgroups_do_not_buy_a_tenant_more_cpu() -> None:
    few = decide(TWO_TO_ONE, {"a": 1, "b": 1})
    assert tenant_total(few, "a") == pytest.approx(tenant_total(few, "b"), rel=0.02)


@pytest.mark.parametrize("scale", [1.0, 1000.0, 1e6])
def test_usage_in_proportion_to_shares_keeps_the_share_ratio(scale: float) -> None:
    w = decide(TWO_TO_ONE, {"a": 2, "b": 1}, {"a": 2 * scale, "b": scale})
    assert tenant_total(w, "a") / tenant_total(w, "b") == pytest.approx(2.0, rel=0.02)


def test_a_tenant_that_over_used_gets_less_than_its_share() -> None:
    shares = {"a": 1, "b": 1}
    fresh = decide(TWO_TO_ONE, shares)
    used = decide(TWO_TO_ONE, shares, {"a": 900.0, "b": 100.0})
    # equal shares: without usage a and b split evenly
    assert tenant_total(fresh, "a") == pytest.approx(tenant_total(fresh, "b"), rel=0.02)
    # a used 90%: F_a = 2^(-0.9/0.5) = 0.287, F_b = 2^(-0.1/0.5) = 0.871
    assert tenant_total(used, "a") < tenant_total(used, "b")
    ratio = tenant_total(used, "a") / tenant_total(used, "b")
    assert ratio == pytest.approx(2 ** (-1.8) / 2 ** (-0.2), rel=0.03)
    assert used["nodeagent.slice/a-1"] < fresh["nodeagent.slice/a-1"]


def test_more_usage_never_means_more_weight() -> None:
    shares = {"a": 2, "b": 1}
    previous = None
    for a_usage in [0, 10, 100, 1000, 10_000, 100_000]:
        weight = decide(TWO_TO_ONE, shares, {"a": a_usage, "b": 500})["nodeagent.slice/a-1"]
        if previous is not None:
            assert weight <= previous
        previous = weight
    assert previous is not None and previous < 333


def test_usage_of_tenants_without_active_workloads_is_ignored() -> None:
    base = decide(TWO_TO_ONE, {"a": 2, "b": 1, "c": 5})
    with_c = decide(TWO_TO_ONE, {"a": 2, "b": 1, "c": 5}, {"c": 1e9})
    assert base == with_c == decide(TWO_TO_ONE, {"a": 2, "b": 1})


@pytest.mark.parametrize(
    "idle",
    [
        workload("nodeagent.slice/b-idle", cpu_rate=2.0, populated=False),
        workload("nodeagent.slice/b-idle", cpu_rate=0.001),  # below active_threshold 0.01
        workload("nodeagent.slice/b-idle", cpu_rate=0.0),
    ],
    ids=["unpopulated", "below-threshold", "zero"],
)
def test_idle_workloads_do_not_dilute_their_tenant(idle: WorkloadState) -> None:
    without = decide(TWO_TO_ONE, {"a": 2, "b": 1})
    with_idle = decide([*TWO_TO_ONE, idle], {"a": 2, "b": 1})
    assert {p: v for p, v in with_idle.items() if p != idle.path} == without
    # the idle one carries its tenant's weight, so it competes evenly when it wakes
    assert with_idle[idle.path] == without["nodeagent.slice/b-0"]


def test_first_tick_without_a_rate_counts_as_active() -> None:
    first = [workload("nodeagent.slice/a-1", None), workload("nodeagent.slice/b-1", None)]
    w = decide(first, {"a": 3, "b": 1})
    assert w == {"nodeagent.slice/a-1": 150, "nodeagent.slice/b-1": 50}


def test_an_all_idle_tenant_gets_no_decision() -> None:
    workloads = [
        workload("nodeagent.slice/a-1"),
        workload("nodeagent.slice/b-1", populated=False),
        workload("nodeagent.slice/b-2", cpu_rate=0.0),
    ]
    w = decide(workloads, {"a": 1, "b": 100})
    assert set(w) == {"nodeagent.slice/a-1"}
    assert w["nodeagent.slice/a-1"] == 100  # alone: the whole budget of 1 x 100


def test_nothing_active_means_no_decisions() -> None:
    assert decide([workload("nodeagent.slice/a-1", populated=False)], {"a": 1}) == {}
    assert decide([], {"a": 1}) == {}


def test_unassigned_workloads_get_no_decision() -> None:
    w = decide([*TWO_TO_ONE, workload("elsewhere.slice/x-1")], {"a": 2, "b": 1})
    assert "elsewhere.slice/x-1" not in w
    assert len(w) == 5


def test_active_threshold_is_configurable() -> None:
    workloads = [workload("nodeagent.slice/a-1", 0.3), workload("nodeagent.slice/b-1", 0.6)]
    assert set(decide(workloads, {"a": 1, "b": 1}, active_threshold=0.5)) == {"nodeagent.slice/b-1"}


@pytest.mark.parametrize(
    ("state", "active"),
    [
        (workload("x", 0.01, True), True),
        (workload("x", 0.0099, True), False),
        (workload("x", None, True), True),
        (workload("x", None, None), True),  # cgroup.events unreadable: not known idle
        (workload("x", 5.0, False), False),
    ],
)
def test_is_active(state: WorkloadState, active: bool) -> None:
    assert is_active(state, FairShareSettings()) is active


@pytest.mark.parametrize(
    ("shares", "per_workload", "expected_a"),
    [
        ({"a": 1000, "b": 1}, 10_000, 10_000),  # 10000 x 5 x ~1 for one cgroup: clamped
        ({"a": 1, "b": 1000}, 1, 1),  # 5 x ~0.001: rounds to 0, clamped up to 1
    ],
)
def test_weights_are_clamped(shares: dict[str, float], per_workload: int, expected_a: int) -> None:
    w = decide(TWO_TO_ONE, shares, weight_per_workload=per_workload)
    assert w["nodeagent.slice/a-1"] == expected_a


def test_trace_explains_the_arithmetic() -> None:
    given_ = policy_input(snapshot(TWO_TO_ONE), spec({"a": 2, "b": 1}), {"a": 0.0})
    d = next(
        d
        for d in FairShare().decide(given_)
        if isinstance(d, Share) and d.path == "nodeagent.slice/a-1"
    )
    assert "tenant a: shares 2 of 3" in d.trace[0]
    assert "F=2^(-u/s)=1.000" in d.trace[1]
    assert d.trace[2] == (
        "tenant gets s*F/sum(s*F) = 0.667 of the pool, split over 1 active workload(s) = 0.667 each"
    )
    assert d.reason == "fair share: tenant a 67% of the pool, split over 1 active"
    plan = plan_claimed(snapshot(TWO_TO_ONE), spec({"a": 2, "b": 1}), {})
    cg = next(c for c in plan.cgroups if c.path == "nodeagent.slice/a-1")
    weight = cg.targets[Attribute.CPU_WEIGHT].value
    share = next(i for i, line in enumerate(cg.trace) if line.startswith("fair-share: fair share"))
    assert cg.trace[share + 1].startswith("cpu-weights: target ")
    assert cg.trace[share + 1].endswith(" of the 8.00-core pool")
    assert cg.trace[share + 2] == (
        "cpu-weights: weights follow targets among 5 active sibling(s) under nodeagent.slice:"
        f" 62.5 per core -> {weight.render()}"
    )


def test_shares_are_bounded_so_the_split_cannot_overflow() -> None:
    """Shares near the float limit would sum to inf and divide by zero; the schema stops them."""
    with pytest.raises(ValidationError, match="less than or equal to 1000000"):
        decide(TWO_TO_ONE, {"a": 1e308, "b": 1e308})
    w = decide(TWO_TO_ONE, {"a": 1e6, "b": 1e6})
    assert tenant_total(w, "a") == pytest.approx(tenant_total(w, "b"), rel=0.02)


@pytest.mark.parametrize("tiny", [1e-320, 5e-324, 1e-9, 0.001])
@pytest.mark.parametrize("usage", [{}, {"big": 1e9, "tiny": 1e-9}, {"big": 0.0, "tiny": 1e9}])
def test_tiny_shares_never_divide_by_zero(tiny: float, usage: dict[str, float]) -> None:
    """The regression: shares 1e6 against 1e-320 made every s*F underflow to 0, then 0/0.
    The schema now bounds shares too; the arithmetic must hold whatever it is given."""
    valid = spec({"big": 1, "tiny": 1})
    policy = valid.model_copy(
        update={"tenants": {"big": Tenant(shares=1e6), "tiny": Tenant.model_construct(shares=tiny)}}
    )
    snap = snapshot([workload("nodeagent.slice/big-1"), workload("nodeagent.slice/tiny-1")])
    w = weights(policy_input(snap, policy, usage))
    assert 1 <= w["nodeagent.slice/tiny-1"] <= w["nodeagent.slice/big-1"] <= 10_000


# --- properties --------------------------------------------------------------------------

tenant_cases = st.lists(
    st.tuples(
        st.floats(min_value=0.001, max_value=1e6),  # shares
        st.integers(min_value=0, max_value=6),  # active workloads
        st.integers(min_value=0, max_value=3),  # idle workloads
        st.floats(min_value=0, max_value=1e9),  # decayed usage, core-seconds
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(tenant_cases, st.integers(min_value=1, max_value=10_000))
def test_fair_share_never_fails_and_stays_in_range(
    tenants: list[tuple[float, int, int, float]], per_workload: int
) -> None:
    shares = {f"t{i}": s for i, (s, *_rest) in enumerate(tenants)}
    usage = {f"t{i}": u for i, (*_rest, u) in enumerate(tenants)}
    workloads = []
    for i, (_, active, idle, _) in enumerate(tenants):
        workloads += [workload(f"nodeagent.slice/t{i}-a{j}", 1.0) for j in range(active)]
        workloads += [workload(f"nodeagent.slice/t{i}-i{j}", 0.0) for j in range(idle)]
    workloads.append(workload("other.slice/unmanaged.service"))

    w = decide(workloads, shares, usage, weight_per_workload=per_workload)

    assert all(1 <= v <= 10_000 for v in w.values())
    decided = Counter(p.split("/")[1].split("-")[0] for p in w)
    for i, (_, active, idle, _) in enumerate(tenants):
        tenant = f"t{i}"
        if active == 0:
            assert decided[tenant] == 0, "an all-idle tenant gets no decision"
        else:
            assert decided[tenant] == active + idle
            mine = {v for p, v in w.items() if p.startswith(f"nodeagent.slice/{tenant}-")}
            assert len(mine) == 1, "a tenant's cgroups get one weight"
    assert "other.slice/unmanaged.service" not in w


def _with_weight(w: WorkloadState, weight: int) -> WorkloadState:
    sample = CgroupSample(populated=True, settings={Attribute.CPU_WEIGHT: CpuWeight(weight)})
    return WorkloadState(w.identity, sample, w.cpu_rate)


@pytest.mark.parametrize(
    ("current", "expected"),
    [(333, 333), (320, 320), (346, 346), (316, 333), (350, 333), (100, 333)],
)
def test_a_weight_within_the_deadband_is_kept(current: int, expected: int) -> None:
    """The target is 333; within 5% (316.6..349.7) the kernel's value stands, so no write."""
    workloads = [_with_weight(TWO_TO_ONE[0], current), *TWO_TO_ONE[1:]]
    assert decide(workloads, {"a": 2, "b": 1})["nodeagent.slice/a-1"] == expected


def test_a_zero_deadband_always_writes_the_target() -> None:
    workloads = [_with_weight(TWO_TO_ONE[0], 332), *TWO_TO_ONE[1:]]
    assert decide(workloads, {"a": 2, "b": 1}, deadband=0)["nodeagent.slice/a-1"] == 333


def test_a_pod_claimed_with_its_containers_counts_once_in_usage_shares_and_reservations() -> None:
    """Issue 13.12: the pod's CPU holds its containers'; counting both doubled the tenant's
    usage and split its part (and a class reservation) over a third 'workload'."""
    from builders import CID, CID2, POD_UID, k8s_container

    from nodeagent.identity import Kind, Owner, QosTier, Runtime, WorkloadIdentity
    from nodeagent.policy.history import tick_usage
    from nodeagent.policy.reservations import Reservations

    pod_path = f"kubepods/burstable/pod{POD_UID}"
    pod = WorkloadIdentity(
        pod_path, Kind.POD, Runtime.KUBELET, Owner.CGROUPFS, "pod", None, POD_UID, QosTier.BURSTABLE
    )
    leaves = [
        workload(pod, 2.0),
        workload(k8s_container(CID), 1.0),
        workload(k8s_container(CID2), 1.0),
    ]
    rules = [
        {"name": "b", "match": {"path": "nodeagent.slice/*"}, "tenant": "b"},
        {"name": "pods", "match": {"qos": "burstable"}, "tenant": "a", "class": "inference"},
    ]
    policy = PolicySpec.model_validate(
        {
            "version": 1,
            "tenants": {"a": {"shares": 1}, "b": {"shares": 1}},
            "rules": rules,
            "classes": {"inference": {"reserved_cpu": 1}},
        }
    )
    snap = snapshot([*leaves, workload("nodeagent.slice/b-1", 2.0)])
    given_ = policy_input(snap, policy)
    assert pod_path in given_.assignments
    assert tick_usage(snap, given_.assignments) == {"a": 2.0, "b": 2.0}
    shares = {s.path: s.fraction for s in FairShare().decide(given_) if isinstance(s, Share)}
    assert pod_path not in shares
    assert shares[k8s_container(CID).path] == pytest.approx(0.25)
    floors = Reservations().decide(given_)
    assert {f.path for f in floors if isinstance(f, Floor)} == {
        k8s_container(CID).path,
        k8s_container(CID2).path,
    }
