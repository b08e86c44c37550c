"""The plan cache on its own (nodeagent.policy.plancache): its key, and when it makes the
last plan again. No daemon, no tree: hand-built snapshots (builders.py), a clock the test
passes, and a policy that counts its calls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from builders import snapshot, spec, workload

from nodeagent.policy.base import Assignment, Output, Policy, PolicyInput
from nodeagent.policy.classify import assign
from nodeagent.policy.plan import DEFAULT_POLICIES, Plan
from nodeagent.policy.plancache import PlanCache, PlanInputs, usage_shares
from nodeagent.policy.reads import Reads
from nodeagent.policyfile.model import PolicySpec, WorkloadClass
from nodeagent.snapshot import NodeSnapshot, WorkloadState

SPEC = spec({"a": 2, "b": 1}).model_copy()
SPEC = SPEC.model_copy(update={"agent": SPEC.agent.model_copy(update={"replan_interval": 30.0})})


class Counting(Policy):
    """Decides nothing; counts how often a plan is made, and is stale when told. Declares
    the reads the cache keys, as a policy that reads them does."""

    name = "counting"
    reads = Reads(
        snapshot=frozenset({"gpus", "skipped", "levels"}),
        workload=frozenset({"cpu_rate"}),
        usage=True,
        carry=True,
        at_work=frozenset({"again"}),
    )

    def __init__(self) -> None:
        self.calls = 0
        self.moving = False

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        self.calls += 1
        return ()

    def stale_sensed(
        self,
        workloads: Sequence[WorkloadState],
        spec: PolicySpec,
        assignments: Mapping[str, Assignment],
    ) -> bool:
        return self.moving


def inputs(
    snap: NodeSnapshot,
    last: Plan | None,
    usage: Mapping[str, float] | None = None,
    carry: Mapping[str, Mapping[str, object]] | None = None,
    held_back: bool = False,
) -> PlanInputs:
    assignments = assign((w.identity for w in snap.workloads), SPEC)
    return PlanInputs(
        snap, SPEC, usage or {"a": 10.0, "b": 10.0}, carry or {}, assignments, last, held_back
    )


WORKLOADS = (workload("nodeagent.slice/a-1"), workload("nodeagent.slice/b-1"))


@pytest.fixture
def counting() -> Counting:
    return Counting()


def test_an_unchanged_key_makes_the_last_plan_again_with_usage_advanced(
    counting: Counting,
) -> None:
    cache, policies = PlanCache(), (counting,)
    first, same = cache.plan(inputs(snapshot(WORKLOADS, seq=1), None), policies, now=0.0)
    assert (same, counting.calls) == (False, 1)
    again, same = cache.plan(inputs(snapshot(WORKLOADS, seq=2), first), policies, now=1.0)
    assert (same, counting.calls) == (True, 1)
    assert again.seq == 2 and again.cgroups is first.cgroups
    # one busy core each for the snapshot's second, on top of the decayed history
    assert again.tenant_usage["a"] > 10.0 and again.tenant_usage["b"] > 10.0


@pytest.mark.parametrize(
    "change",
    [
        "a workload comes",
        "one goes and another comes",
        "a workload idles",
        "the usage shares move",
        "replan_interval passes",
        "a policy's carry is stale",
        "a policy finds the workloads stale",
        "a memory.max is held back",
        "an expiry (a reload)",
        "no last plan",
        "a workload is claimed as another class (renamed, relabelled)",
    ],
)
def test_what_makes_a_new_plan(counting: Counting, change: str) -> None:
    cache, policies = PlanCache(), (counting,)
    first, _ = cache.plan(inputs(snapshot(WORKLOADS, seq=1), None), policies, now=0.0)
    snap, now = snapshot(WORKLOADS, seq=2), 1.0
    last: Plan | None = first
    usage, carry, held_back = {"a": 10.0, "b": 10.0}, {}, False
    if change == "a workload comes":
        snap = snapshot((*WORKLOADS, workload("nodeagent.slice/a-2")), seq=2)
    elif change == "one goes and another comes":  # as many as before
        snap = snapshot((WORKLOADS[0], workload("nodeagent.slice/b-2")), seq=2)
    elif change == "a workload idles":
        snap = snapshot((WORKLOADS[0], replace(WORKLOADS[1], cpu_rate=0.0)), seq=2)
    elif change == "the usage shares move":
        usage = {"a": 10.0, "b": 12.0}  # 50% -> 45%
    elif change == "replan_interval passes":
        now = 30.0
    elif change == "a policy's carry is stale":
        carry = {"counting": {"again": True}}
    elif change == "a policy finds the workloads stale":
        counting.moving = True  # asked again only of new states: the sensor keeps old ones
        assert cache.plan(inputs(snap, last), policies, now=now)[1]
        snap = snapshot(tuple(replace(w) for w in WORKLOADS), seq=2)
    elif change == "a memory.max is held back":
        held_back = True
    elif change == "an expiry (a reload)":
        cache.expire()
    elif change == "no last plan":
        last = None
    given = inputs(snap, last, usage, carry, held_back)
    if change.startswith("a workload is claimed as another class"):
        path = WORKLOADS[0].identity.path
        other = replace(given.assignments[path], workload_class=WorkloadClass.INFERENCE)
        given = replace(given, assignments={**given.assignments, path: other})
    _, same = cache.plan(given, policies, now=now)
    assert (same, counting.calls) == (False, 2)


def test_the_usage_history_moves_the_key_only_by_the_percent() -> None:
    assert usage_shares({"a": 100.0, "b": 100.0}) == usage_shares({"a": 100.4, "b": 100.0})
    assert usage_shares({"a": 100.0, "b": 100.0}) != usage_shares({"a": 110.0, "b": 100.0})
    assert usage_shares({}) == ()


def test_the_default_policies_plan_and_reuse_without_a_daemon() -> None:
    """The real pipeline through the cache: the same snapshot twice is one plan."""
    cache = PlanCache()
    first, same = cache.plan(inputs(snapshot(WORKLOADS, seq=1), None), DEFAULT_POLICIES, 0.0)
    assert not same and {c.path for c in first.cgroups} == {w.path for w in WORKLOADS}
    _, same = cache.plan(inputs(snapshot(WORKLOADS, seq=2), first), DEFAULT_POLICIES, 1.0)
    assert same


class Stalls(Policy):
    """Finds the plan stale while a workload runs above one core."""

    name = "stalls"

    def decide(self, given: PolicyInput) -> Sequence[Output]:
        return ()

    def stale_sensed(
        self,
        workloads: Sequence[WorkloadState],
        spec: PolicySpec,
        assignments: Mapping[str, Assignment],
    ) -> bool:
        return any((w.cpu_rate or 0.0) > 1.0 for w in workloads)


@pytest.mark.parametrize("then", ["it calms", "it goes"])
def test_a_stale_workload_stops_making_new_plans_once_it_calms_or_goes(then: str) -> None:
    """Staleness is kept per workload and asked again only of new states: the one that
    made it stale calming (a new state) or going ends it; the others' kept states don't."""
    cache, policies = PlanCache(), (Stalls(),)
    hot = replace(WORKLOADS[1], cpu_rate=2.0)
    last, same = cache.plan(inputs(snapshot((WORKLOADS[0], hot), seq=1), None), policies, 0.0)
    last, same = cache.plan(inputs(snapshot((WORKLOADS[0], hot), seq=2), last), policies, 1.0)
    assert not same, "stale: a new plan every tick"
    after = (WORKLOADS[0], replace(hot, cpu_rate=0.5)) if then == "it calms" else WORKLOADS[:1]
    last, same = cache.plan(inputs(snapshot(after, seq=3), last), policies, 2.0)
    assert same == (then == "it calms"), "calm at once; one going makes one new plan"
    _, same = cache.plan(inputs(snapshot(after, seq=4), last), policies, 3.0)
    assert same
